"""The server's memory while streaming clients read nothing: `tokenmill serve` in a process of its
own, N streamed chat completions (ignore_eos, logprobs with the top
alternatives) whose clients send the request and never read, and the server's resident memory
(VmRSS, and VmHWM, its peak, from /proc/PID/status) before, while and after they run.

    python benchmarks/stalled_streams.py [--checkout DIR] [--tiny] [--streams 16] [--n 1] [--max-tokens 1500]
                                         [--top-logprobs 20] [--serve-arg=--stream-write-timeout=600 ...]

--checkout runs that checkout's tokenmill (PYTHONPATH=DIR; default: this one), to compare two.
The model is the default one, or with --tiny a random tiny llama (the tests' own, with a
2,048-token context), whose steps are ~50x quicker: the memory at stake is the serving layer's.
A client's small receive buffer and the server's socket buffer hold the first MBs of each stream
(here about 2.8 MB on loopback); what comes after waits in the server, as much as the server
keeps for a client that does not read: --n > 1 sends several choices down one connection. The
run ends when no request runs or waits any more (each finished, or aborted past
--stream-write-timeout), or after --limit seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent.parent


def tiny_model(directory: Path) -> Path:
    """The tests' tiny random llama (tests/conftest.py), with a 2,048-token context."""
    sys.path.insert(0, str(HERE / "tests"))
    from conftest import build_tiny_model
    return build_tiny_model(directory / "llama", "llama", max_position_embeddings=2048)


def start(checkout: Path, port: int, model: Path | None, serve_args: list[str]) -> subprocess.Popen:
    """The server, in its own process, once /health answers."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", *([str(model)] if model else []),
           "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server from {checkout} exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"no server from {checkout}")


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024  # kB
    return fields


def metrics(port: int) -> dict[str, float]:
    """The server's Prometheus samples without labels, and finished requests by reason."""
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        if line.startswith("tokenmill_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def stalled_stream(port: int, body: dict) -> socket.socket:
    """A streamed request whose client sends it and then never reads (a 4 kB receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def run(args: argparse.Namespace, model: Path | None) -> dict:
    port = args.port
    proc = start(args.checkout, port, model, args.serve_arg)
    sockets: list[socket.socket] = []
    try:
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})  # (warm up)
        before = memory_mb(proc.pid)
        for i in range(args.streams):
            sockets.append(stalled_stream(port, {
                "messages": [{"role": "user", "content": f"Tell me a long story, number {i}."}], "stream": True,
                "max_tokens": args.max_tokens, "n": args.n, "ignore_eos": True, "logprobs": True,
                "top_logprobs": args.top_logprobs}))
        start_time, samples = time.monotonic(), []
        while time.monotonic() - start_time < args.limit:
            time.sleep(args.every)
            m = metrics(port)
            mem = memory_mb(proc.pid)
            samples.append((round(time.monotonic() - start_time), round(mem["VmRSS"])))
            print(f"  {samples[-1][0]:4d} s  VmRSS {mem['VmRSS']:7.0f} MB  VmHWM {mem['VmHWM']:7.0f} MB  "
                  f"tokens {m.get('tokenmill_generation_tokens_total', 0):7.0f}", file=sys.stderr)
            if m.get("tokenmill_num_requests_running", 0) + m.get("tokenmill_num_requests_waiting", 0) == 0:
                break
        elapsed = time.monotonic() - start_time
        m = metrics(port)
        after = memory_mb(proc.pid)
        health_start = time.monotonic()
        healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        return {"checkout": str(args.checkout), "serve_args": args.serve_arg, "streams": args.streams, "n": args.n,
                "max_tokens": args.max_tokens, "top_logprobs": args.top_logprobs, "seconds": round(elapsed, 1),
                "tokens": m.get("tokenmill_generation_tokens_total"),
                "aborted": m.get('tokenmill_requests_finished_total{finish_reason="abort"}', 0.0),
                "rss_before_mb": round(before["VmRSS"]), "rss_after_mb": round(after["VmRSS"]),
                "hwm_mb": round(after["VmHWM"]), "growth_mb": round(after["VmHWM"] - before["VmRSS"]),
                "health_ok": healthy, "health_ms": round((time.monotonic() - health_start) * 1e3, 1),
                "rss_samples": samples}
    finally:
        for sock in sockets:
            sock.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, default=HERE, help="the tokenmill checkout to serve from")
    parser.add_argument("--tiny", action="store_true", help="serve a random tiny llama, not the default model")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--n", type=int, default=1, help="choices per request (each a stream of the engine's)")
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--top-logprobs", type=int, default=20)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between memory samples")
    parser.add_argument("--limit", type=float, default=600, help="seconds to wait for the requests at most")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="a flag for `tokenmill serve` (repeat; e.g. --serve-arg=--stream-write-timeout=600)")
    args = parser.parse_args()
    args.checkout = args.checkout.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, tiny_model(Path(tmp)) if args.tiny else None)
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}))
    print(f"{args.checkout.name}: {args.streams} stalled streams (n {args.n}) of {args.max_tokens} tokens: VmRSS "
          f"{result['rss_before_mb']} MB before, peak {result['hwm_mb']} MB (+{result['growth_mb']} MB), "
          f"{result['rss_after_mb']} MB after; {result['tokens']:.0f} tokens in {result['seconds']} s, "
          f"{result['aborted']:.0f} aborted")


if __name__ == "__main__":
    main()
