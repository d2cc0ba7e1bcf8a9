"""Linear layers with weights packed once for oneDNN (CPU, float32).

`F.linear` on the CPU calls MKL's sgemm, which re-packs the weight matrix into its
blocked layout on every call. For the small M of decode steps that repacking costs as
much as the product itself; packing once at load time and calling oneDNN's matmul on the
packed weight streams each weight once per step. Measured on the default model's 121
matrices in sequence (2 threads, see BENCHMARKS.md): M=8 62 -> 34 ms, M=64 148 -> 127 ms,
M=512 within a few percent, M=1 35 -> 22 ms.

For 1 to 8 rows (decode with a handful of sequences) even oneDNN leaves bandwidth unused;
there a small C++ kernel (csrc/gemv_cpu.cpp) streams the plain weight instead, about 25%
faster. That needs the plain copy kept beside the packed one, so it is used only when the
model is small next to the machine's memory (`keep_plain`).

`F.linear` stays the reference (kernels="torch"), and tests compare the two.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tokenmill.host_memory import huge_page_copies

_BATCH_HINT = 64  # oneDNN picks its weight layout for this M; every M works with it


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


SMALL_M = 8  # rows up to which the plain-weight kernel beats oneDNN (measured; slower from 12)


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W in oneDNN's packed layout (and, with `kernels`, also plain for
    the small-M kernel)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels=None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)
        self.bias = None if bias is None else bias.detach()
        self.kernels = kernels
        self.plain = weight.detach().contiguous() if kernels is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None and x.shape[0] <= SMALL_M:
            return self.kernels.small_m_linear(x, self.plain, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def pack_linears(model: nn.Module, kernels=None) -> int:
    """Replace every nn.Linear inside `model` by a PackedLinear; returns how many were packed."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(linear.weight, linear.bias, kernels))
    return len(targets)


def plain_to_huge_pages(model: nn.Module) -> None:
    """Move the plain weight copies into one huge-page arena: a batch-1 decode step streams all
    of them, and without a TLB miss every 4 KB it ran about 7% faster (BENCHMARKS.md)."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) and m.plain is not None]
    for linear, plain in zip(linears, huge_page_copies([m.plain for m in linears])):
        linear.plain = plain


def keep_plain(weight_bytes: int) -> bool:
    """Whether a second, plain copy of the weights fits easily: at most a tenth of the RAM."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 2 * weight_bytes <= ram // 10
