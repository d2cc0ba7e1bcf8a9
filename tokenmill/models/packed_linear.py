"""Linear layers with weights packed once at load time (CPU, float32).

`F.linear` on the CPU calls MKL's sgemm, which re-packs the weight matrix into its blocked
layout on every call; for the small M of decode steps that repacking costs as much as the
product itself. Packing once at load avoids it. Two packed forms, measured on the default
model's 121 matrices (2 threads, see BENCHMARKS.md):

- panels of 16 output features for tokenmill's own kernel (csrc/gemm_cpu.cpp), used whenever
  the C++ kernels are built: 1.5x oneDNN at M = 1, 1.2-1.4x from 16 to 128 rows, about even at 512;
- oneDNN's packed layout otherwise: against `F.linear`, M = 8 62 -> 34 ms, M = 64 148 -> 127 ms,
  M = 1 35 -> 22 ms, M = 512 within a few percent.

`F.linear` stays the reference (kernels="torch"), and tests compare all three.

Weights that came from a GGUF file in Q4_0, Q4_1 or Q8_0 also keep their blocks (a fifth of the
float32 bytes for Q4_1), in panels the same kernel reads: steps of up to twelve rows, which
stream every weight once or twice and are bound by memory, read those instead (up to 3x faster
on the default model's matrices, BENCHMARKS.md), with bit-identical results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.host_memory import huge_page_copies

_BATCH_HINT = 64  # oneDNN picks its weight layout for this M; every M works with it
BLOCK_FORMATS = {"Q4_0": 1, "Q4_1": 2, "Q8_0": 3}  # GGUF types the panel kernel reads as blocks
BLOCK_ROWS = 12  # steps of at most this many rows read the blocks: two passes of the kernel's tile


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W packed once: in panels when `kernels` (the C++ module) is given,
    else in oneDNN's layout. One packed copy either way; the plain weight is dropped.

    `blocks` (GGUF type name, rows (N, bytes) uint8) are the same weights as stored in a GGUF
    file; with the panel kernel they are kept too, for steps of up to BLOCK_ROWS rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels=None,
                 blocks: tuple[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self.kernels = kernels
        weight = weight.detach().contiguous()
        self.panels = kernels.pack_panels(weight) if kernels is not None else None
        self.packed = None if kernels is not None else torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        self.block_format, self.block_panels = 0, None
        if blocks is not None and kernels is not None and kernels.block_formats:
            self.block_format = BLOCK_FORMATS[blocks[0]]
            self.block_panels = kernels.pack_block_panels(blocks[1], self.block_format, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_panels is not None and x.shape[0] <= BLOCK_ROWS:
            return self.kernels.panel_linear(x, self.block_panels, self.bias, self.out_features, self.block_format)
        if self.panels is not None:
            return self.kernels.panel_linear(x, self.panels, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        layout = "panels" if self.panels is not None else "onednn"
        if self.block_panels is not None:
            layout += f" + {next(k for k, v in BLOCK_FORMATS.items() if v == self.block_format)} blocks"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={layout}"


def pack_linears(model: nn.Module, kernels=None, blocks_of: Callable[[str], tuple | None] | None = None) -> int:
    """Replace every nn.Linear inside `model` by a PackedLinear; returns how many were packed.
    `blocks_of(name)` gives a linear's GGUF blocks, if any (see PackedLinear)."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        blocks = blocks_of(name) if blocks_of is not None else None
        setattr(parent, child, PackedLinear(linear.weight, linear.bias, kernels, blocks))
    return len(targets)


def panels_to_huge_pages(model: nn.Module) -> None:
    """Move the panels (and the block panels, in an arena of their own) onto huge pages: a
    batch-1 decode step streams all of them, and without a TLB miss every 4 KB it ran about 7%
    faster (BENCHMARKS.md)."""
    for attr in ("panels", "block_panels"):
        linears = [m for m in model.modules() if isinstance(m, PackedLinear) and getattr(m, attr) is not None]
        for linear, copy in zip(linears, huge_page_copies([getattr(m, attr) for m in linears])):
            setattr(linear, attr, copy)
