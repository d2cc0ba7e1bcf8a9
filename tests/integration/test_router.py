"""`tokenmill router` over two `tokenmill serve` replicas, all real processes on 127.0.0.1 with the
tiny llama: prefix routing and its cache hits against round-robin, outputs equal to one
server's, a replica killed with requests in flight, and the router's own answers to bad input.
Bounded: a few dozen short requests, and one run of 8 requests of 1000 tokens."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server import free_port, metric, read_events, stalled_stream

REPLICA_HEADER = "x-tokenmill-replica"
PAGE_ORIGIN = "http://page.example:3000"  # the routers' --allowed-origins


def logged(args: list[str], log: Path) -> subprocess.Popen:
    """`python -m tokenmill.cli --log-level WARNING ARGS`, its output appended to `log` (kept on the
    process as .log, so a wait that fails can show it)."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", *args],
                            stdout=log.open("a"), stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def serve(model: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    return logged(["serve", str(model), "--port", str(port), "--served-model-name", "tiny", "--num-kv-blocks", "512",
                   *extra], log)


def route(replica_ports: list[int], port: int, log: Path, *extra: str) -> subprocess.Popen:
    replicas = [arg for p in replica_ports for arg in ("--replica", f"http://127.0.0.1:{p}")]
    return logged(["router", *replicas, "--port", str(port), *extra], log)


def healthy_replicas(url: str) -> set[str]:
    try:
        states = httpx.get(url + "/health", timeout=5).json().get("replicas", {})
    except (httpx.TransportError, ValueError):
        return set()
    return {replica for replica, state in states.items() if state["healthy"]}


def wait_for(condition, procs: list[subprocess.Popen], what: str, limit_s: float = 120, every_s: float = 0.2) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert all(p.poll() is None for p in procs), f"a process exited while waiting for {what}{log_tails(procs)}"
        assert time.monotonic() < deadline, f"no {what} within {limit_s} s{log_tails(procs)}"
        time.sleep(every_s)


def log_tails(procs: list[subprocess.Popen], lines: int = 15) -> str:
    """The last lines each process logged (those started by `logged`), for a failed wait's message."""
    tails = [(p.log.name, p.poll(), p.log.read_text(errors="replace").splitlines()[-lines:])
             for p in procs if hasattr(p, "log") and p.log.exists()]
    return "".join(f"\n--- {name} ({'running' if code is None else f'exit {code}'}):\n" + "\n".join(tail)
                   for name, code, tail in tails)


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


class Cluster:
    """Replica processes and routers over them, each router URL by policy name."""

    def __init__(self, model: Path, log_dir: Path, policies: list[str], serve_args: tuple[str, ...] = (),
                 router_args: tuple[str, ...] = ()) -> None:
        self.model, self.log_dir, self.serve_args = model, log_dir, serve_args
        self.ports = [free_port(), free_port()]
        self.replicas = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs = [serve(model, p, log_dir / f"serve{i}.log", *serve_args) for i, p in enumerate(self.ports)]
        self.routers: dict[str, str] = {}
        for policy in policies:
            port = free_port()
            self.procs.append(route(self.ports, port, log_dir / f"router_{policy}.log", "--policy", policy,
                                    *router_args))
            self.routers[policy] = f"http://127.0.0.1:{port}"
        for url in self.routers.values():
            wait_for(lambda: healthy_replicas(url) == set(self.replicas), self.procs, "healthy replicas")

    def restart(self, index: int) -> None:
        self.procs[index] = serve(self.model, self.ports[index], self.log_dir / f"serve{index}.log", *self.serve_args)


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    cluster = Cluster(tiny_llama, tmp_path_factory.mktemp("router"), ["cache_aware", "round_robin"],
                      router_args=("--allowed-origins", PAGE_ORIGIN))
    try:
        yield cluster
    finally:
        stop(cluster.procs)


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(5, 380)}" for _ in range(n))


