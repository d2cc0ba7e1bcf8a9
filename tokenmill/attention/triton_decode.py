"""CUDA backend: Triton kernels that read K/V in place from the paged pool (CUDA only).

Decodes: one program per (sequence, kv head) walks the block table, loads keys and values
straight from the pool (no gathered copy), 64 at a time from 4 blocks, and keeps an online
softmax for the G query heads sharing that kv head, padded to 16 rows for tl.dot. A batch
with fewer programs than the GPU has SMs splits each context in up to 16 parts, each part a
program, and a second kernel merges the parts by their log-sum-exp (flash-decoding).

Prompt chunks: one program per (sequence, tile of 64 query tokens, query head), a causal
flash-attention loop over the sequence's context in steps of 64 keys gathered through the
block table. One launch per layer for every chunk of the step, whatever their lengths: the
per-sequence SDPA it replaces cost a Python loop and, on an H100, a first call of each new
prompt length several times slower than the next (2-3 s per 16,384-token step in a fresh
process against 0.2 s once seen).

A layer's sliding window bounds both loops: they start at the first key in the window, so
blocks before it (given back to the pool) are never read. A soft-capped layer (Gemma 2) turns each
scaled score s into c * tanh(s / c) before the softmax; the cap is a compile-time switch, so an
uncapped model's kernels carry no tanh. A layer with attention sinks (gpt-oss) starts each query
row's online softmax at its head's sink logit (running max = sink, sum = 1, no value), so the
sink's share of the softmax is in the denominator and nowhere else; split decodes add it once,
when the merge kernel weighs the parts.

The torch reference (attention/reference.py) is what tests compare both with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention.metadata import AttentionMetadata, write_kv


# Triton compiles a kernel again for each new pattern of integer arguments equal to 1 or divisible
# by 16; those that vary from step to step are kept out of that, or the first steps of a fresh
# process each paid about a second of compiling.
@triton.jit(do_not_specialize=["stride_table"])
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, part_ptr, lse_ptr, sinks_ptr,
                         scale, window, softcap, stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_table,
                         stride_ot, stride_oh,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                         CAP: tl.constexpr, SINKS: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = tl.maximum(seq_len - window, 0)  # the first key in the window (keys before it are never read)
    # this program's share of the window, in whole steps of BLOCK_N keys (the last splits may get none)
    per_split = tl.cdiv(tl.cdiv(seq_len - first, SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = kv_head * G + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None],
                other=0.0)                                                    # (GP, D)
    if SINKS and SPLITS == 1:  # the sink as a key of its own with no value (split parts: at the merge)
        m = tl.load(sinks_ptr + heads, mask=g < G, other=0.0).to(tl.float32)
        denom = tl.full((GP,), 1.0, tl.float32)
    else:
        m = tl.full((GP,), float("-inf"), tl.float32)
        denom = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for start in range(lo, hi, BLOCK_N):  # BLOCK_N keys a step, from BLOCK_N / BS blocks
        n = start + tl.arange(0, BLOCK_N)
        valid = n < hi
        block = tl.load(tables_ptr + seq * stride_table + n // BS, mask=valid, other=0).to(tl.int64)
        offset = block * stride_kb + kv_head * stride_kh + (n % BS) * stride_kt   # (BLOCK_N,)
        k = tl.load(k_ptr + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)  # (BLOCK_N, D)
        v = tl.load(v_ptr + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale         # (GP, BLOCK_N)
        if CAP:
            s = _soft_cap(s, softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if SPLITS == 1:
        out = acc / denom[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])
    else:  # float32 partial result and its log-sum-exp, (B, Hq, SPLITS, D) and (B, Hq, SPLITS)
        seen = denom > 0
        out = acc / tl.where(seen, denom, 1.0)[:, None]
        lse = tl.where(seen, m + tl.log(tl.where(seen, denom, 1.0)), float("-inf"))
        row = (seq * G * tl.num_programs(1) + heads) * SPLITS + split
        tl.store(part_ptr + row[:, None] * D + d[None, :], out, mask=(g < G)[:, None])
        tl.store(lse_ptr + row, lse, mask=g < G)


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), tanh written as 2 sigmoid(2x) - 1."""
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


@triton.jit
def _merge_splits_kernel(part_ptr, lse_ptr, sinks_ptr, out_ptr, num_heads, stride_ot, stride_oh,
                         D: tl.constexpr, SPLITS: tl.constexpr, SINKS: tl.constexpr):
    """One program per (sequence, query head): weigh each split's result by its share of the softmax
    (a sink takes its share of the denominator)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    row = (seq * num_heads + head) * SPLITS
    lse = tl.load(lse_ptr + row + s)                     # split 0 always has keys, so the max is finite
    top = tl.max(lse, 0)
    if SINKS:
        top = tl.maximum(top, tl.load(sinks_ptr + head).to(tl.float32))
    w = tl.exp(lse - top)
    part = tl.load(part_ptr + (row + s)[:, None] * D + d[None, :])
    denom = tl.sum(w, 0)
    if SINKS:
        denom += tl.exp(tl.load(sinks_ptr + head).to(tl.float32) - top)
    out = tl.sum(part * w[:, None], 0) / denom
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Splits of each sequence's context so that a small batch still fills the GPU (flash-decoding):
    with one program per (sequence, kv head), batch 1 of an 8-kv-head model ran 8 programs on 132
    SMs, each walking the whole context alone. A power of two (the merge kernel's tile)."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    return min(max_splits, triton.next_power_of_2(-(-num_sms // programs)))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, block_n: int = 64, num_splits: int = 1,
                 out: torch.Tensor | None = None, window: int | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: (B, Hq, D), one query per sequence (its last position); caches (blocks, Hkv, bs, D).
    Writes into `out` (B, Hq, D) when given, a view of the step's output for a mixed step.
    With a window, each query reads only its last `window` keys; with a softcap, its scores are
    capped; with sinks (Hq,), each head's sink joins its softmax."""
    b, hq, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    if out is None:
        out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    part = lse = out  # unused with one split
    if num_splits > 1:
        part = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    sinks_arg = sinks if sinks is not None else lse  # an unused pointer without sinks
    _paged_decode_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part, lse, sinks_arg, scale, _window_arg(window),
        softcap or 1.0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), G=group, GP=max(16, triton.next_power_of_2(group)), D=d, BS=bs,
        BLOCK_N=max(block_n, bs), SPLITS=num_splits, PRECISION=_precision(q.dtype), CAP=softcap is not None,
        SINKS=sinks is not None)
    if num_splits > 1:
        _merge_splits_kernel[(b, hq)](part, lse, sinks_arg, out, hq, out.stride(0), out.stride(1), D=d,
                                      SPLITS=num_splits, SINKS=sinks is not None)
    return out


