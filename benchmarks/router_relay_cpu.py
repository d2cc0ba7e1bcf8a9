"""The CPU `tokenmill router` spends relaying streamed tokens: its user + system time per event
while it relays many streams at once (issue 29's disaggregated and replicated setups pay it on
the same cores as the engine).

    python benchmarks/router_relay_cpu.py [--checkout NAME=DIR ...] [--streams 32] [--events 128]
                                          [--interval 0.04] [--rounds 3]

An upstream that answers like a replica (/health, /metrics, and completions streamed as
tokenmill's chunks, one event every `--interval` seconds per stream) stands in for the engine, so
that only the router's own work is measured; the client reads `--streams` streams at once through
the router. Each checkout's router (`python -m tokenmill.cli router`, started from that tree's
sources) is measured in turn, in reverse order every other round: CPU seconds read from
/proc/PID/stat over the client's run, divided by the events relayed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from disagg_long import free_port, wait_healthy  # beside this script
from nixl_idle_cpu import cpu_seconds

HERE = Path(__file__).resolve().parent.parent


def upstream_app(events: int, interval: float):
    """A raw ASGI app answering as a replica does, for the router's health poll and streams."""
    chunk = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}]}
    event = f"data: {json.dumps(chunk)}\n\n".encode()

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/completions":
            body = b"vllm:num_requests_waiting 0\n" if scope["path"] == "/metrics" else b"{}"
            length = [(b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 200, "headers": length})
            await send({"type": "http.response.body", "body": body})
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        next_at = time.monotonic()
        for _ in range(events):
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
    return app


async def read_streams(url: str, streams: int) -> int:
    async def one(client: httpx.AsyncClient) -> int:
        body = {"prompt": "hello", "max_tokens": 128, "stream": True}
        count = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                count += line.startswith("data: {")
        return count
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=streams + 4)) as client:
        return sum(await asyncio.gather(*(one(client) for _ in range(streams))))


def measure(tree: Path, upstream: str, streams: int) -> tuple[float, int]:
    """CPU seconds the router from `tree` took relaying, and the events the client got."""
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "router",
                               "--replica", upstream, "--port", str(port)], cwd=tree,
                              env={**os.environ, "PYTHONPATH": str(tree)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [router])
        time.sleep(1.0)
        before = cpu_seconds(router.pid)
        got = asyncio.run(read_streams(f"http://127.0.0.1:{port}", streams))
        return cpu_seconds(router.pid) - before, got
    finally:
        router.terminate()
        router.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", nargs="+", default=[f"this={HERE}"], help="NAME=DIR, measured in turn")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--events", type=int, default=128)
    parser.add_argument("--interval", type=float, default=0.04)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream is not None:
        import uvicorn
        uvicorn.run(upstream_app(args.events, args.interval), host="127.0.0.1", port=args.serve_upstream,
                    log_level="warning")
        return
    trees = [(name, Path(path).resolve()) for name, path in (c.split("=", 1) for c in args.checkout)]
    port = free_port()
    upstream = subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(port), "--events",
                                 str(args.events), "--interval", str(args.interval)])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [upstream])
        print(f"{'round':>5} {'tree':<12} {'events':>7} {'router CPU s':>12} {'µs/event':>9}")
        for round_ in range(args.rounds):
            for name, tree in trees if round_ % 2 == 0 else trees[::-1]:
                seconds, got = measure(tree, f"http://127.0.0.1:{port}", args.streams)
                print(f"{round_ + 1:>5} {name:<12} {got:>7} {seconds:>12.2f} {seconds / max(got, 1) * 1e6:>9.1f}",
                      flush=True)
    finally:
        upstream.terminate()
        upstream.wait(30)


if __name__ == "__main__":
    main()
