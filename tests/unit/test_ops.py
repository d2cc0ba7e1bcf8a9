"""The fast paths against their torch references: fused C++ element-wise ops, oneDNN-packed
projections, and the Triton element-wise kernels (CUDA, or the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_triton

from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.models.llama import RMSNorm
from tokenmill.models.ops import CpuFusedOps, TorchOps
from tokenmill.models.packed_linear import PackedLinear, onednn_available


@pytest.fixture(scope="module")
def fused():
    return CpuFusedOps(load_cpu_kernels(required=True))


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_rms_norm(fused, rows):
    norm = RMSNorm(40, 1e-6)
    norm.weight.data = torch.randn(40)
    x, res = torch.randn(rows, 40), torch.randn(rows, 40)
    ref_out, ref_res = TorchOps().add_rms_norm(x, res.clone(), norm)
    out, new_res = fused.add_rms_norm(x, res, norm)       # updates res in place
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(new_res, ref_res) and new_res is res
    first, stream = fused.add_rms_norm(x, None, norm)     # first layer: no residual yet
    assert stream is x and torch.allclose(first, TorchOps().add_rms_norm(x, None, norm)[0], atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 16), (9, 3, 64), (4, 4, 24)])
def test_rotary_qkv(fused, heads, kv_heads, dim):
    t = 11
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(t, dim // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    ref = TorchOps().rotary_qkv(qkv.clone(), cos, sin, heads, kv_heads, dim)
    out = fused.rotary_qkv(qkv, cos, sin, heads, kv_heads, dim)
    for a, b in zip(out, ref):
        assert torch.allclose(a, b, atol=1e-6)


def test_silu_mul(fused):
    gate_up = torch.randn(33, 2 * 100) * 5
    assert torch.allclose(fused.silu_mul(gate_up), TorchOps().silu_mul(gate_up), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32), reason="torch without oneDNN")
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    w, b = torch.randn(96, 48), torch.randn(96)
    x = torch.randn(rows, 48)
    assert torch.allclose(PackedLinear(w, b)(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 48])
@pytest.mark.parametrize("n", [37, 48])  # 37: a partly filled last panel
def test_panel_kernel_matches_f_linear(fused, rows, n):
    w, b, x = torch.randn(n, 50), torch.randn(n), torch.randn(rows, 50)
    panels = fused.kernels.pack_panels(w)
    assert panels.shape == (-(-n // 16), 50, 16)
    assert torch.allclose(fused.kernels.panel_linear(x, panels, b, n), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert torch.allclose(fused.kernels.panel_linear(x, panels, None, n), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_packed_linear_with_panels_matches_for_every_row_count(fused):
    w = torch.randn(96, 48)
    layer = PackedLinear(w, None, fused.kernels)
    assert layer.packed is None and layer.panels is not None
    for rows in (1, 8, 64, 300, 1100):  # 1100: three blocks of rows
        x = torch.randn(rows, 48)
        assert torch.allclose(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-4)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def triton_ops():
    from tokenmill.models.triton_ops import TritonFusedOps
    return TritonFusedOps()


def _norm(dim: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6).to(DEVICE)
    norm.weight.data = torch.randn(dim, device=DEVICE)
    return norm


@needs_triton
@pytest.mark.parametrize("rows, dim", [(1, 40), (7, 576), (33, 96)])
def test_triton_add_rms_norm(triton_ops, rows, dim):
    norm = _norm(dim)
    x, res = torch.randn(rows, dim, device=DEVICE), torch.randn(rows, dim, device=DEVICE)
    ref_out, ref_res = TorchOps().add_rms_norm(x, res.clone(), norm)
    out, new_res = triton_ops.add_rms_norm(x, res, norm)    # updates res in place
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(new_res, ref_res) and new_res is res
    first, stream = triton_ops.add_rms_norm(x, None, norm)  # first layer: the stream is x itself
    assert stream is x and torch.allclose(first, TorchOps().add_rms_norm(x, None, norm)[0], atol=1e-5)


@needs_triton
@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 16), (9, 3, 64), (4, 4, 24), (16, 8, 128)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_triton_rotary_qkv(triton_ops, heads, kv_heads, dim, qk_norm):
    """Rotation in place, with Qwen3's per-head norms first; v untouched. dim 24: a half of 12
    that the kernel pads to 16."""
    t = 11
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device=DEVICE)
    angles = torch.rand(t, dim // 2, device=DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    norms = (_norm(dim), _norm(dim)) if qk_norm else (None, None)
    ref = TorchOps().rotary_qkv(qkv.clone(), cos, sin, heads, kv_heads, dim, *norms)
    out = triton_ops.rotary_qkv(qkv, cos, sin, heads, kv_heads, dim, *norms)
    for a, b in zip(out, ref):
        assert torch.allclose(a, b, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("n", [100, 3000])  # 3000: three tiles, the last one partial
def test_triton_silu_mul(triton_ops, n):
    gate_up = torch.randn(5, 2 * n, device=DEVICE) * 5
    assert torch.allclose(triton_ops.silu_mul(gate_up), TorchOps().silu_mul(gate_up), rtol=1e-5, atol=1e-5)
