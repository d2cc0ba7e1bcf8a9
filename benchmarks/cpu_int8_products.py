"""The panel kernel over GGUF blocks with x in float32 (the exact path) against x in 8-bit blocks
(llama.cpp's arithmetic: vpdpbusd where the CPU has VNNI, vpmaddubsw or vpmaddwd elsewhere), at
the row counts of decode steps and prompt chunks, on the default model's shapes (SmolLM2-135M:
hidden 576, FFN 1536, 9 query and 3 KV heads of 64; its four projections in Q4_1, its output head
in Q8_0) from random weights; the two alternated, seven rounds, medians over copies of each matrix
(30 of a projection, 3 of the head: streamed from memory, as a step reads them).

    python benchmarks/cpu_int8_products.py [ROWS ...] [--only WORD ...]
        (rows by default 1 4 8 16 64 256 512; --only: the shapes whose names hold a word, as head)
"""

from __future__ import annotations

import argparse
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

SHAPES = {"qkv 576 -> 960": (960, 576, "Q4_1", 30), "o 576 -> 576": (576, 576, "Q4_1", 30),
          "gate_up 576 -> 3072": (3072, 576, "Q4_1", 30), "down 1536 -> 576": (576, 1536, "Q4_1", 30),
          "head 576 -> 49152": (49152, 576, "Q8_0", 3)}
ROUNDS = 7


def timed(kernels, x: torch.Tensor, mats: list[torch.Tensor], n: int, fmt: str, int8_rows: int) -> float:
    start = time.perf_counter()
    for m in mats:
        kernels.panel_linear(x, m, None, n, BLOCK_FORMATS[fmt], None, int8_rows)
    return (time.perf_counter() - start) / len(mats)


def main(rows_list: list[int], only: list[str]) -> None:
    kernels = load_cpu_kernels(required=True)
    rng = np.random.default_rng(0)
    print(f"threads {torch.get_num_threads()}; GFLOP/s, float32 x vs 8-bit x")
    print(f"{'shape':>20} {'rows':>5} {'float32 x':>10} {'8-bit x':>10} {'8-bit / float32 time':>21}")
    for name, (n, k, fmt, copies) in SHAPES.items():
        if only and not any(word in name for word in only):
            continue
        raw = torch.from_numpy(quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[fmt]))
        mats = [kernels.pack_block_panels(raw, BLOCK_FORMATS[fmt], k) for _ in range(copies)]
        for rows in rows_list:
            x = torch.randn(rows, k)
            times: dict[int, list[float]] = {0: [], rows: []}
            for _ in range(ROUNDS):
                for int8_rows in times:
                    times[int8_rows].append(timed(kernels, x, mats, n, fmt, int8_rows))
            f32, i8 = statistics.median(times[0]), statistics.median(times[rows])
            flop = 2 * rows * n * k
            print(f"{name:>20} {rows:>5} {flop / f32 / 1e9:>10.1f} {flop / i8 / 1e9:>10.1f} {i8 / f32:>20.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("rows", type=int, nargs="*", default=[1, 4, 8, 16, 64, 256, 512])
    parser.add_argument("--only", nargs="*", default=[])
    args = parser.parse_args()
    main(args.rows, args.only)
