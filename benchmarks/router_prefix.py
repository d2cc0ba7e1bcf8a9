"""`tokenmill router` policies on a shared-prefix workload over two `tokenmill serve` replicas:
the replicas' prefix-cache hit rate and the clients' time to first token.

    python benchmarks/router_prefix.py [--tiny] [--policies cache_aware round_robin] [--groups 16]
                                       [--per-group 4] [--prefix-words 500] [--concurrency 4] [--repeats 1]
                                       [--serve-arg=--num-threads=1 ...] [--router-arg=--policy-option ...]

The workload: `--groups` documents of `--prefix-words` words each (seeded pseudo-English), and
for each `--per-group` chat requests whose system message is the document and whose user message
is a question of its own; all requests in one seeded random order, `--concurrency` at a time,
streamed, greedy, `--max-tokens` each. `--groups 1` is a hot prefix: one document that every
request shares (its spread over the replicas is the "per replica" column). Each policy gets fresh
replicas (empty caches) and a router of its own, all on 127.0.0.1; one warm-up request per
replica goes straight to it first. The hit rate is the replicas' vllm:prefix_cache_hits over
vllm:prefix_cache_queries (prompt tokens) during the run; TTFT is measured by the client, from
sending the request to the first event that carries text. A policy written POLICY@DIR runs the
router of the checkout DIR (a worktree of another commit; the replicas stay this tree's), so two
versions of a policy compare in one run. Results are printed and written to
benchmarks/results/router_prefix.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent.parent
WORDS = ("the of and to in is that for it as with was on be by at this from or an are which have not but had "
         "his they you were their one all we can her has there been if more when will would who so no "
         "river mountain engine kernel cache block token model server request stream policy replica prefix "
         "memory thread queue latency batch answer question history garden winter summer city market").split()


def cpu_description() -> str:
    """The CPU as /proc/cpuinfo gives it: name, family/model, its widest vector extension, cores."""
    fields, flags = {}, set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "cpu family", "model") and key not in fields:
            fields[key] = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    name, family, model = (fields.get(k, "?") for k in ("model name", "cpu family", "model"))
    return f"{name} (family {family}, model {model}), {vector}, {os.cpu_count()} cores"


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], log: Path, checkout: Path = HERE) -> subprocess.Popen:
    """`tokenmill COMMAND` from `checkout`'s sources (its directory is the working directory, which
    `python -m` puts first on the import path)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    return subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", *command], cwd=checkout,
                            env=env, stdout=log.open("a"), stderr=subprocess.STDOUT)