def prefix_counters(replicas: list[str]) -> tuple[float, float]:
    """The replicas' prefix-cache hits and queries (tokens), summed."""
    hits = queries = 0.0
    for url in replicas:
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def complete(url: str, prompt, **options) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **options}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_the_router_answers_a_browsers_preflight_and_marks_answers_readable_for_its_allowed_origin(cluster):
    url = cluster.routers["round_robin"]
    ask = {"access-control-request-method": "POST", "access-control-request-headers": "content-type"}
    preflight = httpx.options(url + "/v1/completions", headers={"origin": PAGE_ORIGIN, **ask})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == PAGE_ORIGIN
    relayed = httpx.post(url + "/v1/completions", headers={"origin": PAGE_ORIGIN}, timeout=60,
                         json={"model": "tiny", "prompt": "w5", "max_tokens": 1})
    assert relayed.status_code == 200 and relayed.headers["access-control-allow-origin"] == PAGE_ORIGIN
    other = httpx.post(url + "/v1/completions", headers={"origin": "http://elsewhere.example"}, timeout=60,
                       json={"model": "tiny", "prompt": "w5", "max_tokens": 1})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_requests_sharing_a_long_prefix_land_on_the_replica_that_served_the_first_of_them(cluster):
    rng = random.Random(1)
    groups = [words(rng, 150) for _ in range(3)]
    landed: dict[int, set[str]] = {g: set() for g in range(3)}
    for turn in range(3):
        for g, prefix in enumerate(groups):
            answer = complete(cluster.routers["cache_aware"], f"{prefix} {words(rng, 5)}")
            assert answer.status_code == 200
            landed[g].add(answer.headers[REPLICA_HEADER])
    assert all(len(replicas) == 1 for replicas in landed.values()), landed
    assert set().union(*landed.values()) == set(cluster.replicas)  # new prefixes spread over both


def test_cache_aware_routing_hits_the_prefix_cache_at_least_1_5_times_as_often_as_round_robin(cluster):
    """3 groups of 3 prompts (a 200-word shared prefix, 5 words of their own), the groups taking
    turns, one request at a time. Round-robin sends each group's second prompt to the other
    replica, which has not seen the prefix: 3 hitting prompts of 9 against cache_aware's 6."""
    rates = {}
    for seed, policy in enumerate(["cache_aware", "round_robin"], start=10):
        rng = random.Random(seed)
        groups = [words(rng, 200) for _ in range(3)]
        hits0, queries0 = prefix_counters(cluster.replicas)
        for turn in range(3):
            for prefix in groups:
                assert complete(cluster.routers[policy], f"{prefix} {words(rng, 5)}").status_code == 200
        time.sleep(0.3)  # the counters are read after the step whose answer came back
        hits1, queries1 = prefix_counters(cluster.replicas)
        rates[policy] = (hits1 - hits0) / (queries1 - queries0)
    assert rates["cache_aware"] > 0.5
    assert rates["cache_aware"] >= 1.5 * rates["round_robin"], rates


def stream_text(url: str, path: str, body: dict) -> tuple[str, list[str]]:
    """The text of a stream's deltas, and its events' data."""
    events, text = [], []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    for data in events[:-1]:
        choice = json.loads(data)["choices"][0]
        text.append(choice["delta"].get("content") or "" if "delta" in choice else choice["text"])
    return "".join(text), events


