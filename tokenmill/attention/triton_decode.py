"""CUDA backend: Triton kernels that read K/V in place from the paged pool (CUDA only).

Decodes: one program per (sequence, kv head) walks the block table, loads keys and values
straight from the pool (no gathered copy), 64 at a time from 4 blocks, and keeps an online
softmax for the G query heads sharing that kv head, padded to 16 rows for tl.dot.

Prompt chunks: one program per (sequence, tile of 64 query tokens, query head), a causal
flash-attention loop over the sequence's context in steps of 64 keys gathered through the
block table. One launch per layer for every chunk of the step, whatever their lengths: the
per-sequence SDPA it replaces cost a Python loop and, on an H100, a first call of each new
prompt length several times slower than the next (2-3 s per 16,384-token step in a fresh
process against 0.2 s once seen).

The torch reference (attention/reference.py) is what tests compare both with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention import AttentionMetadata, write_kv


# Triton compiles a kernel again for each new pattern of integer arguments equal to 1 or divisible
# by 16; those that vary from step to step are kept out of that, or the first steps of a fresh
# process each paid about a second of compiling.
@triton.jit(do_not_specialize=["stride_table"])
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, scale,
                         stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_table, stride_ot, stride_oh,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = kv_head * G + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None],
                other=0.0)                                                    # (GP, D)
    m = tl.full((GP,), float("-inf"), tl.float32)
    denom = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for start in range(0, seq_len, BLOCK_N):  # BLOCK_N keys a step, from BLOCK_N / BS blocks
        n = start + tl.arange(0, BLOCK_N)
        valid = n < seq_len
        block = tl.load(tables_ptr + seq * stride_table + n // BS, mask=valid, other=0).to(tl.int64)
        offset = block * stride_kb + kv_head * stride_kh + (n % BS) * stride_kt   # (BLOCK_N,)
        k = tl.load(k_ptr + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)  # (BLOCK_N, D)
        v = tl.load(v_ptr + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale         # (GP, BLOCK_N)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g < G)[:, None])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, block_n: int = 64) -> torch.Tensor:
    """q: (B, Hq, D), one query per sequence (its last position); caches (blocks, Hkv, bs, D)."""
    b, hq, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    _paged_decode_kernel[(b, hkv)](
        q, k_cache, v_cache, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), G=group, GP=max(16, triton.next_power_of_2(group)), D=d, BS=bs,
        BLOCK_N=max(block_n, bs), PRECISION=_precision(q.dtype))
    return out


@triton.jit(do_not_specialize=["first_seq", "stride_table"])
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr, scale, first_seq,
                          stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_table, stride_ot, stride_oh,
                          G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
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
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    end = tl.minimum(seq_len - q_len + (tile + 1) * BLOCK_M, seq_len)  # keys the tile's last query sees
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        keys = n < end
        block = tl.load(tables_ptr + seq * stride_table + n // BS, mask=keys, other=0).to(tl.int64)
        offset = block * stride_kb + kv_head * stride_kh + (n % BS) * stride_kt   # (BLOCK_N,)
        k = tl.load(k_ptr + offset[None, :] + d[:, None], mask=keys[None, :], other=0.0)   # (D, BLOCK_N)
        s = tl.dot(q, k, input_precision=PRECISION) * scale                    # (BLOCK_M, BLOCK_N)
        s = tl.where(keys[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))   # finite from the first step on: key 0 is seen by every row
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
                  scale: float, out: torch.Tensor, first: int = 0, block_m: int = 64, block_n: int = 64) -> None:
    """Causal attention of sequences first.. of the step (prompt chunks) into out (T, Hq, D)."""
    qsl = meta.query_start_loc_host
    longest = max(qsl[i + 1] - qsl[i] for i in range(first, meta.num_seqs))
    hq, d = q.shape[1], q.shape[2]
    grid = (meta.num_seqs - first, triton.cdiv(longest, block_m), hq)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, scale, first,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_tables.stride(0), out.stride(0), out.stride(1), G=hq // k_cache.shape[1], D=d,
        BS=k_cache.shape[2], BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q.dtype))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # float32 stays float32 (no tf32)


def supported(block_size: int, head_dim: int) -> bool:
    """tl.dot wants power-of-two tiles of at least 16."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (block_size, head_dim))


class TritonPagedAttention:
    name = "triton"
    short_query_max = 1
    graph_safe = True  # a plain decode step reads only the metadata's device tensors: capturable

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta)
        b = meta.num_short
        if b == meta.num_seqs:
            return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if b:
            out[:b] = paged_decode(q[:b], k_cache, v_cache, meta.block_tables[:b], meta.seq_lens[:b], scale)
        paged_prefill(q, k_cache, v_cache, meta, scale, out, first=b)
        return out
