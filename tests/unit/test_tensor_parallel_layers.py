"""Tensor-parallel layers (models/parallel.py): how checkpoint tensors are cut, and each parallel
layer on a real 2-rank gloo world (two processes on 127.0.0.1) against the unsharded layer.

One world runs every layer check once (a module fixture: starting two processes costs seconds);
each test then reads its own figures from it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tp_world import run_world

from tokenmill.attention import AttentionMetadata, make_backend
from tokenmill.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.parallel import (
    TPShard,
    check_divisible,
    local_config,
    parallelize,
    shard_tensor,
    shard_vocab,
    shard_weights,
)

# q/k bias (Qwen2) and q/k head norms (Qwen3) together, an untied head: every sharded parameter kind
CFG = ModelConfig(architecture="qwen3", vocab_size=81, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True, qk_norm=True,
                  tie_word_embeddings=False)
TIED = ModelConfig(architecture="llama", vocab_size=80, hidden_size=64, intermediate_size=96, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
BLOCK = 16


def hf_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face's names, as a checkpoint holds them."""
    g = torch.Generator().manual_seed(seed)
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g) * 0.4 - 0.2
    out = {"model.embed_tokens.weight": rand(cfg.vocab_size, h), "model.norm.weight": 1 + rand(h)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = rand(cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": 1 + rand(h), p + "post_attention_layernorm.weight": 1 + rand(h),
                    p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                    p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                    p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                    p + "mlp.down_proj.weight": rand(h, i)})
        if cfg.attention_bias:
            out.update({p + "self_attn.q_proj.bias": rand(q), p + "self_attn.k_proj.bias": rand(kv),
                        p + "self_attn.v_proj.bias": rand(kv)})
        if cfg.qk_norm:
            out.update({p + "self_attn.q_norm.weight": 1 + rand(cfg.head_dim),
                        p + "self_attn.k_norm.weight": 1 + rand(cfg.head_dim)})
    return out


def whole_model(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    model = LlamaForCausalLM(cfg, max_len=64)
    model.load_weights(weights.items())
    return model.eval()


def rank_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], shard: TPShard, all_reduce) -> LlamaForCausalLM:
    """A rank's model as load_model builds it (without the CPU packing)."""
    model = LlamaForCausalLM(local_config(cfg, shard), max_len=64)
    shard_vocab(model, cfg, shard, all_reduce)
    model.load_weights(shard_weights(weights.items(), cfg, shard))
    parallelize(model, all_reduce)
    return model.eval()


