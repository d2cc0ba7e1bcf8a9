"""Decode steps of the default model at a few batch sizes, and optionally the default workload's
wall time, in one line: for A/B runs of two commits in fresh processes, alternated.

    python benchmarks/cpu_decode_steps.py [--batches 1 4 16 64] [--workload] [--gguf-int8-rows N]
        [--kv-cache-dtype D]

Alternating two commits (one of them in a git worktree with its own TORCH_EXTENSIONS_DIR, so
that each loads its own build of the kernels):

    for i in 1 2 3; do
      (cd /tmp/old && TORCH_EXTENSIONS_DIR=/tmp/ext_old python $BENCH --workload)
      python $BENCH --workload
    done

Each batch: B requests with 32-token prompts, 5 steps to warm up, then the median of 40 steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the checkout this runs in, not the one the script lies in
from tokenmill.bench.throughput import run_engine  # noqa: E402
from tokenmill.bench.workloads import random_workload  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402
from tokenmill.models.loader import default_model_path  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

WARMUP, STEPS = 5, 40


def median_decode_step(engine: LLMEngine, batch: int, tag: str = "", warmup: int = WARMUP,
                       steps: int = STEPS) -> float:
    """The median time of `steps` decode steps of `batch` requests with 32-token prompts, after
    `warmup` (benchmarks/tp_overhead.py uses it too; `tag` keeps request ids apart)."""
    ids = [f"{tag}b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, list(range(100 + i, 132 + i)),
                           SamplingParams(max_tokens=warmup + steps + 8, ignore_eos=True, temperature=0.0))
    for _ in range(warmup + 1):  # the prompts (one step), then warm decodes
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort(rid)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--workload", action="store_true", help="also time the default workload (about 40 s)")
    parser.add_argument("--gguf-int8-rows", type=int, default=None,
                        help="EngineConfig.gguf_int8_rows (default: the CPU's)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=str(default_model_path()), gguf_int8_rows=args.gguf_int8_rows,
                                    kv_cache_dtype=args.kv_cache_dtype))
    parts = [f"batch {b}: {median_decode_step(engine, b) * 1e3:.2f} ms" for b in args.batches]
    if args.workload:
        run = run_engine(engine, random_workload(), "tokenmill", progress=False)
        parts.append(f"workload {run.wall:.1f} s ({run.output_tps:.1f} tok/s)")
    print(", ".join(parts), flush=True)


if __name__ == "__main__":
    main()
