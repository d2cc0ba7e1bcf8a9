"""Memory pressure on a tiny real model: prefix caching on/off and recompute/swap preemption
all give the same greedy tokens (and the same as transformers), with preemption forced."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams


def prompts():
    rng = random.Random(7)
    shared = [rng.randrange(2, 384) for _ in range(100)]
    with_prefix = [shared + [rng.randrange(2, 384) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    unshared = [[rng.randrange(2, 384) for _ in range(rng.randint(1, 150))] for _ in range(8)]
    return with_prefix + unshared


def run(model_dir, **options):
    llm = LLM(str(model_dir), max_num_seqs=6, max_num_batched_tokens=64, block_size=16, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    engine = llm.engine
    assert engine.kv.pool.num_used_blocks == 0 and not engine.has_unfinished_requests()
    return [o.outputs[0].token_ids for o in outs], engine


@pytest.fixture(scope="module")
def roomy(tiny_llama):
    tokens, engine = run(tiny_llama, num_kv_blocks=512, enable_prefix_caching=False)
    assert engine.scheduler.num_preemptions == 0
    return tokens


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_equal_under_pressure_with_caching_on_and_off(tiny_llama, roomy, caching, mode):
    tokens, engine = run(tiny_llama, num_kv_blocks=24, enable_prefix_caching=caching, preemption_mode=mode,
                         swap_space=1 << 24)
    assert engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    assert (engine.scheduler.num_swapped_out > 0) == (mode == "swap")
    if caching:
        assert engine.kv.prompt_tokens_hit > 0, "the shared prefix should be served from the cache"
    assert tokens == roomy
