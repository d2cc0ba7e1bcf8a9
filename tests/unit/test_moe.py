"""The mixture-of-experts block alone: routing as the models define it, and the grouped
computation (tokens sorted by expert, one product per active expert, index_add back) against a
naive loop over tokens and their chosen experts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.config import MoEConfig
from tokenmill.models.llama import MLP
from tokenmill.models.moe import (
    AbsentExpert,
    ClampedSwiGLU,
    SparseMoeBlock,
    checkpoint_name,
    group_experts,
    grouped_mm_runs,
    route,
)
from tokenmill.models.ops import TorchOps

HIDDEN, WIDTH, SHARED = 64, 32, 48


def make_block(num_experts: int, top_k: int, renormalise: bool, shared: bool, seed: int = 0) -> SparseMoeBlock:
    torch.manual_seed(seed)
    cfg = MoEConfig(num_experts, top_k, WIDTH, renormalise, shared_expert_intermediate_size=SHARED if shared else 0)
    block = SparseMoeBlock(cfg, HIDDEN, [MLP(HIDDEN, WIDTH) for _ in range(num_experts)],
                           MLP(HIDDEN, SHARED) if shared else None)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def naive(block: SparseMoeBlock, x: torch.Tensor, renormalise: bool) -> torch.Tensor:
    """Token by token: softmax over the experts, the top k, each chosen expert on the token alone."""
    ops, out = TorchOps(), torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate(x[t]), dim=-1)
        top = probs.topk(block.top_k)
        weights = top.values / top.values.sum() if renormalise else top.values
        for w, e in zip(weights.tolist(), top.indices.tolist()):
            out[t] += w * block.experts[e].forward(x[t:t + 1], ops)[0]
        if block.shared_expert is not None:
            out[t] += torch.sigmoid(block.shared_expert_gate(x[t])) * block.shared_expert.forward(x[t:t + 1], ops)[0]
    return out


@pytest.mark.parametrize("num_experts, top_k, renormalise, shared, tokens", [
    (8, 2, True, False, 37), (4, 2, False, True, 9), (8, 1, False, False, 1), (6, 3, True, True, 64)])
def test_grouped_experts_equal_a_loop_over_tokens(num_experts, top_k, renormalise, shared, tokens):
    block = make_block(num_experts, top_k, renormalise, shared)
    x = torch.randn(tokens, HIDDEN)
    with torch.no_grad():
        got, want = block.forward(x, TorchOps()), naive(block, x, renormalise)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_expert_no_token_chose_is_never_run():
    block = make_block(8, 2, True, False)
    ran = []
    for index, expert in enumerate(block.experts):
        expert.forward = (lambda f, i: lambda x, ops: ran.append((i, x.shape[0])) or f(x, ops))(expert.forward, index)
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        _, chosen = route(block.gate(x), 2, True)
        block.forward(x, TorchOps())
    counts = torch.bincount(chosen.flatten(), minlength=8).tolist()
    assert ran == [(e, n) for e, n in enumerate(counts) if n]  # once each, over all its rows, in order


def test_route_renormalises_only_when_asked():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, experts = route(logits, 2, False)
    assert experts.tolist() == [[3, 2]] and weights.dtype == torch.float32
    torch.testing.assert_close(weights, probs[:, [3, 2]])
    weights, _ = route(logits.to(torch.bfloat16), 2, True)
    assert weights.dtype == torch.float32  # softmax and renormalisation in float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))


def test_mixtrals_checkpoint_names_become_qwens():
    assert checkpoint_name("layers.0.block_sparse_moe.experts.3.w1.weight") == "layers.0.mlp.experts.3.gate_proj.weight"
    assert checkpoint_name("layers.0.block_sparse_moe.experts.3.w3.weight") == "layers.0.mlp.experts.3.up_proj.weight"
    assert checkpoint_name("layers.0.block_sparse_moe.experts.3.w2.weight") == "layers.0.mlp.experts.3.down_proj.weight"
    assert checkpoint_name("layers.0.block_sparse_moe.gate.weight") == "layers.0.mlp.gate.weight"
    assert checkpoint_name("layers.0.mlp.experts.3.w1.weight") == "layers.0.mlp.experts.3.w1.weight"  # not Mixtral


def test_a_moe_config_refuses_more_experts_per_token_than_experts():
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) exceeds num_experts \(4\)"):
        MoEConfig(4, 5, 32, True)
    with pytest.raises(ValueError, match="expert_intermediate_size must be positive"):
        MoEConfig(4, 2, 0, True)


def test_the_path_for_cuda_graph_capture_gives_the_grouped_paths_sums():
    """While a CUDA graph is captured every expert runs over every row, weighted by zero where it
    was not chosen (no host sync): the same sums as the grouped path's."""
    block = make_block(8, 2, True, False)
    x = torch.randn(21, HIDDEN)
    with torch.no_grad():
        weights, experts = route(block.gate(x), 2, True)
        grouped = block._routed_experts(x, weights, experts, TorchOps())
        every = block._every_expert(x, weights, experts, TorchOps())
    torch.testing.assert_close(every, grouped, rtol=1e-5, atol=1e-5)


