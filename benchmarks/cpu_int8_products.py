"""The panel kernel over Q4_1 blocks with x in float32 (the exact default) against x in 8-bit
blocks (llama.cpp's arithmetic: vpdpbusd where the CPU has VNNI, vpmaddubsw elsewhere), at the
row counts of decode steps and prompt chunks, on the default model's four projection shapes
(SmolLM2-135M: hidden 576, FFN 1536, 9 query and 3 KV heads of 64) from random weights; the two
alternated, seven rounds, medians over 30 copies of each matrix (a model's worth streamed from
memory, as a step reads it).

    python benchmarks/cpu_int8_products.py [ROWS ...]    (default: 1 4 8 16 64 256 512)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tokenmill.cpu_kernels import load_cpu_kernels  # noqa: E402
from tokenmill.models.packed_linear import BLOCK_FORMATS  # noqa: E402

SHAPES = {"qkv 576 -> 960": (960, 576), "o 576 -> 576": (576, 576), "gate_up 576 -> 3072": (3072, 576),
          "down 1536 -> 576": (576, 1536)}
COPIES, ROUNDS = 30, 7


def timed(kernels, x: torch.Tensor, mats: list[torch.Tensor], n: int, int8_rows: int) -> float:
    start = time.perf_counter()
    for m in mats:
        kernels.panel_linear(x, m, None, n, BLOCK_FORMATS["Q4_1"], None, int8_rows)
    return (time.perf_counter() - start) / len(mats)


def main(rows_list: list[int]) -> None:
    kernels = load_cpu_kernels(required=True)
    rng = np.random.default_rng(0)
    print(f"threads {torch.get_num_threads()}; Q4_1 panels; GFLOP/s, float32 x vs 8-bit x")
    print(f"{'shape':>20} {'rows':>5} {'float32 x':>10} {'8-bit x':>10} {'8-bit / float32 time':>21}")
    for name, (n, k) in SHAPES.items():
        raw = torch.from_numpy(quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q4_1))
        mats = [kernels.pack_block_panels(raw, BLOCK_FORMATS["Q4_1"], k) for _ in range(COPIES)]
        for rows in rows_list:
            x = torch.randn(rows, k)
            times: dict[int, list[float]] = {0: [], rows: []}
            for _ in range(ROUNDS):
                for int8_rows in times:
                    times[int8_rows].append(timed(kernels, x, mats, n, int8_rows))
            f32, i8 = statistics.median(times[0]), statistics.median(times[rows])
            flop = 2 * rows * n * k
            print(f"{name:>20} {rows:>5} {flop / f32 / 1e9:>10.1f} {flop / i8 / 1e9:>10.1f} {i8 / f32:>20.2f}x")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 4, 8, 16, 64, 256, 512])
