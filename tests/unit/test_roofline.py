"""The roofline's counts: FLOPs and bytes one token costs, dense and mixture-of-experts."""

from __future__ import annotations

from tokenmill.bench.roofline import linear_flops_per_token, weight_bytes
from tokenmill.config import ModelConfig, MoEConfig

SHAPE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
             head_dim=16)


def test_a_dense_token_costs_twice_its_projections_weights():
    cfg = ModelConfig(architecture="llama", **SHAPE)
    attention = 64 * (64 + 2 * 32) + 64 * 64           # q, k, v and o
    assert linear_flops_per_token(cfg) == 2 * 3 * (attention + 3 * 64 * 128)
    assert weight_bytes(cfg, 4) == (3 * (attention + 3 * 64 * 128) + 64 * 100) * 4


def test_a_routed_token_costs_its_router_top_k_experts_and_shared_expert_and_dense_layers_their_mlp():
    moe = MoEConfig(num_experts=8, top_k=2, expert_intermediate_size=32, norm_topk_prob=True,
                    shared_expert_intermediate_size=48, dense_layers=(0,))
    cfg = ModelConfig(architecture="qwen2_moe", moe=moe, **SHAPE)
    attention = 64 * (64 + 2 * 32) + 64 * 64
    dense = attention + 3 * 64 * 128
    sparse = attention + 64 * 8 + 3 * 64 * (2 * 32 + 48)  # router, two experts of 32, the shared one
    assert linear_flops_per_token(cfg) == 2 * (dense + 2 * sparse)
