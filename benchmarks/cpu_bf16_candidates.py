"""Which matrix product should a bf16 CPU path use, by row count? (issue 28)

Times the default model's projection shapes (SmolLM2-135M: hidden 576, MLP 1536, 9 query and 3 kv
heads of 64, a 49,152-token head) through each candidate torch offers, at 1..512 rows:

    f32          F.linear in float32 (torch's own; tokenmill's tiles are not built here)
    bf16         F.linear in bfloat16 (oneDNN picks AMX or AVX512-BF16 itself)
    bf16_packed  oneDNN's prepacked bf16 linear (torch.ops.mkldnn._linear_pointwise), weights
                 reordered once for the row count, as inductor's CPU backend does
    bf16_f32out  bf16 operands with float32 output (torch.mm(..., out_dtype=float32))
    int8         torch._int_mm of int8 rows and int8 weights (VNNI / AMX-INT8), int32 sums
    tm_f32       tokenmill's float32 panels (csrc/gemm_cpu.cpp), where its kernels build
    tm_bf16      tokenmill's bfloat16 panels (vdpbf16ps; AMX tiles from the kernels' amx_min_rows
                 rows where they are built for amx), where its kernels have AVX512-BF16: the
                 products `dtype` auto takes for float weights there

Weights are rotated over 30 copies (the model's 30 layers), so small steps read them from memory as
a decode step does. Prints GFLOP/s per variant and the relative error against float64.

    taskset -c 0,1 python benchmarks/cpu_bf16_candidates.py --threads 2 [--variants tm_bf16 bf16_packed]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.models.packed_linear import BF16_FORMAT

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}


def _time(fn, copies: int, min_s: float = 0.15) -> float:
    """Median seconds of one call, cycling over `copies` weight sets."""
    for i in range(3):
        fn(i % copies)
    times, start, i = [], time.perf_counter(), 0
    while time.perf_counter() - start < min_s or len(times) < 5:
        t = time.perf_counter()
        fn(i % copies)
        times.append(time.perf_counter() - t)
        i += 1
    return sorted(times)[len(times) // 2]


def _variants(ws: list[torch.Tensor], m: int, wanted: set[str] | None) -> dict:
    """Each candidate in `wanted` (None: all) as (prepare the activations, call on weight copy i)."""
    def want(name: str) -> bool:
        return wanted is None or name in wanted

    wb = [w.bfloat16() for w in ws]
    out = {}
    if want("f32"):
        out["f32"] = lambda x, i: F.linear(x, ws[i])
    if want("bf16"):
        out["bf16"] = lambda x, i: F.linear(x.bfloat16(), wb[i])
    try:
        if want("bf16_packed"):
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in wb]
            out["bf16_packed"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), packed[i], None,
                                                                              "none", [], "")
    except RuntimeError:
        pass
    wt = [w.t() for w in wb]
    try:
        if want("bf16_f32out"):
            torch.mm(torch.zeros(1, ws[0].shape[1], dtype=torch.bfloat16), wt[0], out_dtype=torch.float32)
            out["bf16_f32out"] = lambda x, i: torch.mm(x.bfloat16(), wt[i], out_dtype=torch.float32)
    except (RuntimeError, TypeError):
        pass
    kernels = load_cpu_kernels(required=False)
    if kernels is not None:
        n = ws[0].shape[0]
        if want("tm_f32"):
            f32 = [kernels.pack_panels(w) for w in ws]
            out["tm_f32"] = lambda x, i: kernels.panel_linear(x, f32[i], None, n, 0, None, 0)
        if kernels.bf16 and want("tm_bf16"):
            b16 = [kernels.pack_panels(w.bfloat16()) for w in ws]
            out["tm_bf16"] = lambda x, i: kernels.panel_linear(x, b16[i], None, n, BF16_FORMAT, None, 0)
    try:
        if want("int8"):
            w8 = [(w / w.abs().amax(1, keepdim=True) * 127).round().to(torch.int8).t().contiguous() for w in ws]
            torch._int_mm(torch.zeros(max(m, 17), ws[0].shape[1], dtype=torch.int8), w8[0])
            out["int8"] = lambda x, i: torch._int_mm(x, w8[i])
    except RuntimeError:
        pass
    return out


def _error(name: str, fn, x: torch.Tensor, w: torch.Tensor) -> float:
    if name == "int8":
        return float("nan")
    ref = F.linear(x.double(), w.double())
    return float((fn(x, 0).double() - ref).norm() / ref.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 512])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--variants", nargs="+", help="only these candidates (default: every one that runs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads", flush=True)
    torch.manual_seed(0)
    for shape in args.shapes:
        k, n = SHAPES[shape]
        copies = 1 if shape == "head" else 30
        ws = [torch.randn(n, k) / k ** 0.5 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k)
            x8 = torch.randint(-127, 128, (max(m, 17), k), dtype=torch.int8)  # _int_mm wants > 16 rows
            cells = []
            for name, fn in _variants(ws, m, set(args.variants) if args.variants else None).items():
                arg = x8 if name == "int8" else x
                s = _time(lambda i: fn(arg, i), copies)
                cells.append(f"{name} {2 * arg.shape[0] * k * n / s / 1e9:7.1f}")
                if m == 64:
                    cells[-1] += f" (err {_error(name, fn, x, ws[0]):.1e})"
            print(f"{shape:8s} M={m:4d} GFLOP/s: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
