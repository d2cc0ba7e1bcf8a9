"""A layer's routed experts in one C++ call (csrc/moe_cpu.cpp, built by cpu_packing.fuse_experts)
against the per-expert path it replaces (SparseMoeBlock._routed_experts with the same kernels'
products and silu_mul): equal bit for bit, with experts in GGUF blocks or float32 panels."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import random_k_quant_rows

from tokenmill.config import MoEConfig
from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.models.cpu_packing import fuse_experts
from tokenmill.models.llama import MLP
from tokenmill.models.moe import SparseMoeBlock, route
from tokenmill.models.ops import CpuFusedOps
from tokenmill.models.packed_linear import ConcatLinear, PackedLinear

HIDDEN, WIDTH, EXPERTS = 256, 256, 8  # multiples of 256: the K-quants' super-blocks


@pytest.fixture(scope="module")
def kernels():
    kernels = load_cpu_kernels(required=True)
    if not kernels.block_formats:
        pytest.skip("block formats need AVX2")
    return kernels


def packed(kernels, kind: str, out_features: int, in_features: int, rng) -> PackedLinear:
    """A projection packed as the loader packs a GGUF matrix of `kind` (or float32 panels: "F32")."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from tokenmill.models.gguf_loader import k_quant_rows
    if kind in ("F32", "BF16"):
        if kind == "BF16" and not kernels.bf16:
            pytest.skip("bfloat16 panels need AVX512-BF16")
        return PackedLinear(torch.from_numpy(rng.standard_normal((out_features, in_features), np.float32)) * 0.1,
                            None, kernels, bf16=kind == "BF16")
    if kind.endswith("_K"):
        rows = k_quant_rows(random_k_quant_rows(rng, kind, out_features, in_features), kind)
    else:
        rows = quantize(rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.1,
                        GGMLQuantizationType[kind])
    return PackedLinear(None, None, kernels, (kind, torch.from_numpy(rows.copy())), (out_features, in_features))


def make_block(kernels, gate_up_kind: str, down_kind: str, top_k: int = 2) -> SparseMoeBlock:
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    experts = []
    for _ in range(EXPERTS):
        mlp = MLP(HIDDEN, WIDTH)
        mlp.gate_up_proj = packed(kernels, gate_up_kind, 2 * WIDTH, HIDDEN, rng)
        mlp.down_proj = packed(kernels, down_kind, HIDDEN, WIDTH, rng)
        experts.append(mlp)
    block = SparseMoeBlock(MoEConfig(EXPERTS, top_k, WIDTH, True), HIDDEN, experts)
    fuse_experts(SimpleNamespace(layers=[SimpleNamespace(mlp=block)]), kernels)
    return block


def per_expert(block: SparseMoeBlock, kernels, x, weights, experts) -> torch.Tensor:
    return block._routed_experts(x, weights, experts, CpuFusedOps(kernels))


@pytest.mark.parametrize("renormalise", [True, False])
def test_the_kernels_route_chooses_torchs_experts_with_its_weights_to_rounding(kernels, renormalise):
    torch.manual_seed(3)
    logits = torch.randn(37, 128) * 4
    weights, experts = kernels.MoeExperts.route(logits, 8, renormalise)
    want_weights, want_experts = route(logits, 8, renormalise)
    assert torch.equal(experts, want_experts)
    assert torch.allclose(weights, want_weights, rtol=1e-6, atol=1e-7)


def test_the_kernels_route_breaks_ties_to_the_lower_expert_and_refuses_k_past_the_experts(kernels):
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, -3.0]])
    weights, experts = kernels.MoeExperts.route(logits, 4, True)
    assert experts.tolist() == [[1, 3, 2, 4]]
    assert weights[0, 0] == weights[0, 1] and weights[0, 2] == weights[0, 3]
    assert abs(weights.sum().item() - 1.0) < 1e-6
    with pytest.raises(RuntimeError, match="k must be 1 to the number of experts"):
        kernels.MoeExperts.route(logits, 7, True)


