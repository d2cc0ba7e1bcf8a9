"""`tokenmill serve` as a real process: it answers, and SIGTERM ends in-flight streams with a
final chunk (finish_reason "abort"), an error event and [DONE], answers requests in flight that
stream nothing with a 503, and exits 0, as it does after a second signal; with --shutdown-timeout
they finish first."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import free_port


def wait_until_up(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            output = proc.communicate(timeout=30)[0]
            raise AssertionError(f"server did not come up within 120 s; its output:\n{output[-3000:]}")
        time.sleep(0.2)


def read_stream(url: str, body: dict, events: list[str], first: threading.Event, timeout: float = 60) -> None:
    """POST a streamed completion; each event's data goes to `events`, `first` set at the first."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=timeout) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(line[len("data: "):])
                first.set()


def test_serve_answers_and_shuts_down_cleanly_on_sigterm(tiny_llama):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_llama), "--port", str(port),
                             "--served-model-name", "tiny", "--num-kv-blocks", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
        metrics = httpx.get(url + "/metrics").text
        assert "tokenmill_requests_finished_total" in metrics and "_created" not in metrics  # (vLLM's series)

        events, first, whole = [], threading.Event(), []

        def ask_whole():  # a request that streams nothing, in flight at the signal
            body = {"prompt": "w6", "max_tokens": 1000, "ignore_eos": True}
            whole.append(httpx.post(url + "/v1/completions", json=body, timeout=60))
        asker = threading.Thread(target=ask_whole)
        asker.start()

        long_stream = {"prompt": "w5", "max_tokens": 1000, "ignore_eos": True}
        reader = threading.Thread(target=read_stream, args=(url, long_stream, events, first))
        reader.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        reader.join(30)
        asker.join(30)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"  # (the OpenAI SDK raises on it)
    final = json.loads(events[-3])
    assert final["choices"][0]["finish_reason"] == "abort"
    assert len(events) < 1000  # it was cut short, not run to its 1000 tokens
    assert whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "server_shutting_down"
    log = proc.stdout.read()
    assert "POST /v1/completions 200" in log  # one line per request
    assert f"as 'tiny' on http://127.0.0.1:{port}" in log  # served on the socket bound before the load


def test_with_a_shutdown_timeout_sigterm_lets_the_requests_in_flight_finish(tiny_llama):
    """vLLM's --shutdown-timeout: the stream and the whole request in flight at SIGTERM run to their
    1000 tokens (the default, 0, cuts them short: the test above), then the server exits 0."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_llama), "--port", str(port),
                             "--served-model-name", "tiny", "--num-kv-blocks", "256", "--shutdown-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, body = f"http://127.0.0.1:{port}", {"prompt": "w5", "max_tokens": 1000, "ignore_eos": True}
    events, first, whole = [], threading.Event(), []

    streamed = {**body, "stream_options": {"include_usage": True}}
    threads = [threading.Thread(target=lambda: whole.append(httpx.post(url + "/v1/completions", json=body,
                                                                       timeout=120))),
               threading.Thread(target=read_stream, args=(url, streamed, events, first, 120))]
    try:
        wait_until_up(proc, url)
        threads[0].start()
        deadline = time.monotonic() + 30
        while 'vllm:num_requests_running{model_name="tiny"} 1.0' not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline, "the whole request never ran"
            time.sleep(0.01)
        threads[1].start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(120)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 1000
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
    assert whole[0].status_code == 200 and whole[0].json()["usage"]["completion_tokens"] == 1000
    assert "stopping: requests in flight have 60 s to finish" in proc.stdout.read()


def test_a_shutdown_timeout_that_runs_out_ends_the_stream_with_its_last_words(tiny_llama):
    """--shutdown-timeout 0.3 and a stream of 1000 tokens (a second or more) in flight at SIGTERM:
    0.3 s later the stream gets its "abort" chunk, the server_shutting_down error event and [DONE],
    and the server exits 0."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_llama), "--port", str(port),
                             "--num-kv-blocks", "256", "--shutdown-timeout", "0.3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, events, first = f"http://127.0.0.1:{port}", [], threading.Event()
    reader = threading.Thread(target=read_stream, args=(url, {"prompt": "w5", "max_tokens": 1000, "ignore_eos": True},
                                                        events, first))
    try:
        wait_until_up(proc, url)
        reader.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
    log = proc.stdout.read()
    assert "stopping: requests in flight have 0.3 s to finish" in log and "Traceback" not in log, log


def test_a_port_in_use_is_one_error_before_the_model_loads(tmp_path):
    """Bound before the load (the model path does not even exist), not by uvicorn after it."""
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", str(tmp_path / "none"),
                              "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip() == f"tokenmill: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_an_unknown_tool_call_parser_fails_before_the_model_loads():
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--tool-call-parser", "xml"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "hermes" in out.stderr


def test_protecting_metrics_and_docs_without_a_key_fails_before_the_model_loads(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", str(tmp_path / "none"),
                          "--protect-metrics-and-docs"], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"})
    assert out.returncode == 1
    assert "--protect-metrics-and-docs needs an API key" in out.stderr


def test_serve_takes_its_api_key_from_the_environment(tiny_llama):
    """TOKENMILL_API_KEY keeps the key off the command line, which any local user can read."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_llama), "--port", str(port),
                             "--num-kv-blocks", "64"], env={**os.environ, "TOKENMILL_API_KEY": "s3cret"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url)
        assert "s3cret" not in " ".join(proc.args)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_during_shutdown_still_exits_0(tiny_llama, sig):
    """An impatient operator (or a supervisor) signals twice, 0.3 s apart, with a stream open and a
    client stalled mid-body: the second signal closes the connections, so the server exits well
    before uvicorn's 10 s graceful timeout, runs the app's shutdown and logs no error."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_llama), "--port", str(port),
                             "--num-kv-blocks", "64"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    first = threading.Event()

    def stream():
        body = {"prompt": "w5", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for _ in response.iter_lines():
                    first.set()
        except httpx.TransportError:
            pass
    try:
        wait_until_up(proc, url)
        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30)
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.3)
        start = time.monotonic()
        proc.send_signal(sig)
        time.sleep(0.3)
        proc.send_signal(sig)
        assert proc.wait(30) == 0, proc.stdout.read()
        assert time.monotonic() - start < 8
        reader.join(30)
        stalled.close()
        log = proc.stdout.read()
        assert "Application shutdown complete" in log and "ERROR" not in log and "Traceback" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