def wait_healthy(url: str, procs: list[subprocess.Popen], check=lambda response: True, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a replica or the router exited (their logs: the directory printed at the start)")
        try:
            response = httpx.get(url + "/health", timeout=5)
            if response.status_code == 200 and check(response):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy within {limit_s} s")


def workload(args: argparse.Namespace) -> list[tuple[int, list[dict]]]:
    """(group, messages) of every request, in the order they are sent. The tiny llama's tokenizer
    knows only the words w0..w383 (any other is its unknown token), so with --tiny the text is of those."""
    rng = random.Random(args.seed)
    words = [f"w{i}" for i in range(5, 380)] if args.tiny else WORDS
    documents = [" ".join(rng.choice(words) for _ in range(args.prefix_words)) for _ in range(args.groups)]
    requests = [(g, [{"role": "system", "content": f"{words[g]} {documents[g]}"},
                     {"role": "user", "content": " ".join(rng.choice(words) for _ in range(12))}])
                for g in range(args.groups) for i in range(args.per_group)]
    rng.shuffle(requests)
    return requests


def prefix_counters(replicas: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in replicas:
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def one_request(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """(TTFT in seconds, the replica that answered) of one streamed chat completion."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    sent, ttft = time.perf_counter(), None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line:
                ttft = time.perf_counter() - sent
        return (ttft if ttft is not None else time.perf_counter() - sent), response.headers["x-tokenmill-replica"]


async def drive(url: str, requests: list[tuple[int, list[dict]]], args: argparse.Namespace) -> list[tuple]:
    """Every request, `concurrency` at a time: (group, TTFT, replica) of each."""
    limit = asyncio.Semaphore(args.concurrency)

    async def run(group: int, messages: list[dict]) -> tuple:
        async with limit:
            return (group, *await one_request(client, url, messages, args.max_tokens))
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        return await asyncio.gather(*(run(g, m) for g, m in requests))


def run_policy(variant: str, args: argparse.Namespace, model: list[str], logs: Path) -> dict:
    """One run of the workload behind a fresh router and fresh replicas; `variant` is a policy,
    or POLICY@DIR for the router of checkout DIR."""
    policy, _, other = variant.partition("@")
    checkout = Path(other).resolve() if other else HERE
    ports = [free_port(), free_port()]
    replicas = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [start(["serve", *model, "--port", str(p), *args.serve_arg], logs / f"router_prefix_serve{i}.log")
             for i, p in enumerate(ports)]
    router_port = free_port()
    router = f"http://127.0.0.1:{router_port}"
    try:
        for url in replicas:
            wait_healthy(url, procs)
        for url in replicas:  # warm-up, straight to each replica
            httpx.post(url + "/v1/chat/completions", timeout=600, json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        procs.append(start(["router", *[a for u in replicas for a in ("--replica", u)], "--port", str(router_port),
                            "--policy", policy, *args.router_arg], logs / "router_prefix_router.log", checkout))
        wait_healthy(router, procs, lambda r: all(s["healthy"] for s in r.json()["replicas"].values()))
        hits0, queries0 = prefix_counters(replicas)
        start_time = time.perf_counter()
        results = asyncio.run(drive(router, workload(args), args))
        wall = time.perf_counter() - start_time
        time.sleep(0.5)  # the counters of the last step
        hits1, queries1 = prefix_counters(replicas)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    ttfts = sorted(t for _, t, _ in results)
    groups_split = sum(len({r for g2, _, r in results if g2 == g}) > 1 for g in range(args.groups))
    return {"policy": variant if checkout == HERE else f"{policy}@{checkout.name}", "requests": len(results),
            "hit_rate": (hits1 - hits0) / max(queries1 - queries0, 1),
            "prompt_tokens": queries1 - queries0, "hit_tokens": hits1 - hits0,
            "ttft_mean_ms": statistics.mean(ttfts) * 1e3, "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1e3,
            "ttft_p90_ms": ttfts[int(len(ttfts) * 0.9)] * 1e3, "ttft_max_ms": ttfts[-1] * 1e3, "wall_s": wall,
            "per_replica": [sum(r == url for _, _, r in results) for url in replicas],
            "groups_on_both_replicas": groups_split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny random llama instead of the default model")
    parser.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"],
                        help="the policies to run in turn; POLICY@DIR: with the router of checkout DIR")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--prefix-words", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[], help="an option for both replicas (repeat)")
    parser.add_argument("--router-arg", action="append", default=[], help="an option for the router (repeat)")
    parser.add_argument("--repeats", type=int, default=1, help="run the policies in turn this many times")
    parser.add_argument("--output", type=Path, default=HERE / "benchmarks" / "results" / "router_prefix.json")
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="router_prefix_logs_"))
    model: list[str] = []
    if args.tiny:
        sys.path.insert(0, str(HERE / "tests"))
        from conftest import build_tiny_model
        model = [str(build_tiny_model(Path(tempfile.mkdtemp()) / "llama", "llama", max_position_embeddings=4096))]
    cpu = cpu_description()
    print(f"CPU: {cpu}\nworkload: {args.groups} groups x {args.per_group} chat requests, {args.prefix_words}-word "
          f"shared system message, concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
          f"model {'tiny llama' if args.tiny else 'default'}, replica options {args.serve_arg or 'none'}, "
          f"router options {args.router_arg or 'none'}; process logs in {logs}\n")
    rows = [run_policy(variant, args, model, logs) for _ in range(args.repeats) for variant in args.policies]
    print(f"{'policy':24s} {'hit rate':>8s} {'TTFT mean':>10s} {'p50':>8s} {'p90':>8s} {'max':>8s} {'wall s':>7s} "
          f"{'per replica':>12s} {'groups split':>13s}")
    for r in rows:
        print(f"{r['policy']:24s} {r['hit_rate']:8.1%} {r['ttft_mean_ms']:8.0f}ms {r['ttft_p50_ms']:6.0f}ms "
              f"{r['ttft_p90_ms']:6.0f}ms {r['ttft_max_ms']:6.0f}ms {r['wall_s']:7.1f} {str(r['per_replica']):>12s} "
              f"{r['groups_on_both_replicas']:>6d} of {args.groups}")
    args.output.write_text(json.dumps({"cpu": cpu, "args": {k: str(v) for k, v in vars(args).items()},
                                       "results": rows}, indent=2))
    print(f"\nresults written to {args.output}")


if __name__ == "__main__":
    main()
