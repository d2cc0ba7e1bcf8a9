"""One panel product in two builds of the CPU kernels, alternated in one process: panel_linear at a
row count over matrices that together outgrow the caches (so every call streams its panels from
memory, as a decode step does), each build packing its own panels (their layouts may differ).

    python benchmarks/panel_builds_ab.py old=/tmp/old/tokenmill/csrc new=tokenmill/csrc \
        [--kind Q4_K] [--rows 1 [8 64 ...]] [--shape 4096 2048] [--count 24] [--reps 60]

Kinds: Q4_K, Q5_K, Q6_K (random super-blocks, as tests/conftest.py makes them), Q4_0, Q4_1, Q8_0
(random floats quantized by gguf) or BF16 (random float weights in bfloat16 panels). x takes
8-bit blocks at every row count (int8_rows), as the default is on a CPU with VNNI. Prints, at each
row count, each build's time a matrix, read rate and GFLOP/s, and the median of the per-rep ratios
of the second build to the first.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import random_k_quant_rows  # noqa: E402
from kernel_builds import build_named  # noqa: E402

from tokenmill.models.gguf_loader import k_quant_rows  # noqa: E402
from tokenmill.models.packed_linear import BF16_FORMAT, BLOCK_FORMATS  # noqa: E402

EVERY_STEP = 2**31 - 1


def pack(module, kind: str, n: int, k: int, count: int) -> tuple[list[torch.Tensor], int]:
    """`count` random (n, k) matrices of `kind` as `module` packs them, and their panel format."""
    rng = np.random.default_rng(0)
    if kind == "BF16":
        torch.manual_seed(0)
        return [module.pack_panels(torch.randn(n, k).to(torch.bfloat16), None) for _ in range(count)], BF16_FORMAT
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        raw = rng.standard_normal((n, k)).astype(np.float32)
        rows = [torch.from_numpy(quantize(raw, GGMLQuantizationType[kind]))] * count
    else:
        rows = [torch.from_numpy(k_quant_rows(random_k_quant_rows(rng, kind, n, k), kind).copy()) for _ in range(count)]
    return [module.pack_block_panels(r, BLOCK_FORMATS[kind], k) for r in rows], BLOCK_FORMATS[kind]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs=2, help="name=path/to/csrc")
    parser.add_argument("--kind", default="Q4_K", choices=["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0", "BF16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--shape", type=int, nargs=2, default=[4096, 2048], metavar=("N", "K"))
    parser.add_argument("--count", type=int, default=24, help="matrices, cycled through")
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args()
    modules = build_named(args.builds)
    n, k = args.shape
    panels = {}
    for name, module in modules.items():
        panels[name], fmt = pack(module, args.kind, n, k, args.count)
    for rows in args.rows:
        compare(modules, panels, fmt, rows, n, k, args)


def compare(modules: dict, panels: dict, fmt: int, rows: int, n: int, k: int, args: argparse.Namespace) -> None:
    """Both builds' products of `rows` rows, alternated rep by rep; prints their times and ratio."""
    names = list(modules)
    x = torch.randn(rows, k)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            for p in panels[name]:
                modules[name].panel_linear(x, p, None, n, fmt, None, EVERY_STEP)
            times[name].append(time.perf_counter() - start)
    warm = 5  # reps dropped: the first calls fault the panels' pages in
    for name in names:
        median, size = statistics.median(times[name][warm:]), panels[name][0].numel() * panels[name][0].element_size()
        flop = 2 * rows * n * k * args.count
        print(f"{name}: {median / args.count * 1e6:.1f} us a matrix ({size / 1e6:.2f} MB), "
              f"{size * args.count / median / 1e9:.1f} GB/s, {flop / median / 1e9:.0f} GFLOP/s")
    ratios = [b / a for a, b in zip(times[names[0]][warm:], times[names[1]][warm:])]
    print(f"{names[1]} / {names[0]}: {statistics.median(ratios):.3f} (median of {len(ratios)} reps; "
          f"{args.kind}, {rows} rows, {n}x{k}, {args.count} matrices)")


if __name__ == "__main__":
    main()