def test_greedy_outputs_through_the_router_equal_one_servers_streamed_or_not(cluster):
    one_server, router = cluster.replicas[0], cluster.routers["cache_aware"]
    completion = {"model": "tiny", "prompt": "w5 w6 w7 " * 30, "max_tokens": 12, "temperature": 0}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w8 w9 " * 40}], "max_tokens": 12,
            "temperature": 0}
    for path, body, field in [("/v1/completions", completion, "text"), ("/v1/chat/completions", chat, "message")]:
        direct = httpx.post(one_server + path, json=body, timeout=60).json()["choices"][0][field]
        direct = direct["content"] if field == "message" else direct
        for _ in range(2):  # on whichever replicas the router picks
            routed = httpx.post(router + path, json=body, timeout=60).json()["choices"][0][field]
            assert (routed["content"] if field == "message" else routed) == direct
            text, events = stream_text(router, path, body)
            assert text == direct and events[-1] == "[DONE]"
    batch = {**completion, "prompt": ["w10 w11", "w12 w13"], "n": 2}
    direct = [c["text"] for c in httpx.post(one_server + "/v1/completions", json=batch, timeout=60).json()["choices"]]
    routed = httpx.post(router + "/v1/completions", json=batch, timeout=60).json()["choices"]
    assert [c["text"] for c in routed] == direct and len(direct) == 4


def test_embeddings_through_the_router_equal_one_servers(cluster):
    body = {"model": "tiny", "input": ["w5 w6 w7", "w8 w9"]}
    direct = httpx.post(cluster.replicas[0] + "/v1/embeddings", json=body, timeout=60).json()
    routed = httpx.post(cluster.routers["cache_aware"] + "/v1/embeddings", json=body, timeout=60).json()
    assert [d["embedding"] for d in routed["data"]] == [d["embedding"] for d in direct["data"]]
    assert len(direct["data"]) == 2 and routed["usage"] == direct["usage"]


def test_the_router_answers_bad_input_itself_in_openai_shape_and_passes_a_replicas_4xx_unchanged(cluster):
    router = cluster.routers["cache_aware"]

    def error(response: httpx.Response, status: int) -> dict:
        assert response.status_code == status, response.text
        assert response.headers["content-type"] == "application/json"
        return response.json()["error"]

    bad = httpx.post(router + "/v1/completions", content=b"{", headers={"X-Request-Id": "r-7"})
    assert error(bad, 400)["message"] == "request body is not valid JSON" and bad.headers["x-request-id"] == "r-7"
    assert error(httpx.post(router + "/v1/chat/completions", content=b"[1]"), 400)["message"] == (
        "request body must be a JSON object")
    for depth in (600, 5000):  # past the replicas' limit; past Python 3.11's decoder (a 500 before)
        deep = b'{"prompt": "w5", "metadata": ' + b"[" * depth + b"]" * depth + b"}"
        assert error(httpx.post(router + "/v1/completions", content=deep), 400)["message"] == (
            "the body nests objects and arrays deeper than 512 levels")
    assert error(httpx.post(router + "/v1/completions", content=b" " * (5 << 20)), 413)["code"] == "request_too_large"
    assert error(httpx.get(router + "/v1/nothing"), 404)["type"] == "not_found_error"
    assert error(httpx.post(router + "/v1/responses", json={"input": "hi"}), 404)["message"] == (
        "the router does not route /v1/responses; it routes /detokenize, /health, /metrics, /tokenize, "
        "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models, /v1/models/{model_id} "
        "(send other paths to a replica)")
    assert error(httpx.get(router + "/v1/completions"), 405)["type"] == "invalid_request_error"
    assert error(httpx.get(router + "/health", headers={"Host": "attacker.example"}), 400)["code"] == "invalid_host"
    for body in [{"prompt": "w5", "max_tokens": -1}, {"model": "other", "prompt": "w5"}, {"prompt": {"a": 1}}]:
        direct = httpx.post(cluster.replicas[0] + "/v1/completions", json=body)
        routed = httpx.post(router + "/v1/completions", json=body)
        assert routed.status_code == direct.status_code and 400 <= direct.status_code < 500
        assert routed.json() == direct.json()
    models = httpx.get(router + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_a_request_id_comes_back_once_through_the_router_whole_and_streamed(cluster):
    """The replica names the answer by X-Request-Id and echoes it; the router relays that answer
    with the header once, not the replica's and its own."""
    router = cluster.routers["round_robin"]
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}
    r = httpx.post(router + "/v1/completions", json=body, headers={"X-Request-Id": "r-8"}, timeout=60)
    assert (r.status_code, r.json()["id"], r.headers.get_list("x-request-id")) == (200, "cmpl-r-8", ["r-8"])
    with httpx.stream("POST", router + "/v1/completions", json={**body, "stream": True},
                      headers={"X-Request-Id": "r-9"}, timeout=60) as response:
        assert response.headers.get_list("x-request-id") == ["r-9"]
        ids = {json.loads(line[6:])["id"] for line in response.iter_lines()
               if line.startswith("data: ") and line != "data: [DONE]"}
    assert ids == {"cmpl-r-9"}


