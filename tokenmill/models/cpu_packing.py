"""CPU layouts of a LlamaForCausalLM's weights: projections packed in panels (or kept in their
GGUF blocks), token embeddings looked up in a GGUF file's quantized rows, and each layer built
as one C++ object.

llama.py is the model definition; this module changes how an instance stores and runs its
weights on a CPU, through the hooks the model's forward reads (`packed_lm_head`, `ops`,
`fused_stack`). The loader calls, in order:

    before loading   drop_block_weights, use_gguf_embedding   (float32 copies never allocated)
    after loading    pack_for_cpu, fuse_experts, fuse_layers, set_int8_rows
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from tokenmill.host_memory import read_only_tensor
from tokenmill.models.llama import FUSED, MLP, DecoderLayer
from tokenmill.models.moe import SparseMoeBlock
from tokenmill.models.packed_linear import (
    BF16_FORMAT,
    BLOCK_FORMATS,
    ConcatLinear,
    GGUFMatrix,
    PackedLinear,
    ToPack,
    pack_all,
)

if TYPE_CHECKING:
    from tokenmill.models.llama import LlamaForCausalLM


def projection_blocks(name: str, blocks: dict[str, GGUFMatrix]
                      ) -> tuple[list[tuple[str, list[GGUFMatrix]]] | None, list[str]]:
    """GGUF matrices of our projection `name` ("layers.3.self_attn.qkv_proj", "lm_head") as runs
    of parts of one block type, in the order load_weights stacks the weights (Q4_K_M files keep v
    in Q6_K in some layers: two runs), and its parts' checkpoint names; None for the runs unless
    every part has blocks."""
    parts = sorted((i, name.replace(ours, hf)) for hf, (ours, i) in FUSED.items() if name.endswith(ours))
    names = [("" if name == "lm_head" else "model.") + f"{part}.weight" for _, part in parts or [(0, name)]]
    found = [blocks.get(n) for n in names]
    if any(f is None for f in found):
        return None, names
    return [(kind, list(run)) for kind, run in itertools.groupby(found, key=lambda m: m.kind)], names


def packed_bytes(blocks: dict[str, GGUFMatrix], kernels) -> int:
    """Bytes the panels of GGUF matrices `blocks` take once packed by `kernels` (the C++ module):
    about the file's own bytes for most types, more for those re-cut with wider scales (Q5_K,
    Q6_K, Q3_K, Q5_0/1)."""
    return sum(math.prod(kernels.panel_shape(m.rows, m.cols, BLOCK_FORMATS[m.kind])) for m in blocks.values())


_EMBED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # GGUF types embed_rows reads


class GGUFEmbedding(nn.Module):
    """Token embeddings looked up in a GGUF file's own quantized rows (the file's mapping), each
    row dequantized when a token needs it: the float32 values dequantizing the whole table at
    load gives, bit for bit, without holding that table (113 MB for the default model, 2.1 GB
    for Llama 3's vocabulary). Q4_0, Q4_1, Q8_0 and Q4_K, Q5_K, Q6_K rows by the CPU kernels'
    embed_rows when given, other types by gguf's numpy, an order of magnitude slower a step."""

    def __init__(self, rows, qtype, dim: int, kernels=None) -> None:
        super().__init__()
        self.rows, self.qtype = rows, qtype   # rows: (vocab, bytes) uint8, numpy
        self.num_embeddings, self.embedding_dim = rows.shape[0], dim
        self.kernels = kernels if qtype.name in _EMBED_TYPES else None  # what embed_rows reads
        self.format = BLOCK_FORMATS.get(qtype.name)
        if self.kernels is not None:
            self.table = read_only_tensor(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.embed_rows(self.table, ids, self.format)
        from gguf.quants import dequantize
        if ids.numel() == 0:
            return torch.empty(0, self.embedding_dim)
        values = dequantize(self.rows[ids.numpy()], self.qtype).astype(np.float32, copy=False)
        return torch.from_numpy(values.reshape(-1, self.embedding_dim))


def drop_block_weights(model: LlamaForCausalLM, weight_blocks: dict[str, GGUFMatrix]) -> set[str]:
    """Before loading: drop the float32 weight of every projection that pack_for_cpu will pack
    from GGUF blocks, so it is never allocated nor dequantized. Returns the checkpoint names
    not to load. (The tied head keeps the embeddings, which the lookup needs.)"""
    skip = set()
    linears = [(f"layers.{name}", m) for name, m in model.layers.named_modules() if isinstance(m, nn.Linear)]
    if model.lm_head is not None:
        linears.append(("lm_head", model.lm_head))
    for name, linear in linears:
        found, names = projection_blocks(name, weight_blocks)
        if found is not None:
            linear.weight = None
            skip.update(names)
    return skip


def use_gguf_embedding(model: LlamaForCausalLM, rows, qtype, kernels=None) -> str:
    """Before loading: look tokens up in a GGUF file's quantized rows (GGUFEmbedding, with the
    CPU `kernels` where they read the type) instead of a float32 table; returns the checkpoint
    name not to load. A tied head needs its own blocks then (pack_for_cpu), as the table is
    gone. The file is read while serving: replace it by renaming, never in place."""
    from gguf.quants import dequantize
    cfg = model.config
    width = dequantize(rows[:1], qtype).size  # here rather than at the first step: a type gguf cannot read
    if rows.shape[0] != cfg.vocab_size or width != cfg.hidden_size:
        raise ValueError(f"token embeddings of {rows.shape[0]} x {width}, the model expects "
                         f"{cfg.vocab_size} x {cfg.hidden_size}")
    model.embed_tokens = GGUFEmbedding(rows, qtype, cfg.hidden_size, kernels)
    return "model.embed_tokens.weight"


def pack_for_cpu(model: LlamaForCausalLM, kernels=None, weight_blocks: dict[str, GGUFMatrix] | None = None,
                 bf16: bool = False) -> None:
    """Pack every projection and the output head (tied or not; a tensor-parallel rank's rows of it)
    in panels for the C++ kernel when `kernels` is given (float weights in bfloat16 panels with
    `bf16`), else for oneDNN. See packed_linear.py.

    `weight_blocks` maps Hugging Face weight names to their GGUF matrices: a projection whose
    parts all have blocks is packed from those instead.
    Runs after the weights are loaded: the packed copies replace the nn.Linear modules."""
    blocks = weight_blocks or {}
    cfg = model.config
    head = getattr(model.embed_tokens, "weight", None) if model.lm_head is None else model.lm_head.weight
    head_name = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    head_blocks = blocks.get(head_name)
    shape = tuple(head.shape) if head is not None else (head_blocks.rows, cfg.hidden_size)  # None: GGUF rows only
    items = [ToPack(model, "packed_lm_head", head, None, shape,
                    None if head_blocks is None else [(head_blocks.kind, [head_blocks])])]
    items += [ToPack(model.layers.get_submodule(parent), attr, m.weight, m.bias, (m.out_features, m.in_features),
                     projection_blocks(f"layers.{parent}.{attr}", blocks)[0])
              for name, m in model.layers.named_modules() if isinstance(m, nn.Linear)
              for parent, _, attr in [name.rpartition(".")]]
    model.lm_head, head = None, None  # pack_all frees each float32 weight once packed: no other holder
    pack_all(items, kernels, bf16)


def _panel_parts(projection: nn.Module) -> list[tuple] | None:
    """(panels, bias, out_features, format) of each part of a projection packed for the C++
    kernel; None if any part is not (oneDNN, or float32 left as it was)."""
    linears = list(projection.parts) if isinstance(projection, ConcatLinear) else [projection]
    if not all(isinstance(m, PackedLinear) and m.panels is not None for m in linears):
        return None
    return [(m.panels, m.bias, m.out_features, m.format) for m in linears]


def _sparse_parts(moe: SparseMoeBlock) -> list[list[tuple] | None]:
    """The panel parts of a sparse layer's router, then, where it has a shared expert, of that
    expert's gate_up, down and gate; a None among them where the C++ layer cannot run the layer
    (experts not in one call, gpt-oss's softmax after the top k, a projection not in panels)."""
    if moe.fused_experts is None or moe.softmax_after_topk:
        return [None]
    if moe.shared_expert is None:
        return [_panel_parts(moe.gate)]
    shared = moe.shared_expert
    return [_panel_parts(p) for p in (moe.gate, shared.gate_up_proj, shared.down_proj, moe.shared_expert_gate)]


def fuse_layers(model: LlamaForCausalLM, kernels) -> None:
    """When every layer's projections are panel products (PackedLinear or ConcatLinear on the
    C++ kernel, not oneDNN) and its norms share one eps, build each layer as one C++ object
    (csrc/decoder_layer_cpu.cpp: the same kernels in the same order as the layer with
    CpuFusedOps, set with it by the loader) and `fused_stack`, which runs them all and the
    final norm in one call. A sparse layer's feed-forward is its router and its experts' one
    call (fuse_experts, which runs first) and Qwen2-MoE's shared expert, where _sparse_parts
    takes them.
    forward() takes the stack when the step's attention is all in the CPU kernel, without the
    Python between the kernels, which costs small steps a sizeable part of their time
    (BENCHMARKS.md). Setting fused_stack to None goes back to the Python layers (tests and
    benchmarks compare the two)."""
    if model.layer_class is not DecoderLayer:
        return  # the C++ layer is a Llama-family SwiGLU layer (dense or sparse)
    fused = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        sparse = isinstance(mlp, SparseMoeBlock)
        feed_forward = _sparse_parts(mlp) if sparse else [_panel_parts(mlp.gate_up_proj), _panel_parts(mlp.down_proj)]
        projections = [_panel_parts(attn.qkv_proj), _panel_parts(attn.o_proj), *feed_forward]
        norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
        if any(p is None for p in projections) or len({n.eps for n in norms if n is not None}) > 1:
            return  # the C++ layer takes one eps for all its norms
        qk_norms = [None if n is None else n.weight.detach() for n in (attn.q_norm, attn.k_norm)]
        fused.append(kernels.DecoderLayer(
            layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
            layer.input_layernorm.eps, projections[:2] if sparse else projections, attn.num_heads,
            attn.num_kv_heads, attn.head_dim, attn.scale, *qk_norms))
        if sparse:
            fused[-1].set_moe(projections[2], mlp.fused_experts, mlp.top_k, mlp.norm_topk_prob)
        if sparse and mlp.shared_expert is not None:  # Qwen2-MoE
            fused[-1].set_shared_expert(*projections[3:])
        fused[-1].window = attn.window or 0  # its sliding window, 0 for none
    model.fused_layers = fused
    model.fused_stack = kernels.DecoderStack(fused, model.norm.weight.detach(), model.norm.eps)


def fuse_experts(model: LlamaForCausalLM, kernels) -> None:
    """Each sparse layer's routed experts as one C++ object (csrc/moe_cpu.cpp) in the block's
    `fused_experts`, where every expert's gate_up and down are single panel products without bias,
    gate_up in one format for all and down in one (as a GGUF file's merged expert tensors give them).
    SparseMoeBlock.forward then routes with its `route` and runs them in one call: for the same
    routing, the per-expert path's results bit for bit; setting fused_experts to None goes back to
    that path (tests and benchmarks compare the two)."""
    for layer in model.layers:
        moe = layer.mlp
        if not isinstance(moe, SparseMoeBlock) or not all(isinstance(e, MLP) for e in moe.experts):
            continue  # the kernel's activation is SiLU * up: gpt-oss's clamped experts keep their own
        if moe.softmax_after_topk:
            continue  # its route is the softmax over all experts first
        parts = [(_panel_parts(e.gate_up_proj), _panel_parts(e.down_proj)) for e in moe.experts]
        if any(g is None or d is None or len(g) != 1 or len(d) != 1 for g, d in parts):
            continue  # oneDNN, float32 left as it was, or gate and up in different block types
        gate_up, down = [g[0] for g, _ in parts], [d[0] for _, d in parts]  # (panels, bias, out_features, format)
        formats = {(g[3], d[3]) for g, d in zip(gate_up, down)}
        if len(formats) != 1 or any(p[1] is not None for p in gate_up + down):
            continue
        expert = moe.experts[0]
        moe.fused_experts = kernels.MoeExperts([p[0] for p in gate_up], [p[0] for p in down], gate_up[0][3],
                                               down[0][3], expert.gate_up_proj.in_features,
                                               expert.down_proj.in_features)


EVERY_STEP = 2**31 - 1  # int8_rows for steps of any size


def int8_rows_by_cpu(kernels) -> int:
    """gguf_int8_rows's default (EngineConfig.int8_rows_choice): every step where the kernels
    multiply 8-bit x with VNNI, faster there than decoding the blocks to float32 at every step
    size measured (BENCHMARKS.md); without VNNI, none: 8-bit x wins only at small steps there,
    and the float32 path is exact."""
    return EVERY_STEP if kernels.vnni else 0


def int8_rows_of(model: nn.Module) -> int:
    """The int8_rows the layers' block products run with (set_int8_rows); 0 without any."""
    blocks = set(BLOCK_FORMATS.values())
    return max((m.int8_rows for m in model.modules() if isinstance(m, PackedLinear) and m.format in blocks),
               default=0)


def bf16_weights_by_cpu(kernels) -> bool:
    """Whether float weights go in bfloat16 panels by default (EngineConfig.bf16_weights_choice):
    where the kernels multiply them with AVX512-BF16's vdpbf16ps, faster there than float32 panels
    at every step size measured (BENCHMARKS.md)."""
    return bool(kernels.bf16)


def bf16_weights_of(model: nn.Module) -> bool:
    """Whether any projection's weights are in bfloat16 panels."""
    return any(isinstance(m, PackedLinear) and m.format == BF16_FORMAT for m in model.modules())


def amx_min_rows_of(model: nn.Module) -> int:
    """The fewest rows of a step whose bfloat16 panels multiply on AMX tiles (kernels built for a
    CPU with AMX-BF16, csrc/gemm_cpu.cpp); 0: none do."""
    return max((m.kernels.amx_min_rows for m in model.modules()
                if isinstance(m, PackedLinear) and m.format == BF16_FORMAT), default=0)


def set_int8_rows(model: LlamaForCausalLM, rows: int) -> None:
    """The products with GGUF blocks, the output head's included, in steps of up to `rows` rows,
    take x in 8-bit blocks (see csrc/gemm_cpu.cpp); 0: never, every product bit-identical to
    float32 panels'. The head's share in what this costs in quality is in BENCHMARKS.md."""
    if isinstance(model.packed_lm_head, PackedLinear):
        model.packed_lm_head.int8_rows = rows
    for layer in model.layers:
        for m in layer.modules():
            if isinstance(m, PackedLinear):
                m.int8_rows = rows
    for fused in model.fused_layers or []:
        fused.int8_rows = rows
    for layer in model.layers:
        if getattr(layer.mlp, "fused_experts", None) is not None:
            layer.mlp.fused_experts.int8_rows = rows
