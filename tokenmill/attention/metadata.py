"""What every attention backend is handed: the step's metadata, and the write of new K/V into the
pool. A leaf module, so the backends import it without importing the package that picks them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once by the runner and passed to every layer."""

    slot_block: torch.Tensor         # (T,) int64: block each new token's K/V goes to
    slot_offset: torch.Tensor        # (T,) int64: its offset inside that block
    query_start_loc: torch.Tensor    # (B + 1,) int32: sequence i's tokens are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor           # (B,) int32: context length after this step (cached + new)
    block_tables: torch.Tensor       # (B, max_blocks) int32: block ids, padded with 0
    query_start_loc_host: list[int]  # the same offsets on the host, for per-sequence loops
    seq_lens_host: list[int]
    block_size: int
    num_short: int = 0               # leading sequences with few query tokens (decodes)
    num_short_tokens: int = 0        # their tokens, which come first in the flat batch

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store this step's keys and values. k, v: (T, Hkv, D); caches: (num_blocks, Hkv, bs, D)."""
    if k_cache.dtype == torch.float16 and k.dtype != torch.float16:  # saturate, as the C++ kernel does
        k, v = k.clamp(-65504, 65504), v.clamp(-65504, 65504)
    k_cache[meta.slot_block, :, meta.slot_offset] = k.to(k_cache.dtype)
    v_cache[meta.slot_block, :, meta.slot_offset] = v.to(v_cache.dtype)
