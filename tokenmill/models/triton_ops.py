"""The model's element-wise steps as Triton kernels, for CUDA (TorchOps stays the reference).

On a GPU each torch element-wise op is a kernel of its own that reads and writes the whole
tensor: a layer of a Qwen3-shaped model ran about 20 of them (the residual add, rotary
embedding as slices, products and a concatenation, the per-head q/k norms and their copies,
SiLU and the product), at about 2 us each even at batch 1, replayed from a CUDA graph or not.
They took about half of the GPU time of a batch-1 decode step. Here each step is one kernel
with one pass over its data, computing in float32 and rounding once:

  add_rms_norm   residual += x (in place), out = rmsnorm(residual)          one program per token
  rotary_qkv     per-head q/k RMSNorm (Qwen3), then the rotation, in place   one per (token, head)
  silu_mul       silu(gate) * up                                             one per (token, tile)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.models.ops import TorchOps, split_qkv, whole_qk_norms


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, eps, n, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * n
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    s = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
    if HAS_RES:
        s = s + tl.load(res_ptr + row + cols, mask=mask, other=0.0)
        tl.store(res_ptr + row + cols, s, mask=mask)  # rounded to the stream's dtype, as torch's add
    s = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + cols, (s * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps, stride_t, num_heads,
                   D: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)                       # q heads first, then k heads; v is left alone
    base = qkv_ptr + t * stride_t + head * D
    i = tl.arange(0, HALF)
    mask = i < D // 2
    x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + D // 2 + i, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # RMSNorm over the head, rounded to the model's dtype before the rotation (as torch)
        w_ptr = qw_ptr if head < num_heads else kw_ptr
        inv = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        dtype = qkv_ptr.dtype.element_ty
        x1 = (x1 * inv * tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (x2 * inv * tl.load(w_ptr + D // 2 + i, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + t * (D // 2) + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * (D // 2) + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + i, (x1 * c - x2 * s).to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(base + D // 2 + i, (x2 * c + x1 * s).to(qkv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


class TritonFusedOps(TorchOps):
    name = "triton-fused"

    def add_rms_norm(self, x, residual, norm):
        """As TorchOps, but the residual stream is updated in place (it starts as the embeddings)."""
        x = x.contiguous()
        n = x.shape[-1]
        out = torch.empty_like(x)
        _add_rms_norm_kernel[(x.shape[0],)](x, residual if residual is not None else x, norm.weight, out, norm.eps,
                                            n, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n))
        return out, x if residual is None else residual

    def rotary_qkv(self, qkv, cos, sin, num_heads, num_kv_heads, head_dim, q_norm=None, k_norm=None):
        """In place on qkv's q and k heads (on a new qkv where the norms span all of q and of k);
        returns the three views."""
        qkv, q_norm, k_norm = whole_qk_norms(qkv, q_norm, k_norm, num_heads, num_kv_heads, head_dim)
        qk_norm = q_norm is not None
        _rotary_kernel[(qkv.shape[0], num_heads + num_kv_heads)](
            qkv, cos.contiguous(), sin.contiguous(), q_norm.weight if qk_norm else qkv,
            k_norm.weight if qk_norm else qkv, q_norm.eps if qk_norm else 0.0, qkv.stride(0), num_heads,
            D=head_dim, HALF=triton.next_power_of_2(head_dim // 2), QK_NORM=qk_norm)
        return split_qkv(qkv, num_heads, num_kv_heads, head_dim)

    def silu_mul(self, gate_up):
        t, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up.contiguous(), out, n, BLOCK=block)
        return out
