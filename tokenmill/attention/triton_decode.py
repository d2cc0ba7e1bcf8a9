"""CUDA backend: a Triton kernel for decode attention over the paged pool (CUDA only).

One program per (sequence, kv head): it walks the block table, loads each block's keys and
values straight from the pool (no gathered copy), and keeps an online softmax for the G
query heads sharing that kv head, padded to 16 rows for tl.dot. Prompt chunks go through
the reference path (SDPA per sequence). The torch reference beside it
(attention/reference.py) is what tests compare it with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention import AttentionMetadata, write_kv
from tokenmill.attention.reference import attend_sequences


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, scale,
                         stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_table, stride_ot, stride_oh,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    t = tl.arange(0, BS)
    heads = kv_head * G + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None],
                other=0.0)                                                    # (GP, D)
    m = tl.full((GP,), float("-inf"), tl.float32)
    denom = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for i in range(0, tl.cdiv(seq_len, BS)):
        block = tl.load(tables_ptr + seq * stride_table + i).to(tl.int64)
        base = block * stride_kb + kv_head * stride_kh
        valid = i * BS + t < seq_len
        k = tl.load(k_ptr + base + t[:, None] * stride_kt + d[None, :], mask=valid[:, None], other=0.0)  # (BS, D)
        v = tl.load(v_ptr + base + t[:, None] * stride_kt + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale         # (GP, BS)
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
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (B, Hq, D), one query per sequence (its last position); caches (blocks, Hkv, bs, D)."""
    b, hq, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    _paged_decode_kernel[(b, hkv)](
        q, k_cache, v_cache, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), G=group, GP=max(16, triton.next_power_of_2(group)), D=d, BS=bs,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")  # float32 stays float32 (no tf32)
    return out


def supported(block_size: int, head_dim: int) -> bool:
    """tl.dot wants power-of-two tiles of at least 16."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (block_size, head_dim))


class TritonPagedAttention:
    name = "triton"
    short_query_max = 1

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta)
        b = meta.num_short
        if b == meta.num_seqs:
            return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if b:
            out[:b] = paged_decode(q[:b], k_cache, v_cache, meta.block_tables[:b], meta.seq_lens[:b], scale)
        attend_sequences(q, k_cache, v_cache, meta, scale, out, first=b)
        return out