def test_the_routers_metrics_count_requests_per_replica_and_its_answers_by_route_and_status(cluster):
    router = cluster.routers["cache_aware"]

    def samples() -> dict[str, float]:
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in httpx.get(router + "/metrics").text.splitlines() if line and not line.startswith("#")}
    ok = 'tokenmill_router_responses_total{path="/v1/completions",status="200"}'
    missing = 'tokenmill_router_responses_total{path="other",status="404"}'
    timed = 'tokenmill_router_request_duration_seconds_count{path="/v1/completions"}'
    before = samples()
    rng = random.Random(2)
    landed = {complete(router, words(rng, 150)).headers[REPLICA_HEADER] for _ in range(3)}
    assert landed == set(cluster.replicas)  # new prefixes spread over both
    assert httpx.get(router + "/no/such/path/7").status_code == 404
    page, after = httpx.get(router + "/metrics").text, samples()
    routed = [line for line in page.splitlines() if line.startswith("tokenmill_router_requests_routed_total")]
    assert {r for r in cluster.replicas if any(f'replica="{r}"' in line for line in routed)} == set(cluster.replicas)
    assert all(f'tokenmill_router_replica_healthy{{replica="{r}"}} 1.0' in page for r in cluster.replicas)
    assert after[ok] - before.get(ok, 0) == 3 and after[timed] - before.get(timed, 0) == 3
    assert after[missing] - before.get(missing, 0) == 1 and "/no/such/path/7" not in page


STREAMED = (1, 2, 5, 6)  # round-robin: 1 and 5 to the victim, 2 and 6 to the other


