"""The reference backend: one sequence at a time, gather its context, call SDPA.

Slow for many decodes (a Python loop per layer) but obviously right; the faster
backends are tested against it, and reuse `attend_sequence` for long prompt chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention import AttentionMetadata, write_kv


def context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Pool slots of a sequence's first `seq_len` tokens, in order. block_table: (max_blocks,)."""
    num_blocks = -(-seq_len // block_size)
    offsets = torch.arange(block_size, device=block_table.device)
    slots = block_table[:num_blocks].long().unsqueeze(1) * block_size + offsets  # (num_blocks, bs)
    return slots.flatten()[:seq_len]


def attend_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_len: int, block_size: int, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's n newest tokens over its whole context.

    q: (n, Hq, D), the queries at positions seq_len - n .. seq_len - 1. Returns (n, Hq, D).
    """
    n = q.shape[0]
    slots = context_slots(block_table, seq_len, block_size)
    k = k_cache[slots].transpose(0, 1)  # (Hkv, seq_len, D)
    v = v_cache[slots].transpose(0, 1)
    q = q.transpose(0, 1)               # (Hq, n, D)
    if n == seq_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at position seq_len - n + j and may see positions 0 .. seq_len - n + j.
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device).unsqueeze(1)
        mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos  # (n, seq_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)          # (n, Hq, D)


def attend_sequences(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, out: torch.Tensor, first: int = 0) -> None:
    """`attend_sequence` for sequences first.. of the batch, written into out (T, Hq, D)."""
    qsl = meta.query_start_loc_host
    for i in range(first, meta.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        out[start:end] = attend_sequence(q[start:end], k_cache, v_cache, meta.block_tables[i],
                                         meta.seq_lens_host[i], meta.block_size, scale)


class ReferenceAttention:
    name = "reference"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: (T, Hq, D); k, v: (T, Hkv, D). Returns (T, Hq, D)."""
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        attend_sequences(q, k_cache, v_cache, meta, scale, out)
        return out
