"""Async scheduling's edges on a tiny model (CPU): each case runs with and without it and must
give the same tokens and the same counts."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def engine_for(model, ahead: bool, **options) -> LLMEngine:
    options = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 64, **options}
    return LLMEngine(EngineConfig(model=str(model), async_scheduling=ahead, async_output=False, **options))


def run(engine: LLMEngine, per_step=None) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if per_step is not None:
            per_step(engine)
        for out in outputs:
            if out.finished:
                finals[out.request_id] = out
    assert engine.scheduler.stats().kv_blocks_used == 0
    return finals


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("order", ["AB", "BA"])
def test_a_request_ending_with_its_token_in_flight_is_no_victim(tiny_llama, mode, order):
    """A ends by length with the token in flight and keeps its blocks until that step's update.
    B then needs a block: under fcfs the victim would be the latest admitted, but A is about to
    free its blocks, so it must not be preempted (nor B swapped out by a step that then launches
    nothing, losing its copies). Same tokens and the same preemptions as without async
    scheduling."""
    def once(ahead):
        engine = engine_for(tiny_llama, ahead, block_size=4, num_kv_blocks=3, preemption_mode=mode,
                            swap_space=1 << 20, enable_prefix_caching=False)
        prompts = {"A": ([5, 6, 7], 1), "B": (list(range(10, 18)), 4)}
        for rid in order:
            engine.add_request(rid, prompts[rid][0], GREEDY.clone(max_tokens=prompts[rid][1]))
        finals = run(engine)
        return ({rid: o.outputs[0].token_ids for rid, o in finals.items()}, engine.scheduler.num_preemptions,
                engine.scheduler.num_swapped_out, finals["A"].metrics.num_preemptions)
    assert once(True) == once(False)


def test_a_reused_request_id_gets_a_fresh_seeded_generator(tiny_llama):
    """The generator of a finished seeded request is dropped even when the step after its end
    runs no request; a new request with the same id and seed draws the same tokens again. The
    first step() of the second run completes no step: it leaves empty stats, not the last run's."""
    engine = engine_for(tiny_llama, True)
    seeded = SamplingParams(max_tokens=2, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request("x", [5, 6, 7], seeded)
    engine.add_request("z", [8, 9, 10], GREEDY.clone(max_tokens=3))
    first = run(engine)["x"].outputs[0].token_ids
    assert "x" not in engine.runner.generators
    engine.add_request("x", [5, 6, 7], seeded)
    assert engine.step() == [] and engine.last_stats.num_tokens == 0
    assert run(engine)["x"].outputs[0].token_ids == first


def test_stats_split_prefill_and_decode_and_count_each_preemption_once(tiny_llama):
    """A first decode (its input token still in flight) counts as a decode, as without async
    scheduling; and every step() leaves fresh stats, so a caller that adds up last_stats after
    each call (the server's metrics) counts each preemption once."""
    def once(ahead, num_kv_blocks):
        engine = engine_for(tiny_llama, ahead, block_size=4, num_kv_blocks=num_kv_blocks)
        steps, per_call = [], []
        engine.stats_listeners.append(steps.append)
        for i in range(4):
            engine.add_request(str(i), [5 + i] * (3 + 5 * i), GREEDY.clone(max_tokens=9))
        run(engine, per_step=lambda e: per_call.append(e.last_stats))
        preemptions = engine.scheduler.num_preemptions
        assert sum(s.num_preemptions for s in per_call) == sum(s.num_preemptions for s in steps) == preemptions
        return sum(s.num_decode_tokens for s in steps), sum(s.num_prefill_tokens for s in steps), preemptions
    assert once(True, 64) == once(False, 64) == (4 * 8, 3 + 8 + 13 + 18, 0)
    assert once(True, 12)[2] > 0, "the small pool should force preemption"