def test_killing_a_replica_loses_no_request_that_had_not_started_streaming(tiny_llama, tmp_path):
    """8 requests of 1000 tokens (4 streamed) over 2 replicas that run 2 at a time, round-robin:
    each replica runs 2 and queues 2 (the victim runs requests 1 and 3, a stream and a whole
    one, and queues 5 and 7, the same). SIGKILL it: every whole request, and every stream that
    had no event yet (5 among them), completes on the other with the greedy text; a stream that
    had begun may end in an error event instead, after its first events. The killed replica,
    restarted on its port, is routed to again."""
    # float32: the oracle below runs the 8 prompts in one batch, the replicas 2 at a time; bfloat16
    # products turn the batches' 1e-6 differences into flipped tokens within 1000 (README)
    cluster = Cluster(tiny_llama, tmp_path, ["round_robin"], serve_args=("--max-num-seqs", "2", "--dtype", "float32"),
                      router_args=("--health-interval", "0.5"))
    router, victim = cluster.routers["round_robin"], cluster.replicas[1]
    prompts = [f"w{5 + i} w{40 + i}" for i in range(8)]
    body = {"model": "tiny", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    results: dict[int, dict] = {}
    # one client for the sends and the polls: a client of its own per call builds an SSL context
    # each time (tens of ms), and the sends must all be in before the victim's first 2 finish
    client = httpx.Client(timeout=120)

    def run(i: int) -> None:
        request = {**body, "prompt": prompts[i]}
        if i not in STREAMED:
            results[i] = client.post(router + "/v1/completions", json=request).json()
            return
        events = []
        with client.stream("POST", router + "/v1/completions", json={**request, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
        results[i] = {"events": events}

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for sent, thread in enumerate(threads, start=1):  # each at the router before the next: round-robin
            thread.start()                                   # alternates the replicas in this order
            wait_for(lambda: routed(client, router) >= sent, cluster.procs, f"request {sent - 1} at the router", 30,
                     0.01)
        seen = []   # the victim's (running, waiting), as polled

        def queued() -> bool:
            seen.append(scheduled(client, victim))
            return seen[-1] == (2, 2)
        try:
            wait_for(queued, cluster.procs, "1 and 3 running, 5 and 7 queued", 30, 0.01)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the victim's (running, waiting) last polled: {seen[-5:]}") from None
        cluster.procs[1].send_signal(signal.SIGKILL)
        for thread in threads:
            thread.join(120)
        oracle = sorted(complete(cluster.replicas[0], prompts, max_tokens=1000, ignore_eos=True).json()["choices"],
                        key=lambda choice: choice["index"])
        for i in range(8):
            if i not in STREAMED:
                assert "choices" in results[i], results[i]
                assert results[i]["choices"][0]["text"] == oracle[i]["text"]
                continue
            events = results[i]["events"]
            assert events[-1] == "[DONE]"  # after an error event too
            if "error" not in json.loads(events[-2]):
                text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
                assert text == oracle[i]["text"]
            else:
                assert json.loads(events[-2])["error"]["code"] == "replica_failed"
                assert len(events) >= 3 and "choices" in json.loads(events[0])  # it had begun streaming
        assert {i for i in STREAMED if "error" not in json.loads(results[i]["events"][-2])} >= {2, 5, 6}
        page = httpx.get(router + "/metrics").text
        failed = f'tokenmill_router_attempts_failed_total{{replica="{victim}"}} '
        assert float(page.split(failed)[1].split()[0]) >= 3  # 3, 5 and 7 were retried at least
        wait_for(lambda: healthy_replicas(router) == {cluster.replicas[0]}, cluster.procs[:1], "the victim out", 10)

        cluster.restart(1)
        wait_for(lambda: healthy_replicas(router) == set(cluster.replicas), cluster.procs, "the victim back")
        landed = {complete(router, "w5 w6").headers[REPLICA_HEADER] for _ in range(2)}
        assert landed == set(cluster.replicas)
    finally:
        client.close()
        stop(cluster.procs)


def routed(client: httpx.Client, router: str) -> float:
    """The requests the router has sent to a replica, over all replicas."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in client.get(router + "/metrics", timeout=5).text.splitlines()
               if line.startswith("tokenmill_router_requests_routed_total{"))


def scheduled(client: httpx.Client, url: str) -> tuple[float, float]:
    """A replica's requests running and waiting, from its vLLM-named metrics."""
    page = client.get(url + "/metrics", timeout=5).text
    figures = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))}
    return figures["vllm:num_requests_running"], figures["vllm:num_requests_waiting"]


