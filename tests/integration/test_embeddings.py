"""Embeddings from the engine against transformers on tiny random-weight models: a prompt's pooled
vector equals the final hidden states (after the model's last norm) that transformers computes
for it, pooled and normalised, when the prompt runs in chunks, when it starts from the prefix
cache, beside generation requests in the same steps and under preemption."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from test_hf_equivalence import hf_greedy, hf_model, rel_err

from tokenmill import LLM, SamplingParams
from tokenmill.pooling_params import PoolingParams

TOL = 1e-5  # relative: float32 through different kernels


def hf_final_hidden(model, prompt: list[int]) -> torch.Tensor:
    """(len(prompt), hidden): transformers' last hidden states, after the final norm."""
    with torch.no_grad():
        return model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pooled_vectors_equal_hf_hidden_states_in_chunks_and_from_the_prefix_cache(tiny_models, arch):
    rng = random.Random(arch)
    shared = [rng.randrange(2, 384) for _ in range(48)]
    prompts = [shared + [rng.randrange(2, 384) for _ in range(n)] for n in (1, 30, 100)] + [[7], [9, 11, 13]]
    # a 32-token budget: the long prompts run in up to 5 chunks
    llm = LLM(str(tiny_models[arch]), max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64, block_size=16,
              dtype="float32", long_prefill_token_threshold=0)
    scheduler = llm.engine.scheduler
    llm.generate([{"prompt_token_ids": shared + [5]}], SamplingParams(max_tokens=1), use_tqdm=False)  # caches `shared`
    hits = scheduler.prompt_tokens_hit
    last = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    assert scheduler.prompt_tokens_hit - hits >= 3 * 48  # the three long prompts started from the cache
    hits = scheduler.prompt_tokens_hit
    mean = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams("mean"), use_tqdm=False)
    assert scheduler.prompt_tokens_hit == hits  # the mean computed whole prompts, though all their blocks were cached
    raw = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams("last", normalize=False), use_tqdm=False)
    assert scheduler.kv.pool.num_used_blocks == 0

    hf = hf_model(tiny_models[arch])
    for prompt, v_last, v_mean, v_raw in zip(prompts, last, mean, raw):
        h = hf_final_hidden(hf, prompt)
        assert len(v_last) == h.shape[1] == 96
        assert rel_err(torch.tensor(v_last), F.normalize(h[-1], dim=0)) < TOL, len(prompt)
        assert rel_err(torch.tensor(v_mean), F.normalize(h.mean(0), dim=0)) < TOL, len(prompt)
        assert rel_err(torch.tensor(v_raw), h[-1]) < TOL, len(prompt)


@pytest.mark.parametrize("ahead", [False, True])
def test_embeddings_beside_generation_in_the_same_steps_both_equal_hf_under_preemption(tiny_llama, ahead):
    """Generation requests first, then embedding requests (the latest admitted: the first the pool
    preempts) in a pool too small for all of them; with async scheduling too (ahead)."""
    rng = random.Random(5)
    gen_prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (20, 45, 60, 33)]
    emb_prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (150, 90, 6, 120)]
    pooling = [PoolingParams("mean"), PoolingParams("last"), PoolingParams("last"), PoolingParams("mean")]
    llm = LLM(str(tiny_llama), max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=16, block_size=16,
              dtype="float32", long_prefill_token_threshold=0, async_scheduling=ahead)
    engine, inputs = llm.engine, llm.engine.input_processor
    greedy = SamplingParams(max_tokens=24, temperature=0)
    requests = [inputs.make_request(f"g{i}", {"prompt_token_ids": p}, greedy) for i, p in enumerate(gen_prompts)]
    requests += [inputs.make_embedding_request(f"e{i}", {"prompt_token_ids": p}, pool)
                 for i, (p, pool) in enumerate(zip(emb_prompts, pooling))]
    mixed = []
    original = engine.scheduler.schedule

    def spy():
        sched = original()
        mixed.append(bool(sched.pooling) and len(sched.pooling) < len(sched.requests))
        return sched
    engine.scheduler.schedule = spy
    for request in requests:
        engine.add(request)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((out.request_id, out) for out in engine.step() if out.finished)
    assert any(mixed), "no step ran embeddings beside generation"
    preempted = [rid for rid, out in outs.items() if any(e.kind == "preempted" for e in out.timeline.events)]
    assert any(rid.startswith("e") for rid in preempted), preempted
    assert engine.scheduler.stats().kv_blocks_used == 0

    hf = hf_model(tiny_llama)
    for i, prompt in enumerate(gen_prompts):
        out = outs[f"g{i}"]
        assert out.embedding is None and out.outputs[0].token_ids == hf_greedy(hf, prompt, 24), i
    for i, (prompt, pool) in enumerate(zip(emb_prompts, pooling)):
        out = outs[f"e{i}"]
        h = hf_final_hidden(hf, prompt)
        expected = F.normalize(h.mean(0) if pool.pooling == "mean" else h[-1], dim=0)
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == []
        assert rel_err(torch.tensor(out.embedding), expected) < TOL, i
