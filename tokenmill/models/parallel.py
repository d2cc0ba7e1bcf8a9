"""Tensor-parallel layers: how one rank of N holds and runs its share of a Llama-family model.

Megatron's split, one all-reduce per half-layer:

    qkv_proj, gate_up_proj   column-parallel: rank r keeps its q heads, its k/v heads and its slice of
                             the intermediate size, cut inside each fused parameter (q, k and v; gate
                             and up separately), so attention and SiLU*up run on local columns only
    o_proj, down_proj        row-parallel: rank r keeps the input columns matching its heads/slice;
                             the partial products are summed over the ranks by one all-reduce
    embed_tokens             vocab-parallel: rank r keeps a contiguous range of rows; a token outside
                             it looks up zeros, and an all-reduce sums the one rank's row into all
    lm_head                  vocab-parallel: rank r keeps the same range of rows (of the table itself
                             when tied) and computes those logits for the rows that sample; rank 0
                             gathers the slices (distributed.gather_logits), where sampling runs

A mixture of experts is split by experts instead (expert parallelism): rank r holds whole experts
[r E / N, (r + 1) E / N) and every rank the router; each computes the routed rows of its own
experts, and one all-reduce after the block sums the ranks' shares. A shared expert is cut as a
dense MLP is (its columns, then its input columns), and joins the same sum.

A rank's model is the plain LlamaForCausalLM built from `local_config` (its head and intermediate
counts divided by N) with its vocabulary rows in place of the table and the head (`shard_vocab`),
fed weights that `shard_weights` cut from the full checkpoint tensors (a GGUF file's projections kept
in their quantized blocks are cut where `tensor_cut` says, from the file's blocks: gguf_loader.py);
after loading, the row-parallel projections are wrapped (`parallelize`) so that forward() sums over
the ranks. The all-reduce runs through an `AllReduce` callable, so the layers know nothing of
process groups (distributed.TPGroup.all_reduce is one, over the device group).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.models.moe import SparseMoeBlock, checkpoint_name

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the ranks, in place; returns it


@dataclass(frozen=True)
class TPShard:
    """Which share of the model a rank holds: rank `rank` of `size`."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1}")

    def split(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's equal part of `total` (a multiple of size)."""
        part = total // self.size
        return self.rank * part, part

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the embedding rows this rank holds: ceil(V / N) each, the last fewer."""
        per_rank = -(-vocab_size // self.size)
        start = min(self.rank * per_rank, vocab_size)
        return start, min(start + per_rank, vocab_size)


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse a model that N ranks cannot split evenly, naming the counts; an encoder, which runs
    on one rank; and attention sinks or an o_proj bias (gpt-oss's, Llama's with attention_bias),
    which are not split over ranks."""
    if cfg.encoder is not None and size > 1:
        raise ValueError(f"tensor_parallel_size {size}: {cfg.architecture} is an encoder, which runs on one rank; "
                         "use tensor_parallel_size 1")
    unsplit = [what for what, has in (("attention sinks", cfg.attention_sinks), ("o_proj bias", cfg.o_proj_bias))
               if has]
    if unsplit and size > 1:  # neither is cut or summed per rank
        raise ValueError(f"tensor_parallel_size {size}: this {cfg.architecture} model's {' and '.join(unsplit)} "
                         "are not split over ranks; use tensor_parallel_size 1")
    counts = [("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)]
    moe = cfg.moe
    if moe is None or any(not moe.is_sparse(layer) for layer in range(cfg.num_layers)):
        counts.append(("intermediate_size", cfg.intermediate_size))
    if moe is not None:
        counts += [("num_experts", moe.num_experts)] + (
            [("shared_expert_intermediate_size", moe.shared_expert_intermediate_size)]
            if moe.shared_expert_intermediate_size else [])
    if bad := [f"{name} = {value}" for name, value in counts if value % size]:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {', '.join(bad)} "
                         f"(pick a size that divides each of {', '.join(f'{name} {value}' for name, value in counts)})")


def local_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The config a rank's model is built from: its heads, intermediate slice and experts (the
    vocabulary stays whole: shard_vocab cuts it)."""
    check_divisible(cfg, shard.size)
    moe = cfg.moe
    if moe is not None:
        first, count = shard.split(moe.num_experts)
        moe = dataclasses.replace(moe, held_experts=(first, first + count),
                                  shared_expert_intermediate_size=moe.shared_expert_intermediate_size // shard.size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // shard.size,
                               num_kv_heads=cfg.num_kv_heads // shard.size,
                               intermediate_size=cfg.intermediate_size // shard.size, moe=moe)


# Checkpoint names (after "model.") and how each is cut: columns of a fused output, or input columns.
_COLUMN_HEADS = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv"}
_COLUMN_MLP = {"mlp.gate_proj": "mlp", "mlp.up_proj": "mlp", "mlp.shared_expert.gate_proj": "shared",
               "mlp.shared_expert.up_proj": "shared"}
_ROW_PARALLEL = {"self_attn.o_proj": "q", "mlp.down_proj": "mlp", "mlp.shared_expert.down_proj": "shared"}


def tensor_cut(name: str, cfg: ModelConfig, shard: TPShard) -> tuple[int, int, int] | None:
    """How this rank's part of checkpoint tensor `name` (Hugging Face naming, full model `cfg`) is cut:
    (dim, start, length), dim 0 for output rows (column- and vocab-parallel), 1 for input columns
    (row-parallel); None for a tensor every rank holds whole (norms)."""
    name = name.removeprefix("model.")
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shared = cfg.moe.shared_expert_intermediate_size if cfg.moe is not None else 0
    sizes = {"q": q_size, "kv": kv_size, "mlp": cfg.intermediate_size, "shared": shared}
    for part, kind in (_COLUMN_HEADS | _COLUMN_MLP).items():
        if f"{part}." in name:
            return 0, *shard.split(sizes[kind])                        # weight rows and bias
    for part, kind in _ROW_PARALLEL.items():
        if f"{part}." in name:
            return 1, *shard.split(sizes[kind])                        # input columns (no bias in these models)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        start, end = shard.vocab_range(cfg.vocab_size)
        return 0, start, end - start
    return None


def holds(name: str, cfg: ModelConfig, shard: TPShard) -> bool:
    """Whether this rank holds checkpoint tensor `name` at all: a routed expert's only on the rank
    whose share of the experts has it (local_config), everything else on every rank."""
    name = checkpoint_name(name)
    if cfg.moe is None or ".mlp.experts." not in name:
        return True
    first, count = shard.split(cfg.moe.num_experts)
    return first <= int(name.split(".mlp.experts.")[1].split(".")[0]) < first + count


def shard_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig, shard: TPShard) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` (tensor_cut), a view."""
    cut = tensor_cut(name, cfg, shard)
    return tensor if cut is None else tensor.narrow(*cut)


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig,
                  shard: TPShard) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors this rank holds (holds), cut for it (shard_tensor)."""
    for name, tensor in weights:
        if holds(name, cfg, shard):
            yield name, shard_tensor(name, tensor, cfg, shard)


class RowParallel(nn.Module):
    """A row-parallel projection: the rank's partial product, summed over the ranks."""

    def __init__(self, inner: nn.Module, all_reduce: AllReduce) -> None:
        super().__init__()
        self.inner = inner
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.inner.forward(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding table; ids outside look up zeros, and the all-reduce
    fills in the row from the rank that holds it. `num_embeddings` is the whole vocabulary."""

    def __init__(self, num_embeddings: int, dim: int, start: int, end: int, all_reduce: AllReduce) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(end - start, dim), requires_grad=False)
        self.start, self.end = start, end
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.all_reduce = all_reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        x = F.embedding(torch.where(outside, 0, ids - self.start), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.all_reduce(x)


def shard_vocab(model: nn.Module, cfg: ModelConfig, shard: TPShard, all_reduce: AllReduce) -> None:
    """Before loading (the model built from local_config, on any device): the rank's rows of the
    embedding table and of an untied head in place of the whole ones, so that load_weights fills
    them from shard_weights; a tied head reads the embedding's rows, which are the same."""
    start, end = shard.vocab_range(cfg.vocab_size)
    model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, start, end, all_reduce)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(cfg.hidden_size, end - start, bias=False)


class ExpertParallel(nn.Module):
    """A mixture-of-experts block whose rank computes its own experts' share: summed over the ranks."""

    def __init__(self, inner: SparseMoeBlock, all_reduce: AllReduce) -> None:
        super().__init__()
        self.inner = inner
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.all_reduce(self.inner.forward(x, ops))


def parallelize(model: nn.Module, all_reduce: AllReduce) -> None:
    """After loading and packing: o_proj and down_proj become row-parallel (their packed form kept
    inside), a mixture-of-experts block sums once over the ranks. The one-call fused layers
    (cpu_packing.fuse_layers) are dropped, since the sums fall inside a layer; the Python layers
    run the same kernels."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, all_reduce)
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp = ExpertParallel(layer.mlp, all_reduce)
        else:
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, all_reduce)
    model.fused_layers, model.fused_stack = None, None
