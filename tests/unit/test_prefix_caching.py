"""Prefix caching and pool invariants under random traffic (fake model, exact expectations)."""

from __future__ import annotations

import random

from fakes import FakeClock, fake_run, make_scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler


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
    assert s.prompt_tokens_hit == 31 * 992


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


def test_a_preempted_requests_second_lookup_is_not_counted_as_a_query_or_a_hit():
    """vLLM's prefix_cache_queries and hits count first admissions: a request resumed after a
    recompute preemption, finding its own blocks again, would make the hit rate look high."""
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, max_num_seqs=4, prefix_caching=True)
    reqs = [request(r, list(range(10 * i + 10, 10 * i + 10 + n)), max_tokens=12)
            for i, (r, n) in enumerate([("a", 8), ("b", 8), ("c", 4)])]
    for r in reqs:
        s.add_request(r)
    while s.has_unfinished_requests():
        step(s)
    assert sum(r.num_preemptions for r in reqs) >= 2
    assert (s.prompt_tokens_queried, s.prompt_tokens_hit) == (8 + 8 + 4, 0)


def test_a_request_that_never_looks_in_the_cache_is_not_counted_as_a_query():
    """As vLLM counts them: a request scoring its prompt (prompt_logprobs) or pooling every
    position (mean) computes its whole prompt and queries nothing; a last-pooled one queries."""
    from tokenmill.pooling_params import PoolingParams
    s = make_scheduler(num_blocks=40, block_size=4, budget=64, prefix_caching=True)
    scored = Request(request_id="scored", prompt_token_ids=list(range(10, 22)), max_tokens=1,
                     params=SamplingParams(max_tokens=1, prompt_logprobs=0), eos_token_ids=frozenset({1}))
    pooled = [Request(request_id=kind, prompt_token_ids=list(range(30 + 10 * i, 38 + 10 * i)), max_tokens=0,
                      params=SamplingParams(max_tokens=1), eos_token_ids=frozenset({1}), pooling=PoolingParams(kind))
              for i, kind in enumerate(["mean", "last"])]
    for r in (scored, *pooled):
        s.add_request(r)
        step(s)
    assert (s.prompt_tokens_queried, s.prompt_tokens_hit) == (8, 0)


def test_blocks_are_shared_only_between_requests_with_the_same_cache_salt():
    """vLLM's cache_salt: a tenant's prompts hit only its own cached blocks; unsalted ones only
    unsalted ones. The same prompt with the same salt is served from the cache as before."""
    s = make_scheduler(num_blocks=40, block_size=4, budget=64, prefix_caching=True)
    prompt = list(range(10, 30))
    cached = []
    for rid, salt in [("a", "tenant-1"), ("b", "tenant-2"), ("c", None), ("d", "tenant-1"), ("e", None),
                      ("f", "tenant-2")]:
        r = request(rid, prompt, max_tokens=1, cache_salt=salt)
        s.add_request(r)
        step(s)
        cached.append(r.num_cached_tokens)
    assert cached == [0, 0, 0, 16, 16, 16]
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


class SlotStore:
    """What a real pool would hold: the token written into each slot, copied by swaps as the
    runner copies blocks. A step writes its chunks' tokens, then each request reads its whole
    context back from its block table, as attention would: a prefix hit that handed it a block
    of other content (a stale hash, a stale twin) shows up as a token it never had."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.device: dict[tuple[int, int], int] = {}
        self.host: dict[tuple[int, int], int] = {}

    def run(self, sched) -> None:
        for src, dst in sched.swap_out:
            self.host.update({(dst, i): self.device[(src, i)] for i in range(self.bs) if (src, i) in self.device})
        for src, dst in sched.swap_in:
            self.device.update({(dst, i): self.host[(src, i)] for i in range(self.bs) if (src, i) in self.host})
        for r, n in zip(sched.requests, sched.num_scheduled_tokens):
            start, end = r.num_computed_tokens, min(r.num_computed_tokens + n, r.num_tokens)
            for pos in range(start, end):
                self.device[(r.block_ids[pos // self.bs], pos % self.bs)] = r.token_ids[pos]
            read = [self.device.get((r.block_ids[pos // self.bs], pos % self.bs)) for pos in range(end)]
            assert read == r.token_ids[:end], f"{r.request_id} reads another sequence's KV"


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "again", "step", "step", "step", "abort"]), st.integers(0, 3),
                          st.integers(1, 30), st.integers(0, 10_000)), min_size=1, max_size=80),
       st.sampled_from(["recompute", "swap"]))
def test_prefix_hits_and_twins_always_hand_a_request_its_own_tokens(ops, mode):
    """Random traffic with repeated prompts (identical requests decode identical blocks: twins of
    cached ones), preemption by recompute or swap over a small pool, and aborts: every step each
    request reads back exactly its own tokens, and the cache's bookkeeping holds."""
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, num_host_blocks=12)
    s = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=16, max_model_len=80, kv_watermark=0.0,
                                  preemption_mode=mode), kv, clock=FakeClock())
    store, prefixes, last, n = SlotStore(4), [[7] * 12, list(range(20, 32)), [9, 8] * 6, []], None, 0
    for op, prefix, length, salt in ops:
        if op in ("add", "again"):
            if op == "add" or last is None:  # again: the last prompt, for as many tokens as the salt says
                last = (prefixes[prefix] + [random.Random(salt).randrange(2, 50) for _ in range(length)])[:60]
            s.add_request(request(f"r{n}", list(last), max_tokens=1 + salt % 16))
            n += 1
        elif op == "abort" and s.requests:
            s.finish_request(sorted(s.requests)[salt % len(s.requests)], RequestStatus.FINISHED_ABORTED)
        else:
            sched = s.schedule()
            store.run(sched)
            s.update(sched, fake_run(sched))
        check_pool(s)
    while s.has_unfinished_requests():
        sched = s.schedule()
        store.run(sched)
        s.update(sched, fake_run(sched))
        check_pool(s)