def one_sequence(num_tokens: int) -> AttentionMetadata:
    """A first prompt chunk of one sequence over blocks 0, 1, ..."""
    pos = torch.arange(num_tokens)
    blocks = -(-num_tokens // BLOCK)
    return AttentionMetadata(slot_block=pos // BLOCK, slot_offset=pos % BLOCK,
                             query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
                             seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
                             block_tables=torch.arange(blocks, dtype=torch.int32).view(1, -1),
                             query_start_loc_host=[0, num_tokens], seq_lens_host=[num_tokens], block_size=BLOCK)


def pool(cfg: ModelConfig, num_blocks: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, cfg.num_kv_heads, BLOCK, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]


def check_layers(rank: int, size: int, cfg: ModelConfig = CFG) -> dict[str, float]:
    """On every rank: the largest difference of each parallel layer from the whole one."""
    import torch.distributed as dist

    from tokenmill.distributed import TPGroup, gather_logits

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t
    torch.set_num_threads(1)
    shard = TPShard(rank, size)
    weights = hf_weights(cfg)
    whole, part = whole_model(cfg, weights), rank_model(cfg, weights, shard, all_reduce)
    backend, ops = make_backend("reference", torch.device("cpu")), whole.ops
    t = 21
    ids = torch.randint(0, cfg.vocab_size, (t,), generator=torch.Generator().manual_seed(1))
    x = torch.rand(t, cfg.hidden_size, generator=torch.Generator().manual_seed(2)) - 0.5
    positions, meta = torch.arange(t), one_sequence(t)
    cos, sin = whole.rotary(positions, x.dtype)
    out = {}
    with torch.inference_mode():
        out["embedding"] = (part.embed_tokens(ids) - whole.embed_tokens(ids)).abs().max().item()
        whole_pool, part_pool = pool(cfg), pool(part.config)
        a = whole.layers[0].self_attn.forward(x, cos, sin, *whole_pool[0], meta, backend, ops)
        b = part.layers[0].self_attn.forward(x, cos, sin, *part_pool[0], meta, backend, ops)
        out["attention"] = (a - b).abs().max().item()
        heads = shard.split(cfg.num_kv_heads)  # this rank's K/V heads: those of the whole pool
        out["kv_heads"] = (whole_pool[0][0].narrow(1, *heads) - part_pool[0][0]).abs().max().item()
        out["mlp"] = (whole.layers[0].mlp.forward(x, ops) - part.layers[0].mlp.forward(x, ops)).abs().max().item()
        hidden_whole = whole(ids, positions, meta, pool(cfg), backend)
        hidden_part = part(ids, positions, meta, pool(part.config), backend)
        out["model"] = (hidden_whole - hidden_part).abs().max().item()
        group = TPGroup(rank, size, dist.group.WORLD, dist.group.WORLD, torch.device("cpu"))
        logits = gather_logits(group, part.compute_logits(hidden_part), cfg.vocab_size)
        if rank == 0:
            out["logits"] = (whole.compute_logits(hidden_whole) - logits).abs().max().item()
    out["params"] = sum(p.numel() for p in part.parameters())
    out["whole_params"] = sum(p.numel() for p in whole.parameters())
    return out


def check_tied_layers(rank: int, size: int) -> dict[str, float]:
    return check_layers(rank, size, TIED)


@pytest.fixture(scope="module")
def world() -> list[dict[str, float]]:
    return run_world(check_layers, size=2, timeout=120)


@pytest.fixture(scope="module")
def tied_world() -> list[dict[str, float]]:
    return run_world(check_tied_layers, size=2, timeout=120)


def test_the_vocab_parallel_embedding_looks_up_every_id_as_the_whole_table_on_both_ranks(world) -> None:
    assert [r["embedding"] for r in world] == [0.0, 0.0]  # one rank adds its row to zeros: exact


def test_column_parallel_qkv_and_row_parallel_o_proj_give_the_whole_attention_within_1e_5(world) -> None:
    assert all(r["attention"] < 1e-5 for r in world), [r["attention"] for r in world]


def test_each_rank_writes_exactly_its_own_kv_heads_of_the_whole_pool(world) -> None:
    assert all(r["kv_heads"] < 1e-6 for r in world), [r["kv_heads"] for r in world]


def test_column_parallel_gate_up_and_row_parallel_down_give_the_whole_mlp_within_1e_5(world) -> None:
    assert all(r["mlp"] < 1e-5 for r in world), [r["mlp"] for r in world]


def test_the_sharded_model_gives_the_whole_models_hidden_states_and_rank_0_its_gathered_logits(world) -> None:
    assert all(r["model"] < 1e-4 for r in world), [r["model"] for r in world]
    assert world[0]["logits"] < 1e-4  # 81 columns: 41 from rank 0, 40 (padded to 41 and cut) from rank 1


def test_a_tied_heads_logits_gathered_from_each_ranks_embedding_rows_equal_the_whole_ones(tied_world) -> None:
    assert tied_world[0]["logits"] < 1e-4


def test_each_rank_holds_its_vocabulary_rows_of_embedding_and_head_and_half_of_every_split_weight(world) -> None:
    cfg = CFG
    head = cfg.vocab_size * cfg.hidden_size
    vocab_rows = [41, 40]  # ceil(81 / 2) rows, then the rest
    split = world[0]["whole_params"] - 2 * head  # everything but the embedding and the head
    norms = cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) + cfg.hidden_size
    for rank, r in enumerate(world):
        assert r["params"] == (split - norms) // 2 + norms + 2 * vocab_rows[rank] * cfg.hidden_size


def test_shard_tensor_cuts_q_k_v_rows_by_heads_and_o_proj_columns_by_q_heads() -> None:
    weights = hf_weights(CFG)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    k_bias = weights["model.layers.0.self_attn.k_proj.bias"]
    o = weights["model.layers.0.self_attn.o_proj.weight"]
    one = TPShard(1, 2)
    assert torch.equal(shard_tensor("model.layers.0.self_attn.q_proj.weight", q, CFG, one), q[32:64])
    assert torch.equal(shard_tensor("model.layers.0.self_attn.k_proj.bias", k_bias, CFG, one), k_bias[16:32])
    assert torch.equal(shard_tensor("model.layers.0.self_attn.o_proj.weight", o, CFG, one), o[:, 32:64])
    head = weights["lm_head.weight"]
    assert torch.equal(shard_tensor("lm_head.weight", head, CFG, one), head[41:])
    norm = weights["model.layers.0.self_attn.q_norm.weight"]
    assert shard_tensor("model.layers.0.self_attn.q_norm.weight", norm, CFG, one) is norm


def test_a_tied_models_ranks_each_load_their_rows_of_the_table_and_no_head() -> None:
    weights = hf_weights(TIED)
    table = weights["model.embed_tokens.weight"]
    rank0 = dict(shard_weights(weights.items(), TIED, TPShard(0, 2)))
    rank1 = dict(shard_weights(weights.items(), TIED, TPShard(1, 2)))
    assert "lm_head.weight" not in rank0 and "lm_head.weight" not in rank1
    assert torch.equal(rank0["model.embed_tokens.weight"], table[:40])
    assert torch.equal(rank1["model.embed_tokens.weight"], table[40:])
    assert local_config(TIED, TPShard(1, 2)).tie_word_embeddings is True


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_the_counts() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the model's num_heads = 4, "
                                         r"num_kv_heads = 2 \(pick a size that divides each of num_heads 4, "
                                         r"num_kv_heads 2, intermediate_size 96\)$"):
        check_divisible(CFG, 3)
    with pytest.raises(ValueError, match=r"does not divide the model's intermediate_size = 95 \("):
        check_divisible(dataclasses.replace(CFG, intermediate_size=95), 2)
    check_divisible(CFG, 2)