def test_gpt_oss_routes_by_a_softmax_over_the_top_k_logits():
    """The k largest logits, then a softmax over those k alone (not over every expert)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, experts = route(logits, 2, False, softmax_after_topk=True)
    assert experts.tolist() == [[3, 2]] and weights.dtype == torch.float32
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[3.0, 2.0]]), dim=-1))


def test_gpt_oss_experts_grouped_equal_a_loop_over_tokens_with_the_clamped_swiglu():
    """Router with a bias, softmax after top-k, experts with biases: the grouped block against
    token-by-token arithmetic written out, gate clamped above and up both ways at the limit."""
    torch.manual_seed(1)
    limit, alpha = 1.5, 1.702
    cfg = MoEConfig(6, 2, WIDTH, False, router_bias=True, softmax_after_topk=True, swiglu_limit=limit)
    block = SparseMoeBlock(cfg, HIDDEN, [ClampedSwiGLU(HIDDEN, WIDTH, limit, alpha) for _ in range(6)])
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(23, HIDDEN)
    want = torch.zeros_like(x)
    with torch.no_grad():
        got = block.forward(x, TorchOps())
        for t in range(x.shape[0]):
            top = (x[t] @ block.gate.weight.T + block.gate.bias).topk(2)
            for w, e in zip(torch.softmax(top.values, 0).tolist(), top.indices.tolist()):
                expert = block.experts[e]
                gate_up = expert.gate_up_proj.weight @ x[t] + expert.gate_up_proj.bias
                gate, up = gate_up[:WIDTH].clamp(max=limit), gate_up[WIDTH:].clamp(-limit, limit)
                want[t] += w * (expert.down_proj.weight @ ((up + 1) * gate * torch.sigmoid(alpha * gate))
                                 + expert.down_proj.bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (block.experts[0].gate_up_proj(x)[:, :WIDTH] > limit).any()  # the clamp bites at these weights


@pytest.mark.parametrize("num_experts, top_k, renormalise, shared, tokens", [
    (8, 2, True, False, 37), (4, 2, False, True, 9), (8, 1, False, False, 1), (6, 3, True, True, 64)])
def test_grouped_products_equal_the_loop_over_experts(num_experts, top_k, renormalise, shared, tokens):
    """group_experts' path (torch._grouped_mm, which CUDA runs as one kernel a projection; torch's CPU
    fallback here) gives the per-expert loop's output, its experts' weights views of the stacks."""
    block = make_block(num_experts, top_k, renormalise, shared)
    x = torch.randn(tokens, HIDDEN)
    with torch.no_grad():
        want = block.forward(x, TorchOps())
        assert group_experts(block) == 1
        got = block.forward(x, TorchOps())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gate_up, down = block.grouped
    assert gate_up.shape == (num_experts, 2 * WIDTH, HIDDEN) and down.shape == (num_experts, HIDDEN, WIDTH)
    for index, expert in enumerate(block.experts):
        assert expert.gate_up_proj.weight.data_ptr() == gate_up[index].data_ptr()
        assert expert.down_proj.weight.data_ptr() == down[index].data_ptr()


def test_experts_with_biases_or_held_elsewhere_are_not_grouped():
    gpt_oss = SparseMoeBlock(MoEConfig(4, 2, WIDTH, False, router_bias=True, softmax_after_topk=True,
                                       swiglu_limit=7.0), HIDDEN,
                             [ClampedSwiGLU(HIDDEN, WIDTH, 7.0, 1.702) for _ in range(4)])
    rank_share = SparseMoeBlock(MoEConfig(4, 2, WIDTH, True), HIDDEN,
                                [MLP(HIDDEN, WIDTH), MLP(HIDDEN, WIDTH), AbsentExpert(), AbsentExpert()])
    assert group_experts(nn.ModuleList([gpt_oss, rank_share])) == 0
    assert gpt_oss.grouped is None and rank_share.grouped is None


def test_grouped_mm_runs_in_float32_on_this_cpu():
    assert grouped_mm_runs(torch.device("cpu"), torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [24, 1])
def test_on_cuda_grouped_products_match_the_loop_and_replay_in_a_cuda_graph(tokens):
    """CUDA's grouped GEMM in bfloat16, eagerly and captured in a CUDA graph (no host sync inside);
    a graph of one token, which runs every expert over it instead, gives the same sums."""
    device = torch.device("cuda")
    if not grouped_mm_runs(device, torch.bfloat16):
        pytest.skip("torch._grouped_mm does not run on this GPU")
    block = make_block(8, 2, True, True).to(device, torch.bfloat16)
    x, other = (torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        want, want_other = (block.forward(v, TorchOps()).float() for v in (x, other))
        assert group_experts(block) == 1
        torch.testing.assert_close(block.forward(x, TorchOps()).float(), want, rtol=2e-2, atol=2e-2)
        static_x = x.clone()
        block.forward(static_x, TorchOps())  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = block.forward(static_x, TorchOps())
        static_x.copy_(other)
        graph.replay()
        torch.testing.assert_close(static_out.float(), want_other, rtol=2e-2, atol=2e-2)
