"""The default workload on one engine of the default model, its output head taking x in float32
and in 8-bit blocks in turn (the rest of the arithmetic as the engine's defaults have it), so the
machine's drift falls on both alike.

    python benchmarks/cpu_head_int8_ab.py [--rounds 4]

The engine runs without prefix caching: both settings run the same workload each round (seed 100,
101, ...), which the second would otherwise find cached. A warm-up workload first (the pool's pages
faulted in); the order of the two settings reversed every other round.
"""

from __future__ import annotations

import argparse
import statistics

from tokenmill.bench.throughput import run_engine
from tokenmill.bench.workloads import random_workload
from tokenmill.config import EngineConfig
from tokenmill.engine import LLMEngine
from tokenmill.models.cpu_packing import EVERY_STEP
from tokenmill.models.loader import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=str(default_model_path()), enable_prefix_caching=False))
    head = engine.runner.worker.model.packed_lm_head
    print(f"arithmetic: {engine.arithmetic}")
    run_engine(engine, random_workload(seed=99), "warm-up", progress=False)
    settings = {"head float32 x": 0, "head 8-bit x": EVERY_STEP}
    walls: dict[str, list[float]] = {name: [] for name in settings}
    for i in range(args.rounds):
        order = list(settings) if i % 2 == 0 else list(reversed(settings))
        for name in order:
            head.int8_rows = settings[name]
            result = run_engine(engine, random_workload(seed=100 + i), name, progress=False)
            walls[name].append(result.wall)
            print(f"round {i}: {name}: {result.wall:.2f} s, {result.output_tokens / result.wall:.1f} output tok/s",
                  flush=True)
    base = walls["head float32 x"]
    for name, ws in walls.items():
        print(f"{name}: median {statistics.median(ws):.2f} s, per round against float32 x: "
              + " ".join(f"{w / b:.2f}" for w, b in zip(ws, base)))


if __name__ == "__main__":
    main()
