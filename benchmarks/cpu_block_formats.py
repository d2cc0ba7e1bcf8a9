"""The CPU panel kernel over float32 panels, Q4_1 blocks and Q4_K blocks (re-cut into blocks of
32 with float32 scales, loader.q4_k_as_blocks_of_32) of the same weights: the projections of
24 layers of a Llama-shaped model with hidden 512 and FFN 1536 (Q4_K needs rows of 256s), from
random Q4_K super-blocks; the three alternated, seven rounds, medians.

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
from tokenmill.cpu_kernels import load_cpu_kernels  # noqa: E402
from tokenmill.host_memory import huge_page_copies  # noqa: E402
from tokenmill.models.loader import q4_k_as_blocks_of_32  # noqa: E402

SHAPES = [(1536, 512), (512, 512), (3072, 512), (512, 1536)]  # qkv, o, gate_up, down: (N, K)
FORMATS = {"float32": 0, "Q4_1": 2, "Q4_K": 4}


def build(kernels, layers: int = 24) -> dict[str, list[tuple[torch.Tensor, int, int]]]:
    """Per format, (panels, N, K) of every projection, each format's panels in one huge-page arena."""
    rng = np.random.default_rng(0)
    mats: dict[str, list] = {name: [] for name in FORMATS}
    for _ in range(layers):
        for n, k in SHAPES:
            raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
            raw[..., 0:4] = (rng.random((n, k // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
            raw = raw.reshape(n, -1)
            w = dequantize(raw, GGMLQuantizationType.Q4_K).astype(np.float32).reshape(n, k)
            mats["float32"].append(kernels.pack_panels(torch.from_numpy(w.copy())))
            q4_1 = torch.from_numpy(quantize(w, GGMLQuantizationType.Q4_1).copy())
            mats["Q4_1"].append(kernels.pack_block_panels(q4_1, FORMATS["Q4_1"], k))
            q4_k = torch.from_numpy(q4_k_as_blocks_of_32(raw).copy())
            mats["Q4_K"].append(kernels.pack_block_panels(q4_k, FORMATS["Q4_K"], k))
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