# Q4_K_M's mix (gate_up Q4_K, down Q6_K), the 32-weight block types, float32 and bfloat16 panels
KINDS = [("Q4_K", "Q6_K"), ("Q8_0", "Q4_0"), ("Q4_1", "Q5_K"), ("F32", "F32"), ("BF16", "BF16")]


@pytest.mark.parametrize("gate_up_kind, down_kind", KINDS)
def test_one_token_through_the_fused_experts_equals_the_per_expert_path(kernels, gate_up_kind, down_kind):
    block = make_block(kernels, gate_up_kind, down_kind, top_k=3)
    assert block.fused_experts is not None
    x = torch.randn(1, HIDDEN)
    with torch.no_grad():
        weights, experts = block.fused_experts.route(block.gate(x), 3, True)
        fused = block.forward(x, CpuFusedOps(kernels))
        want = per_expert(block, kernels, x, weights, experts)
    assert torch.equal(fused, want)


@pytest.mark.parametrize("gate_up_kind, down_kind", KINDS)
@pytest.mark.parametrize("int8_rows", [0, 4, 8])
def test_a_batch_with_busy_and_idle_experts_equals_the_per_expert_path(kernels, gate_up_kind, down_kind, int8_rows):
    """Experts 0 and 3 get four rows each, 1 and 5 two, the rest none; with int8_rows 4 the
    experts' products take x in 8-bit blocks in both paths (steps of up to 4 rows), each expert's
    rows made for it; with 8 the six tokens' blocks are made once and shared by their experts."""
    block = make_block(kernels, gate_up_kind, down_kind)
    for m in block.modules():
        if isinstance(m, PackedLinear):
            m.int8_rows = int8_rows
    block.fused_experts.int8_rows = int8_rows
    experts = torch.tensor([[0, 3], [3, 5], [0, 3], [5, 0], [3, 1], [1, 0]])
    weights = torch.rand(6, 2)
    x = torch.randn(6, HIDDEN)
    with torch.no_grad():
        assert torch.equal(block.fused_experts.forward(x, experts, weights),
                           per_expert(block, kernels, x, weights, experts))


def test_experts_with_more_rows_than_decode_in_registers_equal_the_per_expert_path(kernels):
    """40 tokens, top-4 of 8: about 20 rows an expert, where a product decodes each panel once
    into a buffer instead of once per tile."""
    block = make_block(kernels, "Q4_K", "Q6_K", top_k=4)
    x = torch.randn(40, HIDDEN)
    with torch.no_grad():
        weights, experts = block.fused_experts.route(block.gate(x), 4, True)
        assert torch.bincount(experts.flatten()).max() > 12
        assert torch.equal(block.forward(x, CpuFusedOps(kernels)), per_expert(block, kernels, x, weights, experts))


def test_experts_with_gate_and_up_in_different_block_types_keep_the_per_expert_path(kernels):
    block = make_block(kernels, "Q8_0", "Q8_0")
    rng = np.random.default_rng(1)
    block.experts[2].gate_up_proj = ConcatLinear([packed(kernels, "Q8_0", WIDTH, HIDDEN, rng),
                                                  packed(kernels, "Q4_0", WIDTH, HIDDEN, rng)])
    block.fused_experts = None
    fuse_experts(SimpleNamespace(layers=[SimpleNamespace(mlp=block)]), kernels)
    assert block.fused_experts is None


def test_an_expert_id_out_of_range_is_an_error_naming_it(kernels):
    block = make_block(kernels, "Q8_0", "Q8_0")
    with pytest.raises(RuntimeError, match="expert id 8 out of range"):
        block.fused_experts.forward(torch.randn(1, HIDDEN), torch.tensor([[1, 8]]), torch.rand(1, 2))
    with pytest.raises(RuntimeError, match="weights must be float32"):
        block.fused_experts.forward(torch.randn(1, HIDDEN), torch.tensor([[1, 2]]), torch.rand(1, 2).double())
