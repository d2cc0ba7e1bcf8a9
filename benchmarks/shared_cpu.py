"""Throughput when another process takes a core: `tokenmill bench throughput` quiet and beside a
CPU hog (one busy Python process), with the default threads (following the cores left free), a
fixed thread per usable core and --num-threads 1, alternated in one run, so the ratios compare
like with like on the same machine.

    python benchmarks/shared_cpu.py [--rounds 2] [--num-requests 16] [--env OMP_WAIT_POLICY=passive ...]
                                    [--hog-nice 19]

Each --env adds a row run with that variable set (the OpenMP runtime reads it at start);
--hog-nice runs the hog at that niceness (a background job's).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

HOG = [sys.executable, "-c", "while True: pass"]


def output_tps(extra: list[str], env: dict[str, str], num_requests: int) -> float:
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "throughput", "--num-requests", str(num_requests),
           "--output-len", "32", "64", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=900).stdout
    row = next(line for line in out.splitlines() if line.startswith("tokenmill "))
    return float(re.split(r"\s+", row)[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--env", nargs="*", default=[])
    parser.add_argument("--hog-nice", type=int, default=0, help="the hog's niceness (0: as the engine's)")
    args = parser.parse_args()
    cores = str(len(os.sched_getaffinity(0)))
    variants = {"default": ([], {}), f"--num-threads {cores}": (["--num-threads", cores], {}),
                "--num-threads 1": (["--num-threads", "1"], {})}
    variants.update({e: ([], dict([e.split("=", 1)])) for e in args.env})
    figures: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for load in ("quiet", "hog"):
            hog = subprocess.Popen(HOG, preexec_fn=lambda: os.nice(args.hog_nice)) if load == "hog" else None
            time.sleep(0.5 if hog else 0)
            try:
                for name, (extra, env) in variants.items():
                    figures.setdefault((load, name), []).append(output_tps(extra, env, args.num_requests))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    quiet = max(figures[("quiet", "default")])
    print(f"{'variant':<28} {'quiet tok/s':>14} {'hog tok/s':>14} {'hog / quiet default':>20}")
    for name in variants:
        q, h = figures[("quiet", name)], figures[("hog", name)]
        print(f"{name:<28} {' '.join(f'{x:.1f}' for x in q):>14} {' '.join(f'{x:.1f}' for x in h):>14} "
              f"{max(h) / quiet:>19.2f}x")


if __name__ == "__main__":
    main()