def test_a_relayed_stream_whose_client_stops_reading_ends_after_the_write_timeout_and_is_aborted(tiny_llama,
                                                                                                  tmp_path):
    """A client sends a stream through the router and reads nothing (n 16, 1,000 tokens with 20
    logprobs each: some 20 MB of events, several times what the sockets on the way hold, so the
    router's sends wait long before the replica is done). Once a send has waited
    `--stream-write-timeout` (0.5 s) the router ends the relay and closes the replica's stream, so
    the replica aborts all 16 requests and frees their KV blocks, none finished; the client's
    connection closes without [DONE]. (With a timeout of 20 s all 16 finish, in about 3.5 s here.)"""
    port, router_port = free_port(), free_port()
    replica, url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{router_port}"
    procs = [serve(tiny_llama, port, tmp_path / "serve.log"),
             route([port], router_port, tmp_path / "router.log", "--stream-write-timeout", "0.5")]
    def finished(reason: str) -> float:  # (no sample until a request ends so)
        try:
            return metric(replica, f'tokenmill_requests_finished_total{{finish_reason="{reason}"}}')
        except KeyError:
            return 0.0
    try:
        wait_for(lambda: healthy_replicas(url) == {replica}, procs, "a healthy replica")
        sock = stalled_stream(url, "/v1/completions", {"prompt": "w5 w6", "n": 16, "max_tokens": 1000,
                                                       "logprobs": 20, "ignore_eos": True})
        wait_for(lambda: finished("abort") == 16, procs, "the stalled requests aborted", limit_s=60)
        wait_for(lambda: metric(replica, "tokenmill_kv_blocks_used") == 0, procs, "every KV block free", limit_s=10)
        events, done = read_events(sock)
        assert not done and 0 < len(events) < 16 * 1000
        assert finished("length") == 0
    finally:
        stop(procs)


@pytest.mark.parametrize("how", ["the replica resumes within the drain", "a second signal",
                                 "the drain timeout"])
def test_a_router_told_to_stop_drains_its_requests_then_ends_the_rest_cleanly_and_exits_0(tiny_llama, tmp_path, how):
    """A stream (its first event relayed) and a whole request are in flight through the router,
    their replica frozen by SIGSTOP; then SIGTERM to the router. If the replica resumes within
    --drain-timeout, both finish as usual; if a second signal (SIGINT) comes first, or the
    drain's 1 s is up, both end at once: the stream with a router_shutting_down error event, the
    whole request with that 503, and the replica, resumed, aborts them. Either way the router exits
    0 with no traceback in its log."""
    port, router_port = free_port(), free_port()
    replica, url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{router_port}"
    drain = "1" if how == "the drain timeout" else "60"
    procs = [serve(tiny_llama, port, tmp_path / "serve.log"),
             route([port], router_port, tmp_path / "router.log", "--drain-timeout", drain)]
    client = httpx.Client(timeout=60)
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    events, whole, first = [], {}, threading.Event()

    def stream() -> None:
        with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    first.set()

    def ask() -> None:
        r = client.post(url + "/v1/completions", json=body)
        whole.update(status=r.status_code, body=r.json())
    threads = [threading.Thread(target=stream), threading.Thread(target=ask)]
    try:
        wait_for(lambda: healthy_replicas(url) == {replica}, procs, "a healthy replica")
        threads[0].start()
        assert first.wait(60), log_tails(procs)
        procs[0].send_signal(signal.SIGSTOP)  # 1000 tokens take a second or more: the stream is far from done
        threads[1].start()
        wait_for(lambda: routed(client, url) == 2, procs[1:], "the whole request at the router", 30, 0.01)
        procs[1].send_signal(signal.SIGTERM)
        if how == "a second signal":
            time.sleep(0.5)
            procs[1].send_signal(signal.SIGINT)
        if how == "the replica resumes within the drain":
            time.sleep(1.0)
            assert procs[1].poll() is None  # draining, not gone
            procs[0].send_signal(signal.SIGCONT)
        assert procs[1].wait(30) == 0
        procs[0].send_signal(signal.SIGCONT)
        for thread in threads:
            thread.join(30)
        if how == "the replica resumes within the drain":
            assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            assert whole["status"] == 200 and whole["body"]["usage"]["completion_tokens"] == 1000
        else:
            assert json.loads(events[-2])["error"]["code"] == "router_shutting_down" and events[-1] == "[DONE]"
            assert whole["status"] == 503 and whole["body"]["error"]["code"] == "router_shutting_down"
            wait_for(lambda: scheduled(client, replica) == (0, 0), procs[:1], "the replica's requests aborted", 30)
        log = (tmp_path / "router.log").read_text()
        assert "Traceback" not in log and "ERROR" not in log, log
    finally:
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGCONT)
        client.close()
        stop(procs)
