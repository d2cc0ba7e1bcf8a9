"""Linear layers with weights packed once at load time (CPU, float32).

`F.linear` on the CPU calls MKL's sgemm, which re-packs the weight matrix into its blocked
layout on every call; for the small M of decode steps that repacking costs as much as the
product itself. Packing once at load avoids it. Two packed forms (their figures against each
other and against `F.linear` are in BENCHMARKS.md):

- panels of 16 output features for tokenmill's own kernel (csrc/gemm_cpu.cpp), used whenever
  the C++ kernels are built: faster than oneDNN for small steps, even with it at 512 rows;
- oneDNN's packed layout otherwise, faster than `F.linear` but for the largest steps.

`F.linear` stays the reference (kernels="torch"), and tests compare all three.

Weights that came from a GGUF file in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, a K-quant (Q3_K to Q6_K) or MXFP4 stay
in their blocks instead (a fifth of the float32 bytes for Q4_1), re-laid as panels the same
kernel reads and decodes with gguf's own arithmetic, so results are bit-identical to the float32
panels': faster at batch-1 decode, which streams every weight once, and even with them on
the default workload (BENCHMARKS.md). Steps of up to `int8_rows` rows (EngineConfig.gguf_int8_rows:
by default every step on a CPU with VNNI, none elsewhere) take x in 8-bit blocks and multiply the
codes as integers instead, as llama.cpp does: faster, within about half a percent of the float32
product, not bit-identical (not MXFP4, whose steps stay in float32).

Float weights (a Hugging Face checkpoint's) go in bfloat16 panels instead of float32 ones where
the loader asks (dtype unset or "bfloat16" on a CPU whose kernels have AVX512-BF16): rounded once to
bfloat16, as is each product's x, the sums and outputs float32; half the bytes to stream and
twice the products an instruction (BENCHMARKS.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from tokenmill.host_memory import huge_page_slots

_BATCH_HINT = 64  # oneDNN picks its weight layout for this M; every M works with it
# GGUF types the panel kernel reads as blocks; the K-quants, Q5_0 and Q5_1 re-cut at load
# (loader.py) into the kernel's formats Q4F and Q5K (Q4_K's and Q5_K's super-blocks), Q5F
# (32-weight blocks with float32 scales: Q5_0, Q5_1) and Q6F (super-blocks with a scale per 16
# weights: Q6_K, and Q3_K too); MXFP4 (gpt-oss's experts) as the file has it, its FP4 codes decoded by
# the kernel (never in 8-bit steps)
BLOCK_FORMATS = {"Q4_0": 1, "Q4_1": 2, "Q8_0": 3, "Q4_K": 4, "Q5_K": 7, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5,
                 "Q3_K": 6, "MXFP4": 8}
BF16_FORMAT = 9  # float weights rounded to bfloat16, for the kernels' vdpbf16ps tiles (gemm_cpu.cpp)


def float_format(in_features: int, bf16: bool) -> int:
    """The panel format of float weights: bfloat16 where asked and the rows pair up (the tiles
    read k two at a time), else float32 (0)."""
    return BF16_FORMAT if bf16 and in_features % 2 == 0 else 0


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W packed once: in panels when `kernels` (the C++ module) is given,
    else in oneDNN's layout. One packed copy either way; the plain weight is dropped.

    `blocks` (GGUF type name, rows (N, bytes) uint8) are the same weights as a GGUF file stores
    them (K-quants re-cut into blocks of 32, loader.py): with the panel kernel, the panels hold
    those blocks rather than float32 (`format`), and
    `weight` may be None (never loaded, see cpu_packing.drop_block_weights) with its
    (out, in) `shape` given instead. `panels_out` (of the panels' shape and dtype) is where to pack
    them, a slot of pack_all's arena. `bf16`: float weights go in bfloat16 panels (float_format),
    their products taking x rounded to bfloat16, with float32 sums and outputs."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, kernels=None,
                 blocks: tuple[str, torch.Tensor] | None = None, shape: tuple[int, int] | None = None,
                 panels_out: torch.Tensor | None = None, bf16: bool = False) -> None:
        super().__init__()
        use_blocks = blocks is not None and kernels is not None and kernels.block_formats
        if weight is None and not (use_blocks and shape is not None):
            raise ValueError("PackedLinear: no weight, and no GGUF blocks the kernel can read with their shape")
        self.out_features, self.in_features = weight.shape if weight is not None else shape
        self.bias = None if bias is None else bias.detach()
        self.kernels = kernels
        self.format, self.panels, self.packed = 0, None, None  # format: 0 float32, BLOCK_FORMATS or BF16_FORMAT
        self.int8_rows = 0  # blocks: steps of up to this many rows take x in 8-bit blocks (gemm_cpu.cpp)
        if use_blocks:
            self.format = BLOCK_FORMATS[blocks[0]]
            self.panels = kernels.pack_block_panels(blocks[1], self.format, self.in_features, panels_out)
        elif kernels is not None:
            self.format = float_format(self.in_features, bf16)
            dtype = torch.bfloat16 if self.format == BF16_FORMAT else torch.float32
            self.panels = kernels.pack_panels(weight.detach().to(dtype).contiguous(), panels_out)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: where to write y (the panel kernel only), a column range of a ConcatLinear's output."""
        if out is not None and self.panels is None:
            raise ValueError("PackedLinear: `out` needs the panel kernel")
        if self.panels is not None:
            return self.kernels.panel_linear(x, self.panels, self.bias, self.out_features, self.format, out,
                                             self.int8_rows)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        layout = "onednn" if self.panels is None else "panels"
        if self.format == BF16_FORMAT:
            layout += " of bfloat16"
        elif self.format:
            layout += f" of {next(k for k, v in BLOCK_FORMATS.items() if v == self.format)} blocks"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={layout}"