@triton.jit(do_not_specialize=["first_seq", "stride_table"])
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr, sinks_ptr, scale, window,
                          softcap, first_seq, stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_table,
                          stride_ot, stride_oh,
                          G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr,
                          SINKS: tl.constexpr):
    seq = first_seq + tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // G
    m_idx = tile * BLOCK_M + tl.arange(0, BLOCK_M)          # query tokens of this tile, within the chunk
    rows = m_idx < q_len
    q_pos = seq_len - q_len + m_idx                          # their positions in the sequence
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (q_start + m_idx)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=rows[:, None], other=0.0)                                # (BLOCK_M, D)
    if SINKS:  # the sink as a key of its own with no value
        m = tl.full((BLOCK_M,), 0.0, tl.float32) + tl.load(sinks_ptr + head).to(tl.float32)
        denom = tl.full((BLOCK_M,), 1.0, tl.float32)
    else:
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        denom = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    end = tl.minimum(seq_len - q_len + (tile + 1) * BLOCK_M, seq_len)  # keys the tile's last query sees
    # the first key the tile's first query sees: with BLOCK_M <= BLOCK_N, every row of the tile sees
    # some key of the first step
    lo = tl.maximum(seq_len - q_len + tile * BLOCK_M - window + 1, 0)
    for start in range(lo, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        keys = n < end
        block = tl.load(tables_ptr + seq * stride_table + n // BS, mask=keys, other=0).to(tl.int64)
        offset = block * stride_kb + kv_head * stride_kh + (n % BS) * stride_kt   # (BLOCK_N,)
        k = tl.load(k_ptr + offset[None, :] + d[:, None], mask=keys[None, :], other=0.0)   # (D, BLOCK_N)
        s = tl.dot(q, k, input_precision=PRECISION) * scale                    # (BLOCK_M, BLOCK_N)
        if CAP:
            s = _soft_cap(s, softcap)
        seen = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(keys[None, :] & seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))   # finite from the first step on (see lo)
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offset[:, None] + d[None, :], mask=keys[:, None], other=0.0)   # (BLOCK_N, D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + (q_start + m_idx)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rows[:, None])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor, first: int = 0, block_m: int = 64, block_n: int = 64,
                  window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Causal attention of sequences first.. of the step (prompt chunks) into out (T, Hq, D), each
    query over its last `window` keys when given, its scores capped at `softcap` when given, each
    head's sink (Hq,) in its softmax when given."""
    if block_m > block_n:
        raise ValueError(f"block_m ({block_m}) must not exceed block_n ({block_n})")
    qsl = meta.query_start_loc_host
    longest = max(qsl[i + 1] - qsl[i] for i in range(first, meta.num_seqs))
    hq, d = q.shape[1], q.shape[2]
    grid = (meta.num_seqs - first, triton.cdiv(longest, block_m), hq)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
        sinks if sinks is not None else out, scale, _window_arg(window), softcap or 1.0, first,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_tables.stride(0), out.stride(0), out.stride(1), G=hq // k_cache.shape[1], D=d,
        BS=k_cache.shape[2], BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q.dtype),
        CAP=softcap is not None, SINKS=sinks is not None)


def _window_arg(window: int | None) -> int:
    """The kernels' window: wider than any context for a global layer."""
    return window if window is not None else 1 << 30


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # float32 stays float32 (no tf32)


def supported(block_size: int, head_dim: int) -> bool:
    """tl.dot wants power-of-two tiles of at least 16."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (block_size, head_dim))


class TritonPagedAttention:
    name = "triton"
    short_query_max = 1
    graph_safe = True  # a plain decode step reads only the metadata's device tensors: capturable

    def __init__(self, num_sms: int | None = None) -> None:
        self.num_sms = num_sms  # read from the device at the first step unless given

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta)
        b = meta.num_short
        if self.num_sms is None:
            self.num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        # The split count depends on the batch size alone, so a captured graph keeps a valid one.
        splits = decode_splits(b, k_cache.shape[1], self.num_sms) if b else 1
        if b == meta.num_seqs:
            return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, num_splits=splits,
                                window=window, softcap=softcap, sinks=sinks)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if b:
            paged_decode(q[:b], k_cache, v_cache, meta.block_tables[:b], meta.seq_lens[:b], scale,
                         num_splits=splits, out=out[:b], window=window, softcap=softcap, sinks=sinks)
        paged_prefill(q, k_cache, v_cache, meta, scale, out, first=b, window=window, softcap=softcap, sinks=sinks)
        return out
