"""Decodes batched in plain torch: gather every decoding sequence's context into a padded
(B, L, Hkv, D) tensor and run one masked SDPA. The gather copies the context, which costs
memory bandwidth: cheap on a GPU, expensive on a CPU (where the C++ kernel reads the pool
in place). Prompt chunks go one by one through the reference path. A layer with a sliding
window gathers only the blocks its window spans (`windowed_decode`); one with soft-capped scores
(Gemma 2) has them capped, and one with attention sinks (gpt-oss) has them in its softmax, in both
paths (reference.attention).

The padding reads slots past each sequence's end; they are masked out, but a NaN there
would still poison the product with V, so this backend asks for a zero-initialised pool
(`reads_padding`): afterwards every slot holds zeros or some earlier, finite K/V.
"""

from __future__ import annotations

import torch

from tokenmill.attention.metadata import AttentionMetadata, write_kv
from tokenmill.attention.reference import attend_sequences, attention


class TorchBatchedAttention:
    name = "torch"
    short_query_max = 1    # only single-token queries are batched
    reads_padding = True   # the runner zero-fills the pool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        b = meta.num_short
        if b:
            decode = batched_decode if window is None else windowed_decode
            out[:b] = decode(q[:b], k_cache, v_cache, meta, scale, window, softcap, sinks)
        attend_sequences(q, k_cache, v_cache, meta, scale, out, first=b, window=window, softcap=softcap, sinks=sinks)
        return out


def batched_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, window: None = None, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence (its last position) over the whole context, for the first B =
    q.shape[0] sequences. q: (B, Hq, D); returns (B, Hq, D)."""
    b, bs = q.shape[0], meta.block_size
    num_blocks = -(-max(meta.seq_lens_host[:b]) // bs)
    tables = meta.block_tables[:b, :num_blocks].long()
    shape = (b, k_cache.shape[1], num_blocks * bs, k_cache.shape[3])
    # (B, Hkv, L, D), widened to the queries' dtype where the pool is narrower
    keys = k_cache[tables].transpose(1, 2).reshape(shape).to(q.dtype)
    values = v_cache[tables].transpose(1, 2).reshape(shape).to(q.dtype)
    mask = torch.arange(num_blocks * bs, device=q.device) < meta.seq_lens[:b].unsqueeze(1)  # (B, L)
    attn = attention(q.unsqueeze(2), keys, values, mask[:, None, None, :], scale, softcap, sinks)  # (B, Hq, 1, D)
    return attn.squeeze(2)


def windowed_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over the last `window` positions of its context (itself included).
    Each sequence's gather starts at the block holding its first position in the window, so the
    blocks read are as many as the window spans, whatever the context's length:

        block table   [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ]      seq_len 19, window 8, bs 4
        positions      ....  ..11 1111 111.           keys 11..18: blocks 2..4 gathered

    Entries past the table's end, or before the window, may name a block another sequence owns
    now or a scratch block: their keys and values are zeroed before the product so that no
    stale value (even a NaN) reaches the result. q: (B, Hq, D); returns (B, Hq, D)."""
    b, bs = q.shape[0], meta.block_size
    seq_lens = meta.seq_lens[:b].long()
    first = (seq_lens - window).clamp(min=0) // bs                              # (B,) first block read
    span = (window - 1) // bs + 2                                               # blocks a window can touch
    width = meta.block_tables.shape[1]
    cols = (first.unsqueeze(1) + torch.arange(span, device=q.device)).clamp(max=width - 1)  # (B, span)
    tables = meta.block_tables[:b].long().gather(1, cols)
    positions = (first * bs).unsqueeze(1) + torch.arange(span * bs, device=q.device)      # (B, L)
    mask = (positions < seq_lens.unsqueeze(1)) & (positions >= seq_lens.unsqueeze(1) - window)
    shape = (b, k_cache.shape[1], span * bs, k_cache.shape[3])
    keep = mask[:, None, :, None]
    keys = k_cache[tables].transpose(1, 2).reshape(shape).to(q.dtype).masked_fill(~keep, 0)  # (B, Hkv, L, D)
    values = v_cache[tables].transpose(1, 2).reshape(shape).to(q.dtype).masked_fill(~keep, 0)
    attn = attention(q.unsqueeze(2), keys, values, mask[:, None, None, :], scale, softcap, sinks)  # (B, Hq, 1, D)
    return attn.squeeze(2)
