"""The model's element-wise steps, in two interchangeable implementations.

TorchOps is the readable reference; CpuFusedOps runs the same math as single-pass C++
kernels (csrc/fused_cpu.cpp) that skip the temporaries, which on a CPU cost more than the
arithmetic, and TritonFusedOps (triton_ops.py) as one Triton kernel per step on CUDA. Tests
check that they give the same results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos, sin: (T, D/2) in x's dtype. Rotates the pairs (x[i], x[i + D/2])."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views (T, Hq, D), (T, Hkv, D), (T, Hkv, D) into the fused projection's rows."""
    heads = qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, head_dim)  # one view, three narrows: cheap
    return (heads.narrow(1, 0, num_heads), heads.narrow(1, num_heads, num_kv_heads),
            heads.narrow(1, num_heads + num_kv_heads, num_kv_heads))


def whole_qk_norms(qkv: torch.Tensor, q_norm, k_norm, num_heads: int, num_kv_heads: int, head_dim: int):
    """(qkv, q_norm, k_norm) for a rotation that norms each head: where the norms span all of q
    and all of k (OLMoE's, weights num_heads * head_dim and num_kv_heads * head_dim long), a new
    qkv with them applied and no norms left; else the arguments as they are."""
    if q_norm is None or q_norm.weight.numel() == head_dim:
        return qkv, q_norm, k_norm
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return torch.cat([q_norm(q), k_norm(k), v], dim=1), None, None


class TorchOps:
    name = "torch"

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the first layer passes residual=None."""
        residual = x if residual is None else residual + x
        return F.rms_norm(residual, norm.weight.shape, norm.weight, norm.eps), residual

    def rotary_qkv(self, qkv, cos, sin, num_heads, num_kv_heads, head_dim, q_norm=None, k_norm=None):
        """Rotate q and k; first, with q_norm and k_norm, an RMSNorm on every q and k head (Qwen3)
        or over all of q and all of k (OLMoE)."""
        qkv, q_norm, k_norm = whole_qk_norms(qkv, q_norm, k_norm, num_heads, num_kv_heads, head_dim)
        q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): GELU's tanh approximation of the gate, times up. Torch's in every
        implementation (no fused kernel)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class CpuFusedOps(TorchOps):
    name = "cpu-fused"

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def add_rms_norm(self, x, residual, norm):
        if residual is None:  # the residual stream starts as the embeddings, updated in place after
            return self.kernels.add_rms_norm(x, None, norm.weight, norm.eps), x
        return self.kernels.add_rms_norm(x, residual, norm.weight, norm.eps), residual

    def rotary_qkv(self, qkv, cos, sin, num_heads, num_kv_heads, head_dim, q_norm=None, k_norm=None):
        norms = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)  # either kind, in the kernel
        self.kernels.rotary_qkv_(qkv, cos, sin, num_heads, num_kv_heads, head_dim, *norms)
        return split_qkv(qkv, num_heads, num_kv_heads, head_dim)

    def silu_mul(self, gate_up):
        return self.kernels.silu_mul(gate_up)
