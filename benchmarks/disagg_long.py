"""The `long` workload over HTTP, colocated against disaggregated prefill/decode (issue 29).

    python benchmarks/disagg_long.py [--rounds 2] [--model PATH] [--setups colocated nixl nixl_niced ...]

32 streamed completions (64-token prompts, 128 tokens out) decode; once each has 16 tokens, a
4,000-token prompt arrives. The decoders' inter-token gaps are taken at the client, alone (the
run before the long prompt arrives) and with it (from its send until the decoders finish).

    colocated       one `tokenmill serve` on both cores (its threads follow the free cores)
    colocated_routed  the same behind `tokenmill router --replica`: the router's hop (a third
                    process on the same two cores) that the disaggregated setups pay, paid here too
    shared_storage  `serve --kv-role prefill` pinned to core 0 and `--kv-role decode` pinned to
                    core 1 (one thread each), over a directory in /dev/shm, `tokenmill router
                    --prefill` in front: the long prompt is computed on core 0, and the decode
                    instance loads its blocks from the files at admission
    nixl            the same two instances over NIXL: the decode instance reads the prompt's
                    blocks from the prefill instance's pool while its steps go on
    nixl_niced      the same over NIXL, neither pinned and both with the default threads, the
                    prefill instance under `nice -n 19`: the decode instance's steps take both
                    cores when they run, and the prefill instance the time they leave

All see the same two cores; the setups take turns (in reverse order every other round), in fresh
processes, `--rounds` times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], cores: str | None = None, nice: int = 0) -> subprocess.Popen:
    pin = ["taskset", "-c", cores] if cores else []
    pin += ["nice", "-n", str(nice)] if nice else []
    return subprocess.Popen([*pin, sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(url: str, procs: list[subprocess.Popen], limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a server exited while starting"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy in {limit_s} s")


def launch(setup: str, model: str, storage: str) -> tuple[str, list[subprocess.Popen]]:
    """The setup's front URL and its processes."""
    if setup in ("colocated", "colocated_routed"):
        port = free_port()
        procs = [start(["serve", model, "--port", str(port)])]
        wait_healthy(f"http://127.0.0.1:{port}", procs)
        if setup == "colocated":
            return f"http://127.0.0.1:{port}", procs
        return route(["--replica", f"http://127.0.0.1:{port}"], procs)
    p, d = free_port(), free_port()
    connector = ["--kv-storage-path", storage] if setup == "shared_storage" else ["--kv-connector", "nixl"]
    if setup == "nixl_niced":
        procs = [start(["serve", model, "--port", str(p), "--kv-role", "prefill", *connector], nice=19),
                 start(["serve", model, "--port", str(d), "--kv-role", "decode", *connector])]
    else:
        shared = [*connector, "--num-threads", "1"]
        procs = [start(["serve", model, "--port", str(p), "--kv-role", "prefill", *shared], "0"),
                 start(["serve", model, "--port", str(d), "--kv-role", "decode", *shared], "1")]
    for port in (p, d):
        wait_healthy(f"http://127.0.0.1:{port}", procs)
    return route(["--prefill", f"http://127.0.0.1:{p}", "--replica", f"http://127.0.0.1:{d}"], procs)


def route(upstreams: list[str], procs: list[subprocess.Popen]) -> tuple[str, list[subprocess.Popen]]:
    """`tokenmill router` in front of `upstreams` (its arguments), added to procs; its URL."""
    port = free_port()
    procs.append(start(["router", *upstreams, "--port", str(port)]))
    wait_healthy(f"http://127.0.0.1:{port}", procs)
    return f"http://127.0.0.1:{port}", procs


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                 times: list[float], started: asyncio.Event | None = None, after: int = 16) -> None:
    """One streamed completion; each chunk's arrival time appended to `times`."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
                if started is not None and len(times) == after:
                    started.set()


async def run(url: str, seed: int) -> dict:
    rng = random.Random(seed)
    short = [[rng.randrange(10, 10000) for _ in range(64)] for _ in range(32)]
    long = [rng.randrange(10, 10000) for _ in range(4000)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=64)) as client:
        times: list[list[float]] = [[] for _ in short]
        ready = [asyncio.Event() for _ in short]
        decoders = [asyncio.create_task(stream(client, url, p, 128, t, e)) for p, t, e in zip(short, times, ready)]
        await asyncio.gather(*(e.wait() for e in ready))
        sent, long_times = time.perf_counter(), []
        await stream(client, url, long, 16, long_times)
        await asyncio.gather(*decoders)
    first = long_times[0]
    alone = [b - a for t in times for a, b in zip(t, t[1:]) if b < sent]
    mixed = [b - a for t in times for a, b in zip(t, t[1:]) if a >= sent]
    during = [b - a for t in times for a, b in zip(t, t[1:]) if sent <= a < first]
    return {"p50_alone": np.percentile(alone, 50), "p99_alone": np.percentile(alone, 99),
            "p50_with": np.percentile(mixed, 50), "p99_with": np.percentile(mixed, 99),
            "max_during_prefill": max(during, default=0.0), "long_ttft": first - sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M Q4_1)")
    parser.add_argument("--setups", nargs="+",
                        choices=("colocated", "colocated_routed", "shared_storage", "nixl", "nixl_niced"),
                        default=["colocated", "shared_storage", "nixl"])
    args = parser.parse_args()
    from tokenmill.models.loader import default_model_path
    model = args.model or str(default_model_path())
    print(f"{'setup':<16} {'p50 alone':>9} {'p99 alone':>9} {'p50 with':>9} {'p99 with':>9} "
          f"{'max in prefill':>14} {'long TTFT':>9}  (ms, TTFT s)")
    for round_ in range(args.rounds):
        for setup in args.setups if round_ % 2 == 0 else args.setups[::-1]:
            with tempfile.TemporaryDirectory(dir="/dev/shm") as storage:
                url, procs = launch(setup, model, storage)
                try:
                    r = asyncio.run(run(url, seed=round_))
                finally:
                    for p in procs:
                        p.terminate()
                    for p in procs:
                        p.wait(30)
            print(f"{setup:<16} {r['p50_alone'] * 1e3:9.1f} {r['p99_alone'] * 1e3:9.1f} {r['p50_with'] * 1e3:9.1f} "
                  f"{r['p99_with'] * 1e3:9.1f} {r['max_during_prefill'] * 1e3:14.1f} {r['long_ttft']:9.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
