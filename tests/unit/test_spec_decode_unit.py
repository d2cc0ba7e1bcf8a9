"""Speculation bookkeeping with a fake model: rollback keeps the pool consistent; the n-gram
lookup; the policy speculates when a step's cost is flat in its tokens and not when it is
compute-bound."""

from __future__ import annotations

import random

from fakes import fake_token, make_request, make_scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.outputs import RunnerOutput
from tokenmill.proposers import NgramProposer
from tokenmill.spec_decode import SpeculationPolicy


def speculative_run(sched, rng: random.Random) -> RunnerOutput:
    """Accept a random prefix of each request's drafts, then one token of the model's own."""
    out = RunnerOutput(sampled_token_ids={})
    for r, n, d in zip(sched.requests, sched.num_scheduled_tokens, sched.num_draft_tokens):
        if r.num_computed_tokens + n - d == r.num_tokens:
            accepted = r.draft_token_ids[:rng.randint(0, d)]
            out.sampled_token_ids[r.request_id] = accepted + [fake_token(r)]
            out.num_draft_tokens += d
            out.num_accepted_tokens += len(accepted)
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.booleans())
def test_random_accept_reject_keeps_the_pool_consistent(seed, prefix_caching):
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=40, block_size=4, budget=24, max_num_seqs=5, max_model_len=120,
                       prefix_caching=prefix_caching)
    for i in range(8):
        s.add_request(make_request(f"r{i}", prompt_len=rng.randint(1, 30), max_tokens=rng.randint(1, 40),
                                   arrival=float(i)))
    while s.has_unfinished_requests():
        for r in s.running:  # propose 0..4 drafts for every decoding request
            if r.num_remaining_prefill == 1:
                r.draft_token_ids = [rng.randrange(2, 60) for _ in range(rng.randint(0, 4))]
        sched = s.schedule()
        assert sched.total_num_tokens <= 24
        s.update(sched, speculative_run(sched, rng))
        s.kv.pool.check_invariants()
        for r in s.running:
            assert len(r.block_ids) == s.kv.blocks_needed(r.num_computed_tokens)
            assert r.num_computed_tokens == r.num_tokens - 1 or r.num_remaining_prefill > 1
            assert not r.draft_token_ids
        for block, block_hash in enumerate(s.kv.pool.block_hash):
            if block_hash is not None:  # only blocks of accepted tokens are in the cache
                owners = [r for r in s.running if block in r.block_ids]
                for r in owners:
                    i = r.block_ids.index(block)
                    assert r.block_hashes[i] == block_hash and (i + 1) * 4 <= r.num_tokens
    assert s.kv.pool.num_used_blocks == 0


def test_max_tokens_and_stops_hold_inside_accepted_drafts():
    s = make_scheduler(budget=64)
    r = make_request("a", prompt_len=4, max_tokens=3)
    s.add_request(r)
    sched = s.schedule()
    s.update(sched, RunnerOutput(sampled_token_ids={"a": [20]}))
    r.draft_token_ids = [21, 22, 23, 24]
    sched = s.schedule()
    assert sched.num_scheduled_tokens == [5] and sched.num_draft_tokens == [4]
    s.update(sched, RunnerOutput(sampled_token_ids={"a": [21, 22, 23, 24, 25]}))
    assert r.output_token_ids == [20, 21, 22] and r.finish_reason == "length"
    assert s.kv.pool.num_used_blocks == 0


def test_ngram_lookup_continues_the_latest_earlier_occurrence():
    ngram = NgramProposer(ngram_min=1, ngram_max=3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram.lookup(tokens, 2) == [7, 8]          # "1 2 3" last seen before ... 7 8
    assert ngram.lookup([5, 6, 5], 3) == [6, 5]        # n = 1: after the earlier 5
    assert ngram.lookup([1, 2, 3, 4], 2) == []          # nothing repeats


def test_policy_speculates_only_when_the_step_cost_is_flat():
    policy = SpeculationPolicy(k_max=4, prior_acceptance=0.8)
    for tokens in (1, 5, 10, 20, 40):  # memory-bound: 30 ms whatever the batch, + 0.1 ms a token
        policy.observe_step(tokens, 0.030 + 0.0001 * tokens, 0, 0)
    assert policy.choose_k(num_decodes=1, num_candidates=1, other_tokens=0) == 4
    compute_bound = SpeculationPolicy(k_max=4, prior_acceptance=0.8)
    for tokens in (8, 32, 64, 128, 256):  # compute-bound: cost proportional to tokens
        compute_bound.observe_step(tokens, 0.002 * tokens, 0, 0)
    assert compute_bound.choose_k(num_decodes=32, num_candidates=32, other_tokens=0) == 0
    low_acceptance = SpeculationPolicy(k_max=4, prior_acceptance=0.05)
    for tokens in (1, 5, 10, 20, 40):
        low_acceptance.observe_step(tokens, 0.030 + 0.002 * tokens, 0, 0)
    assert low_acceptance.choose_k(num_decodes=8, num_candidates=8, other_tokens=0) == 0


def test_drafts_that_do_not_fit_are_dropped_before_anyone_is_preempted():
    """A full pool: a decode whose drafts would need a new block gets its own token without
    them, rather than preempting another request (or itself) for tokens that may all be
    rejected."""
    s = make_scheduler(num_blocks=2, block_size=4, budget=32)
    a, b = make_request("a", prompt_len=3, max_tokens=8), make_request("b", prompt_len=3, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    sched = s.schedule()
    s.update(sched, RunnerOutput(sampled_token_ids={"a": [20], "b": [21]}))
    assert s.kv.pool.num_free_blocks == 0
    a.draft_token_ids = [22, 23, 24]  # positions 4-6: a second block, and none is free
    sched = s.schedule()
    assert sched.requests == [a, b] and sched.num_scheduled_tokens == [1, 1] and sched.num_draft_tokens == [0, 0]
    assert s.num_preemptions == 0 and not a.draft_token_ids


def test_seeded_sampled_and_biased_requests_do_not_speculate():
    """Same seed, same text in any batch: drafts would draw other numbers from the request's
    generator, and whether a request speculates depends on its batch. Greedy verification reads
    the model's own logits, so a logit_bias would be ignored."""
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.spec_decode import Speculator

    def decoding(params: SamplingParams):
        r = make_request("r", prompt_len=4, max_tokens=8)
        r.params = params
        r.num_computed_tokens = 4
        r.append_token(20, 0.0)
        return r
    assert Speculator.eligible(decoding(SamplingParams(temperature=0.8)))
    assert Speculator.eligible(decoding(SamplingParams(temperature=0.0, seed=1)))
    assert not Speculator.eligible(decoding(SamplingParams(temperature=0.8, seed=1)))
    assert not Speculator.eligible(decoding(SamplingParams(temperature=0.0, logit_bias={5: 100.0})))
    assert not Speculator.eligible(decoding(SamplingParams(temperature=0.0, allowed_token_ids=[5])))
    assert not Speculator.eligible(decoding(SamplingParams(temperature=0.0, bad_words=["x"])))
    assert not Speculator.eligible(decoding(SamplingParams(temperature=0.0, structured_outputs={"regex": "x"})))
