"""Decode steps of the default model with its projections reading the GGUF blocks (Q4_1, the
head Q8_0) against reading the float32 panels, side by side in one engine.

    python benchmarks/cpu_gguf_blocks.py [BATCH ...]    (default: 1 2 4 6 8 12 16)

For each batch size, BATCH requests decode while the two layouts alternate: eight steps on
one, eight on the other, six rounds; the table gives the median step of each. Steps of more
than twelve rows read the float32 panels either way (packed_linear.BLOCK_ROWS), so the last
column should stay near 1.00 from 13 up.
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


def main(batches: list[int]) -> None:
    engine = LLMEngine(EngineConfig())
    linears = [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
    blocks = [m.block_panels for m in linears]
    if any(b is None for b in blocks):
        raise SystemExit("the default model's projections have no GGUF blocks here (no AVX2?)")
    mb = sum(b.nbytes for b in blocks) / 1e6
    print(f"default model: {len(linears)} projections, {mb:.0f} MB of blocks, "
          f"{sum(m.panels.nbytes for m in linears) / 1e6:.0f} MB of float32 panels")
    print(f"{'batch':>5} {'blocks ms':>10} {'float32 ms':>11} {'blocks/float32':>15}")
    for batch in batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, list(range(100 + i, 164 + i)),
                               SamplingParams(max_tokens=ROUNDS * STEPS * 2 + 4, ignore_eos=True, temperature=0.0))
        engine.step()  # the prompts
        results: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(ROUNDS):
            for on in (True, False):
                for m, b in zip(linears, blocks):
                    m.block_panels = b if on else None
                results[on].append(median_step(engine, STEPS))
        for rid in ids:
            engine.abort(rid)
        with_blocks, without = (statistics.median(results[on]) * 1e3 for on in (True, False))
        print(f"{batch:>5} {with_blocks:>10.1f} {without:>11.1f} {with_blocks / without:>14.2f}x")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 2, 4, 6, 8, 12, 16])
