"""The CPU panel kernel over float32 panels, Q4_1 blocks and K-quant blocks (re-cut into the
kernel's formats, gguf_loader.k_quant_rows): the projections of 24 layers of a
Llama-shaped model with hidden 512 and FFN 1536 (K-quants need rows of 256s), from random Q4_K
super-blocks (float32 and Q4_1 hold the same weights, dequantized) and random Q5_K and Q6_K
super-blocks of the same shapes; the formats alternated, seven rounds, medians.

    python benchmarks/cpu_block_formats.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import random_k_quant_rows  # noqa: E402

from tokenmill.cpu_kernels import load_cpu_kernels  # noqa: E402
from tokenmill.host_memory import huge_page_copies  # noqa: E402
from tokenmill.models.gguf_loader import k_quant_rows  # noqa: E402
from tokenmill.models.packed_linear import BLOCK_FORMATS  # noqa: E402

SHAPES = [(1536, 512), (512, 512), (3072, 512), (512, 1536)]  # qkv, o, gate_up, down: (N, K)
FORMATS = {"float32": 0, **{kind: BLOCK_FORMATS[kind] for kind in ("Q4_1", "Q4_K", "Q5_K", "Q6_K")}}


def build(kernels, layers: int = 24) -> dict[str, list[tuple[torch.Tensor, int, int]]]:
    """Per format, (panels, N, K) of every projection, each format's panels in one huge-page arena."""
    rng = np.random.default_rng(0)
    mats: dict[str, list] = {name: [] for name in FORMATS}
    for _ in range(layers):
        for n, k in SHAPES:
            raw = {kind: random_k_quant_rows(rng, kind, n, k) for kind in ("Q4_K", "Q5_K", "Q6_K")}
            w = dequantize(raw["Q4_K"], GGMLQuantizationType.Q4_K).astype(np.float32).reshape(n, k)
            mats["float32"].append(kernels.pack_panels(torch.from_numpy(w.copy())))
            q4_1 = torch.from_numpy(quantize(w, GGMLQuantizationType.Q4_1).copy())
            mats["Q4_1"].append(kernels.pack_block_panels(q4_1, FORMATS["Q4_1"], k))
            for kind, rows in raw.items():
                recut = torch.from_numpy(k_quant_rows(rows, kind).copy())
                mats[kind].append(kernels.pack_block_panels(recut, FORMATS[kind], k))
    shapes = SHAPES * layers
    return {name: [(p, n, k) for p, (n, k) in zip(huge_page_copies(panels), shapes)] for name, panels in mats.items()}


def main() -> None:
    torch.set_num_threads(2)
    kernels = load_cpu_kernels(required=True)
    mats = build(kernels)
    print("  ".join(f"{name}: {sum(p.nbytes for p, _, _ in m) / 1e6:.0f} MB" for name, m in mats.items()))
    for rows in (1, 8, 64):
        x = {k: torch.randn(rows, k) for k in (512, 1536)}
        times: dict[str, list[float]] = {name: [] for name in mats}
        for _ in range(7):
            for name, m in mats.items():
                start = time.perf_counter()
                for panels, n, k in m:
                    kernels.panel_linear(x[k], panels, None, n, FORMATS[name])
                times[name].append(time.perf_counter() - start)
        print(f"M={rows}: " + "  ".join(f"{name} {statistics.median(t) * 1e3:.1f} ms" for name, t in times.items()))


if __name__ == "__main__":
    main()
