"""Two checkouts' servers, alternated in fresh processes: streamed completions at concurrency 1
(TTFT, TPOT; the OpenAI default temperature 1) and `tokenmill bench serve` at `--concurrency`
(default 16; output tok/s, mean TPOT, p99 inter-token latency).

    git worktree add /tmp/old <rev>
    python benchmarks/serve_ab.py /tmp/old [--rounds 2] [--concurrency 16]

Each checkout loads its own build of the kernels (their cache directories are named by a hash of
the sources); the new one is the checkout this runs in.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct.Q4_1"
HERE = Path(__file__).resolve().parent.parent


def start(cwd: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", "--port",
                             str(port)], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"no server from {cwd}")


def one(client: httpx.Client, port: int, seed: int, n_out: int = 32) -> tuple[float, float]:
    """(TTFT, TPOT) in ms of one streamed completion of a 128-token prompt. The client is made once
    for all requests: a new one (httpx.stream) builds an SSL context first, about 27 ms here, which
    the TTFT would count."""
    body = {"model": MODEL, "prompt": [100 + (seed * 37 + i) % 9000 for i in range(128)], "max_tokens": n_out,
            "stream": True, "ignore_eos": True}
    start_time, times = time.perf_counter(), []
    with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                times.append(time.perf_counter() - start_time)
    return times[0] * 1e3, (times[-1] - times[0]) / (len(times) - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    builds = {"old": args.old, "new": HERE}
    res = {name: {"ttft": [], "tpot": [], "tok_s": [], "tpot_n": [], "itl_p99": []} for name in builds}
    seed = 0
    for rnd in range(args.rounds):
        for name in (builds if rnd % 2 == 0 else list(builds)[::-1]):
            port = 8800 + 2 * rnd + (name == "new")
            proc = start(builds[name], port)
            client = httpx.Client(timeout=120)
            try:
                for _ in range(3):
                    one(client, port, seed := seed + 1, 8)  # warm up
                for _ in range(20):
                    ttft, tpot = one(client, port, seed := seed + 1)
                    res[name]["ttft"].append(ttft)
                    res[name]["tpot"].append(tpot)
                with tempfile.NamedTemporaryFile(suffix=".json") as out:
                    subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url",
                                    f"http://127.0.0.1:{port}", "--model", MODEL, "--max-concurrency",
                                    str(args.concurrency), "--num-prompts", str(3 * args.concurrency),
                                    "--prompt-len", "64", "128", "--output-len", "64", "64",
                                    "--json", out.name], cwd=HERE, check=True, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
                    row = json.load(open(out.name))["rows"][0]
                res[name]["tok_s"].append(round(row["output_tok_s"], 1))
                res[name]["tpot_n"].append(round(row["tpot"]["mean"] * 1e3, 1))
                res[name]["itl_p99"].append(round(row["itl"]["p99"] * 1e3, 1))
            finally:
                client.close()
                proc.terminate()
                proc.wait()
    for name, r in res.items():
        print(f"{name}: concurrency 1: TTFT median {statistics.median(r['ttft']):.1f} ms, TPOT median "
              f"{statistics.median(r['tpot']):.2f} ms | concurrency {args.concurrency}: output tok/s {r['tok_s']}, "
              f"TPOT mean {r['tpot_n']} ms, ITL p99 {r['itl_p99']} ms")


if __name__ == "__main__":
    main()
