"""Memory pressure on a tiny real model: prefix caching on/off and recompute/swap preemption
all give the same greedy tokens (and the same as transformers), with preemption forced."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill import LLM, SamplingParams


def prompts():
    rng = random.Random(7)
    shared = [rng.randrange(2, 384) for _ in range(100)]
    with_prefix = [shared + [rng.randrange(2, 384) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    unshared = [[rng.randrange(2, 384) for _ in range(rng.randint(1, 150))] for _ in range(8)]
    return with_prefix + unshared


def run(model_dir, **options):
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=6, max_num_batched_tokens=64, block_size=16, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    engine = llm.engine
    assert engine.scheduler.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()
    return [o.outputs[0].token_ids for o in outs], engine


@pytest.fixture(scope="module")
def roomy(tiny_llama):
    tokens, engine = run(tiny_llama, num_kv_blocks=512, enable_prefix_caching=False)
    assert engine.scheduler.num_preemptions == 0
    return tokens


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async_scheduling"])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_equal_under_pressure_with_caching_on_and_off(tiny_llama, roomy, caching, mode, ahead):
    """With async scheduling, requests are preempted while a token of theirs is still in flight."""
    tokens, engine = run(tiny_llama, num_kv_blocks=24, enable_prefix_caching=caching, preemption_mode=mode,
                         swap_space=1 << 24, async_scheduling=ahead)
    assert engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    assert (engine.scheduler.num_swapped_out > 0) == (mode == "swap")
    if caching:
        assert engine.scheduler.stats().prefix_tokens_hit > 0, "the shared prefix should be served from the cache"
    assert tokens == roomy


def test_a_step_failing_before_its_swap_copies_recomputes_the_swapped(tiny_llama, roomy):
    """A step whose launch fails may not have copied its swap victims' blocks to the host: those
    requests recompute instead of swapping garbage back in, and give the same tokens."""
    llm = LLM(str(tiny_llama), max_num_seqs=6, max_num_batched_tokens=64, block_size=16, num_kv_blocks=24,
              dtype="float32", enable_prefix_caching=False, preemption_mode="swap", swap_space=1 << 24)
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(max_tokens=20, temperature=0.0)
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, params)
    original, failed = runner.launch, []

    def launch(sched):
        if sched.swap_out and not failed:  # the first step that swaps a request out fails first
            failed.extend(r.request_id for r in sched.requests)
            raise RuntimeError("injected fault")
        return original(sched)
    runner.launch = launch
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert failed and engine.scheduler.num_swapped_out > 0
    survivors = [i for i in range(len(prompts())) if str(i) not in failed]
    assert all(finals[str(i)].finish_reason == "error" for i in map(int, failed))
    assert [finals[str(i)].token_ids for i in survivors] == [roomy[i] for i in survivors]
    assert engine.scheduler.stats().kv_blocks_used == 0 and engine.scheduler.kv.host_pool.num_used_blocks == 0


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async_scheduling"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_preemption_to_admit_keeps_every_output(tiny_llama, roomy, mode, ahead):
    """Requests arrive a step apart, each more urgent than the last: each one admitted into a full
    batch preempts the least urgent running one, and every output is what it is alone."""
    llm = LLM(str(tiny_llama), max_num_seqs=3, max_num_batched_tokens=64, block_size=16, num_kv_blocks=512,
              dtype="float32", enable_prefix_caching=False, scheduling_policy="priority", preemption_mode=mode,
              swap_space=1 << 24, async_scheduling=ahead)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0)
    finals, pending = {}, list(enumerate(prompts()))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params, priority=len(prompts()) - i)
        for out in engine.step():
            if out.finished:
                finals[int(out.request_id)] = out.outputs[0].token_ids
    assert engine.scheduler.num_preemptions > 0
    assert (engine.scheduler.num_swapped_out > 0) == (mode == "swap")
    assert [finals[i] for i in range(len(prompts()))] == roomy
    assert engine.scheduler.stats().kv_blocks_used == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_int8_pool_gives_the_same_tokens_under_pressure_as_with_room(tiny_llama, mode):
    """kv_cache_dtype="int8": blocks swapped out and back, recomputed after preemption or served
    from the prefix cache hold the same codes and scales, so the greedy tokens are those of a roomy
    int8 pool; and the same memory holds blocks of rows of head_dim + 4 bytes (the codes and a
    float32 scale) where a float16 pool's rows take 2 * head_dim."""
    roomy_int8, engine = run(tiny_llama, num_kv_blocks=512, enable_prefix_caching=False, kv_cache_dtype="int8")
    assert engine.runner.worker.kv_cache.dtype == torch.int8 and engine.scheduler.num_preemptions == 0
    tokens, engine = run(tiny_llama, num_kv_blocks=24, preemption_mode=mode, swap_space=1 << 24,
                         kv_cache_dtype="int8")
    assert engine.scheduler.num_preemptions > 0 and (engine.scheduler.num_swapped_out > 0) == (mode == "swap")
    assert engine.scheduler.stats().prefix_tokens_hit > 0
    assert tokens == roomy_int8
    config = engine.model_config
    rows = 16 * 2 * config.num_layers * config.num_kv_heads  # a block's rows: 16 tokens' K and V
    for dtype, row_bytes in (("float16", 2 * config.head_dim), ("int8", config.head_dim + 4)):
        llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=dtype, kv_cache_memory=1 << 22)
        assert llm.engine.cache_config.num_blocks == (1 << 22) // (rows * row_bytes)


def test_a_pool_too_small_for_the_context_names_how_much_more_an_int8_pool_holds(tiny_llama, caplog):
    """The warning that lowers max_model_len says what kv_cache_dtype="int8" would hold instead: a
    float32 pool's rows take 4 * head_dim bytes, an int8 pool's head_dim + 4. (A CPU pool's: CUDA
    has no int8 pool.)"""
    with caplog.at_level("WARNING", logger="tokenmill.engine_parts"):
        head_dim = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=8, device="cpu").engine.model_config.head_dim
    assert "max_model_len lowered from" in caplog.text
    assert f"kv_cache_dtype='int8' would hold {4 * head_dim / (head_dim + 4):.1f}x the tokens" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tokenmill.engine_parts"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=8, kv_cache_dtype="int8")
    assert "max_model_len lowered from" in caplog.text and "would hold" not in caplog.text
