"""CPU backend: a C++ kernel (csrc/paged_attention_cpu.cpp) for every query it runs well, SDPA
for the rest (long prompt chunks of head sizes that are not a multiple of 32; over an int8 pool,
which SDPA cannot read, the kernel takes those too). A layer's sliding window is the kernel's too
(its prompt tiles then take the per-row path, not the tile products), and so is a cap on the scores
(Gemma 2: c * tanh(s / c), same per-row path), and so are attention sinks (gpt-oss: one more logit
in each head's softmax denominator, on every path)."""

from __future__ import annotations

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.reference import attend_sequences


class CpuPagedAttention:
    name = "cpu"
    graph_safe = True     # a plain decode step reads only the metadata's device tensors (graphs are
                          # captured on CUDA only; tests run the padded graph path through this one)

    def __init__(self, kernel, head_dim: int = 64, int8_pool: bool = False) -> None:
        self.kernel = kernel
        # Sequences with at most this many query tokens go through the kernel. With head sizes a
        # multiple of 32 it runs prompt tiles as small matrix products, faster than SDPA at every
        # length measured (BENCHMARKS.md); otherwise SDPA's blocked kernel wins above 32 tokens.
        self.short_query_max = 1 << 30 if head_dim % 32 == 0 or int8_pool else 32

    @staticmethod
    def all_in_kernel(meta: AttentionMetadata) -> bool:
        """Whether the kernel takes every sequence of the step (then a model can run all its
        layers in one C++ call, models/cpu_packing.fuse_layers)."""
        return meta.num_short == meta.num_seqs

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.kernel.write_kv(k, v, k_cache, v_cache, meta.slot_block, meta.slot_offset)
        b, t = meta.num_short, meta.num_short_tokens
        w, cap = window or 0, softcap or 0.0  # the kernel's window and cap: 0 for none
        if self.all_in_kernel(meta):
            return self.kernel.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                               meta.seq_lens, scale, w, cap, sinks)
        out = torch.empty_like(q)
        if b:
            out[:t] = self.kernel.paged_attention(q[:t], k_cache, v_cache, meta.block_tables[:b],
                                                  meta.query_start_loc[:b + 1], meta.seq_lens[:b], scale, w, cap,
                                                  sinks)
        attend_sequences(q, k_cache, v_cache, meta, scale, out, first=b, window=window, softcap=softcap, sinks=sinks)
        return out
