"""Decode steps of the default model with its projections in their GGUF blocks (Q4_1, the head
Q8_0; the default) against the same weights dequantized to float32 panels (gguf_blocks=False),
side by side: two engines in one process, their steps alternated.

    python benchmarks/cpu_gguf_blocks.py [BATCH ...]    (default: 1 2 4 8 16 32 64)

For each batch size, BATCH requests decode in each engine while the two alternate: eight steps
on one, eight on the other, six rounds; the table gives the median step of each.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402
from tokenmill.models.packed_linear import PackedLinear  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

ROUNDS, STEPS = 6, 8


def median_step(engine: LLMEngine, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def weight_mb(engine: LLMEngine) -> float:
    return sum(m.panels.nbytes for m in engine.runner.worker.model.modules() if isinstance(m, PackedLinear)) / 1e6


def main(batches: list[int]) -> None:
    engines = {"blocks": LLMEngine(EngineConfig()), "float32": LLMEngine(EngineConfig(gguf_blocks=False))}
    print(", ".join(f"{name}: {weight_mb(e):.0f} MB of projections" for name, e in engines.items()))
    print(f"{'batch':>5} {'blocks ms':>10} {'float32 ms':>11} {'blocks/float32':>15}")
    for batch in batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for engine in engines.values():
            for i, rid in enumerate(ids):
                engine.add_request(rid, list(range(100 + i, 164 + i)),
                                   SamplingParams(max_tokens=ROUNDS * STEPS + 40, ignore_eos=True, temperature=0.0))
            for _ in range(-(-batch * 64 // engine.config.max_num_batched_tokens) + 1):
                engine.step()  # the prompts, in chunks
        results: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(ROUNDS):
            for name, engine in engines.items():
                results[name].append(median_step(engine, STEPS))
        for engine in engines.values():
            for rid in ids:
                engine.abort(rid)
        blocks, floats = (statistics.median(results[name]) * 1e3 for name in engines)
        print(f"{batch:>5} {blocks:>10.1f} {floats:>11.1f} {blocks / floats:>14.2f}x")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 16, 32, 64])
