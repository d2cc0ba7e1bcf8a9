"""Prefix caching and pool invariants under random traffic (fake model, exact expectations)."""

from __future__ import annotations

import random

from fakes import fake_run, make_scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def request(rid: str, tokens: list[int], max_tokens: int = 4, **kw) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, params=SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens, eos_token_ids=frozenset({1}), **kw)


def step(s):
    sched = s.schedule()
    s.update(sched, fake_run(sched))
    return sched


def test_32_requests_share_one_copy_of_a_1000_token_system_prompt():
    s = make_scheduler(num_blocks=400, block_size=16, budget=512, max_num_seqs=64, max_model_len=4096,
                       prefix_caching=True)
    rng = random.Random(0)
    system = [rng.randrange(2, 1000) for _ in range(1000)]
    reqs = [request(f"r{i}", system + [rng.randrange(2, 1000) for _ in range(40)], max_tokens=200)
            for i in range(32)]
    for r in reqs:
        s.add_request(r)
    prompt_tokens_computed = 0
    while any(r.num_output_tokens == 0 for r in reqs):
        sched = step(s)
        prompt_tokens_computed += sched.num_prefill_tokens
        s.kv.pool.check_invariants()
    shared = reqs[0].block_ids[:62]  # 62 full blocks = the first 992 system-prompt tokens
    for r in reqs:
        assert r.block_ids[:62] == shared
    assert all(s.kv.pool.ref_counts[b] == 32 for b in shared)
    # The first request computes the whole prompt; the others only the 8-token tail of the
    # system prompt (in their own, not-yet-full block 62) and their question.
    assert prompt_tokens_computed == 1040 + 31 * (8 + 40)
    assert [r.num_cached_tokens for r in reqs[1:]] == [992] * 31
    assert s.kv.prompt_tokens_hit == 31 * 992


def test_a_finished_prompt_is_served_from_the_cache_until_evicted():
    s = make_scheduler(num_blocks=12, block_size=4, budget=64, prefix_caching=True)
    prompt = list(range(10, 30))
    first = request("a", prompt, max_tokens=1)
    s.add_request(first)
    step(s)
    assert first.is_finished and s.kv.pool.num_evictable_blocks == 5  # 20 tokens, 5 full blocks
    again = request("b", prompt, max_tokens=1)
    s.add_request(again)
    step(s)
    assert again.num_cached_tokens == 16  # at most 19 of 20 tokens reused: 4 full blocks
    # A different long prompt needs the whole pool: cached blocks are evicted, LRU first.
    other = request("c", list(range(100, 144)), max_tokens=1)
    s.add_request(other)
    step(s)
    assert other.is_finished and s.kv.pool.num_evictions > 0
    s.kv.pool.check_invariants()


def holders(s) -> dict[int, int]:
    count: dict[int, int] = {}
    for r in s.running:
        for b in r.block_ids:
            count[b] = count.get(b, 0) + 1
    return count


def check_pool(s) -> None:
    pool = s.kv.pool
    pool.check_invariants()
    held = holders(s)
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == held.get(block, 0), f"block {block}"
    for r in s.waiting:
        assert not r.block_ids  # preempted requests hold nothing
    assert s.kv.slots_filled(s.running) <= pool.num_used_blocks * s.kv.block_size


operations = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]),
                                st.integers(0, 3), st.integers(1, 40), st.integers(0, 10_000)),
                      min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(operations, st.booleans())
def test_random_traffic_keeps_every_block_accounted_for(ops, prefix_caching):
    """Random adds (some sharing prefixes), steps and aborts over a small pool: after every
    operation each block's ref count equals the live requests holding it, and the free,
    evictable and used blocks add up; in the end every block comes back."""
    s = make_scheduler(num_blocks=24, block_size=4, budget=16, max_num_seqs=6, max_model_len=96,
                       prefix_caching=prefix_caching)
    prefixes = [[7] * 12, list(range(20, 32)), [9, 8] * 6, []]
    n = 0
    for op, prefix, length, salt in ops:
        if op == "add":
            rng = random.Random(salt)
            tokens = prefixes[prefix] + [rng.randrange(2, 50) for _ in range(length)]
            s.add_request(request(f"r{n}", tokens[:80], max_tokens=1 + salt % 12))
            n += 1
        elif op == "abort" and s.requests:
            victim = sorted(s.requests)[salt % len(s.requests)]
            s.finish_request(victim, RequestStatus.FINISHED_ABORTED)
        else:
            step(s)
        check_pool(s)
    while s.has_unfinished_requests():
        step(s)
        check_pool(s)
    assert s.kv.pool.num_used_blocks == 0