class ConcatLinear(nn.Module):
    """A fused projection whose parts came from GGUF in different block types (Q4_K_M files keep
    v in Q6_K in some layers, q and k in Q4_K): one PackedLinear per run of one type, each writing
    its columns of the one output, so that no part needs float32 weights."""

    def __init__(self, parts: list[PackedLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.new_empty(x.shape[0], self.out_features)
        start = 0
        for part in self.parts:
            part.forward(x, y[:, start:start + part.out_features])
            start += part.out_features
        return y


@dataclass(frozen=True)
class GGUFMatrix:
    """A GGUF matrix kept in its blocks: its type name, its row and column counts, and a way to
    read its rows (N, bytes) uint8 (K-quants re-cut, loader.py). Rows are read only when the matrix
    is packed, and dropped right after, so that loading holds one matrix's rows at a time."""

    kind: str
    rows: int
    read: Callable[[], torch.Tensor]
    cols: int


@dataclass
class ToPack:
    """A projection to pack into `owner.attr`: its float32 weight (None when never loaded), bias,
    (out, in) shape, and its GGUF matrices as runs of one block type (None: float32)."""

    owner: nn.Module
    attr: str
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    shape: tuple[int, int]
    runs: list[tuple[str, list[GGUFMatrix]]] | None = None

    def pieces(self, kernels) -> list[tuple[str | None, list[GGUFMatrix], int]]:
        """(block type, matrices, rows) of each PackedLinear this becomes: one per run of blocks
        when the kernel reads them, else one of float32 (type None)."""
        if not self.runs or kernels is None or not kernels.block_formats:
            return [(None, [], self.shape[0])]
        return [(kind, run, sum(m.rows for m in run)) for kind, run in self.runs]


def pack_all(items: list[ToPack], kernels=None, bf16: bool = False) -> None:
    """Pack every projection: in panels when `kernels` (the C++ module) is given (float weights in
    bfloat16 ones with `bf16`, see PackedLinear), else for oneDNN.

    The panels go straight into slots of one huge-page arena, laid out first from their shapes: a
    batch-1 decode step streams all of them, and without a TLB miss every 4 KB it ran about 7%
    faster (BENCHMARKS.md); packing in place, rather than packing and copying, keeps loading from
    holding the panels twice. A projection whose parts came in different block types becomes a
    ConcatLinear of one PackedLinear per run."""
    if kernels is None:
        for item in items:
            setattr(item.owner, item.attr, PackedLinear(item.weight, item.bias))
        return
    pieces_of = [item.pieces(kernels) for item in items]
    formats = [[BLOCK_FORMATS[kind] if kind else float_format(item.shape[1], bf16) for kind, _, _ in pieces]
               for item, pieces in zip(items, pieces_of)]
    shapes = [[(kernels.panel_shape(rows, item.shape[1], fmt), torch.uint8 if fmt else torch.float32)
               for (_, _, rows), fmt in zip(pieces, piece_formats)]
              for item, pieces, piece_formats in zip(items, pieces_of, formats)]
    slots = iter(huge_page_slots([math.prod(shape) * dtype.itemsize for piece in shapes for shape, dtype in piece]))
    # a bar only when packing takes a while (an 8B-class model: half a minute), and on a terminal
    bar = tqdm(zip(items, pieces_of, shapes), total=len(items), desc="packing weights", unit="matrix", delay=2,
               leave=False, disable=None)
    for item, pieces, piece_shapes in bar:
        if sum(rows for _, _, rows in pieces) != item.shape[0]:
            raise ValueError(f"{item.attr}: the file's matrices have {sum(r for _, _, r in pieces)} rows, "
                             f"the model expects {item.shape[0]}")
        parts, start = [], 0
        for (kind, run, rows), (shape, dtype) in zip(pieces, piece_shapes):
            out = next(slots).view(dtype).view(shape)
            bias = None if item.bias is None else item.bias[start:start + rows]
            blocks = None
            if kind is not None:
                blocks = (kind, run[0].read() if len(run) == 1 else torch.cat([m.read() for m in run]))
            parts.append(PackedLinear(None if kind else item.weight, bias, kernels, blocks, (rows, item.shape[1]), out,
                                      bf16))
            del blocks  # before the next matrix is read
            start += rows
        setattr(item.owner, item.attr, parts[0] if len(parts) == 1 else ConcatLinear(parts))
        item.weight = None  # the float32 weight goes with the nn.Linear it came from
