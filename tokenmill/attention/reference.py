"""The reference backend: one sequence at a time, gather its context, call SDPA.

Slow for many decodes (a Python loop per layer) but obviously right; the faster
backends are tested against it, and the cpu and torch ones reuse `attend_sequence` for
long prompt chunks.

A layer may soft-cap its scores (Gemma 2: s becomes c * tanh(s / c) before the mask and the
softmax), and may have attention sinks (gpt-oss: a learned logit per query head that joins each
softmax as one more score, its probability dropped afterwards, so the weights of the keys sum to
less than 1). SDPA has neither, so such a layer computes its scores, softmax (in float32, as
transformers does) and product with V in plain torch (`attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata, write_kv


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A sequence's first `seq_len` keys (or values) in order: (Hkv, seq_len, D).

    cache: (num_blocks, Hkv, bs, D); block_table: (max_blocks,)."""
    bs = cache.shape[2]
    num_blocks = -(-seq_len // bs)
    blocks = cache[block_table[:num_blocks].long()]                        # (n, Hkv, bs, D)
    return blocks.transpose(0, 1).reshape(cache.shape[1], num_blocks * bs, -1)[:, :seq_len]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Masked attention: q (B, Hq, n, D) over k, v (B, Hkv, L, D), Hq a multiple of Hkv; mask (True:
    seen) broadcast to (B, Hq, n, L), None for causal with n == L. Returns (B, Hq, n, D). Without a
    cap or sinks, SDPA; with a cap, the scores are capped before the mask and the softmax; with
    sinks (Hq,), each head's sink is one more score in its softmax, whose probability is dropped."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # (B, Hq, L, D)
    scores = q @ k.transpose(2, 3) * scale                                         # (B, Hq, n, L)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float().masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(q.dtype) @ v
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)            # (B, Hq, n, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]     # the sink's share dropped
    return probs.to(q.dtype) @ v


def attend_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_len: int, scale: float, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's n newest tokens over its context.
    q: (n, Hq, D), the queries at positions seq_len - n .. seq_len - 1. Returns (n, Hq, D).
    With a window, the query at position p sees only p - window + 1 .. p, and the context is
    read from the block holding the first of those for the first query: the blocks before it
    may have been given back to the pool. `softcap`: the scores' cap, `sinks`: the heads' sink logits
    (`attention`), None for none.
    """
    n = q.shape[0]
    first_block = 0 if window is None else max(0, seq_len - n - window + 1) // k_cache.shape[2]
    start = first_block * k_cache.shape[2]
    # 4-d (batch of one) inputs: torch's CPU SDPA takes its blocked flash kernel only for those.
    # (1, Hkv, seq_len - start, D), widened to the queries' dtype where the pool is narrower
    k = gather_context(k_cache, block_table[first_block:], seq_len - start).unsqueeze(0).to(q.dtype)
    v = gather_context(v_cache, block_table[first_block:], seq_len - start).unsqueeze(0).to(q.dtype)
    q = q.transpose(0, 1).unsqueeze(0)                                # (1, Hq, n, D)
    if n == seq_len and window is None:
        out = attention(q, k, v, None, scale, softcap, sinks)
    else:
        # Query j sits at position seq_len - n + j and may see positions 0 .. seq_len - n + j
        # (the last `window` of them).
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(start, seq_len, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos                                         # (n, seq_len - start)
        if window is not None:
            mask &= k_pos > q_pos - window
        out = attention(q, k, v, mask, scale, softcap, sinks)
    return out[0].transpose(0, 1)                                     # (n, Hq, D)


def attend_sequences(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, out: torch.Tensor, first: int = 0, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """`attend_sequence` for sequences first.. of the batch, written into out (T, Hq, D)."""
    qsl = meta.query_start_loc_host
    for i in range(first, meta.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        out[start:end] = attend_sequence(q[start:end], k_cache, v_cache, meta.block_tables[i],
                                         meta.seq_lens_host[i], scale, window, softcap, sinks)


class ReferenceAttention:
    name = "reference"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: (T, Hq, D); k, v: (T, Hkv, D); window: the layer's sliding window (None: global);
        softcap: the cap on its scores (None: none); sinks: its heads' sink logits, (Hq,) (None: none).
        Returns (T, Hq, D)."""
        write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        attend_sequences(q, k_cache, v_cache, meta, scale, out, window=window, softcap=softcap, sinks=sinks)
        return out
