"""Scheduler with a fake model: decode-first, the budget, chunking, finish-and-admit,
preemption and requeue, static batching. Exact expectations, no torch."""

from __future__ import annotations

import pytest
from fakes import fake_vector, make_embedding_request, make_request, make_scheduler, run_to_completion

from tokenmill.config import EngineConfig, SchedulerConfig
from tokenmill.request import RequestStatus


def step(scheduler):
    from fakes import fake_run
    sched = scheduler.schedule()
    scheduler.update(sched, fake_run(sched))
    return sched


def scheduled(sched) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(sched.requests, sched.num_scheduled_tokens)}


def test_prompt_is_chunked_by_the_budget_then_decodes():
    s = make_scheduler(budget=10)
    s.add_request(make_request("a", prompt_len=25, max_tokens=3))
    assert scheduled(step(s)) == {"a": 10}
    assert scheduled(step(s)) == {"a": 10}
    last_chunk = step(s)
    assert scheduled(last_chunk) == {"a": 5}
    assert s.requests["a"].num_output_tokens == 1  # the chunk that reaches the end samples
    assert scheduled(step(s)) == {"a": 1}


def test_decodes_go_first_and_prompt_chunks_fill_the_rest():
    s = make_scheduler(budget=10)
    s.add_request(make_request("a", prompt_len=3, max_tokens=20))
    s.add_request(make_request("b", prompt_len=4, max_tokens=20))
    step(s)  # both prompts fit in one step (3 + 4 <= 10)
    s.add_request(make_request("c", prompt_len=50, max_tokens=5))
    sched = step(s)
    assert [r.request_id for r in sched.requests] == ["a", "b", "c"]
    assert sched.num_scheduled_tokens == [1, 1, 8]
    assert sched.num_decode_tokens == 2 and sched.num_prefill_tokens == 8
    # Next step: decodes still first, the partial prompt keeps its place after them.
    sched = step(s)
    assert sched.num_scheduled_tokens == [1, 1, 8]


def test_every_step_respects_budget_and_max_num_seqs():
    s = make_scheduler(budget=16, max_num_seqs=3, num_blocks=256)
    for i in range(10):
        s.add_request(make_request(f"r{i}", prompt_len=5 + 7 * i, max_tokens=6))
    steps = run_to_completion(s)
    assert all(sched.total_num_tokens <= 16 for sched in steps)
    assert all(len(sched.requests) <= 3 for sched in steps)
    assert s.kv.pool.num_used_blocks == 0


def test_finished_request_leaves_in_its_step_and_a_waiting_one_joins_next():
    s = make_scheduler(max_num_seqs=1, budget=32)
    s.add_request(make_request("a", prompt_len=4, max_tokens=2))
    s.add_request(make_request("b", prompt_len=4, max_tokens=2))
    assert scheduled(step(s)) == {"a": 4}      # a: prompt, samples token 1
    assert scheduled(step(s)) == {"a": 1}      # a: samples token 2 and finishes
    assert s.requests.get("a") is None and s.running == []
    assert s.kv.pool.num_used_blocks == 0      # its blocks are back at once
    assert scheduled(step(s)) == {"b": 4}      # b joins in the very next step


def test_preemption_frees_the_latest_admitted_and_requeues_it_first():
    # 6 blocks of 4 tokens. a and b each need 2 blocks for their prompt, then grow.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, max_num_seqs=4)
    a = make_request("a", prompt_len=8, max_tokens=12, arrival=0.0)
    b = make_request("b", prompt_len=8, max_tokens=12, arrival=1.0)
    c = make_request("c", prompt_len=4, max_tokens=2, arrival=2.0)
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # a: 2 blocks, b: 2 blocks, c: 1 block (pool 5/6)
    assert a.status == b.status == c.status == RequestStatus.RUNNING
    steps = run_to_completion(s, check=lambda sch: sch.kv.pool.check_invariants())
    preempted = [rid for sched in steps for rid in sched.preempted_request_ids]
    assert preempted[:2] == ["c", "b"]  # latest admitted first, and again when a still needs room
    assert b.num_preemptions >= 1
    for r in (a, b, c):
        assert r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert s.kv.pool.num_used_blocks == 0


def test_preempted_request_is_readmitted_before_newer_waiting_ones():
    s = make_scheduler(num_blocks=4, block_size=4, budget=64, max_num_seqs=4)
    s.add_request(make_request("a", prompt_len=7, max_tokens=6, arrival=0.0))
    s.add_request(make_request("b", prompt_len=7, max_tokens=6, arrival=1.0))
    steps = [step(s) for _ in range(3)]  # 8 tokens fill 2 blocks each; the 9th needs a third
    assert [sched.preempted_request_ids for sched in steps] == [[], [], ["b"]]
    s.add_request(make_request("c", prompt_len=1, max_tokens=1, arrival=2.0))
    assert s._next_waiting().request_id == "b"


def test_replayed_tokens_are_identical_after_preemption():
    """Recompute replays prompt + output: the fake model's outputs must not change."""
    def outputs(num_blocks):
        s = make_scheduler(num_blocks=num_blocks, block_size=4, budget=8, max_num_seqs=4)
        reqs = [make_request(f"r{i}", prompt_len=3 + 5 * i, max_tokens=10, arrival=float(i)) for i in range(4)]
        for r in reqs:
            s.add_request(r)
        run_to_completion(s, check=lambda sch: sch.kv.pool.check_invariants())
        return [r.output_token_ids for r in reqs], s.num_preemptions
    roomy, n0 = outputs(256)
    tight, n1 = outputs(8)
    assert n0 == 0 and n1 > 0
    assert tight == roomy


def test_abort_anywhere_returns_every_block():
    s = make_scheduler(num_blocks=16, block_size=4, budget=6)
    s.add_request(make_request("running", prompt_len=5, max_tokens=50))
    s.add_request(make_request("prefilling", prompt_len=30, max_tokens=5))
    s.add_request(make_request("waiting", prompt_len=5, max_tokens=5))
    step(s)
    step(s)
    assert s.requests["prefilling"].num_computed_tokens > 0
    for rid in ("prefilling", "running", "waiting"):
        s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        s.kv.pool.check_invariants()
    assert s.kv.pool.num_used_blocks == 0 and not s.has_unfinished_requests()
    assert s.schedule().finished_request_ids == ["prefilling", "running", "waiting"]


def test_stop_conditions():
    s = make_scheduler()
    r = make_request("a", prompt_len=3, max_tokens=5)
    s.add_request(r)
    run_to_completion(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 5
    # max_model_len caps the sequence even when max_tokens would allow more.
    s = make_scheduler(max_model_len=6)
    r = make_request("b", prompt_len=3, max_tokens=50)
    s.add_request(r)
    run_to_completion(s)
    assert r.num_tokens == 6 and r.finish_reason == "length"


def test_eos_stops_unless_ignored_or_under_min_tokens():
    from tokenmill.outputs import RunnerOutput
    s = make_scheduler()
    r = make_request("a", prompt_len=3, max_tokens=10)
    r.params.min_tokens = 2
    s.add_request(r)
    # EOS may come at the earliest as token min_tokens + 1 (the sampler masks it before that).
    for expected_finished in (False, False, True):
        sched = s.schedule()
        s.update(sched, RunnerOutput(sampled_token_ids={"a": [1]}))  # EOS
        assert r.is_finished == expected_finished
    assert r.finish_reason == "stop" and r.output_token_ids == [1, 1, 1]


def test_eos_as_the_last_token_allowed_ends_by_length():
    """As in vLLM, length is checked first: an EOS that is also the max_tokens-th token ends the
    request by length (its text, if any, is kept)."""
    from tokenmill.outputs import RunnerOutput
    s = make_scheduler()
    r = make_request("a", prompt_len=3, max_tokens=2)
    s.add_request(r)
    for token in (20, 1):
        s.update(s.schedule(), RunnerOutput(sampled_token_ids={"a": [token]}))
    assert r.finish_reason == "length" and r.output_token_ids == [20, 1]


def test_static_batching_admits_only_into_an_empty_batch():
    s = make_scheduler(static_batching=True, max_num_seqs=2, budget=4)
    s.add_request(make_request("a", prompt_len=10, max_tokens=2))
    s.add_request(make_request("b", prompt_len=6, max_tokens=5))
    s.add_request(make_request("c", prompt_len=6, max_tokens=5))
    first = step(s)
    assert scheduled(first) == {"a": 10, "b": 6}  # whole prompts, no chunking
    while "a" in s.requests:
        assert "c" not in scheduled(step(s))
    while "b" in s.requests:  # a finished, but c waits until the whole batch is done
        assert "c" not in scheduled(step(s))
    assert scheduled(step(s)) == {"c": 6}


def test_duplicate_request_id_is_rejected():
    s = make_scheduler()
    s.add_request(make_request("a", prompt_len=3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("a", prompt_len=3))


def test_long_prompt_chunks_are_capped_while_others_decode():
    s = make_scheduler(num_blocks=200, budget=100, max_num_seqs=40,
                       long_prefill_token_threshold=50, long_prefill_min_chunk=8)
    s.add_request(make_request("short", prompt_len=5, max_tokens=60))
    s.add_request(make_request("long", prompt_len=300, max_tokens=2))
    first = step(s)
    assert scheduled(first) == {"short": 5, "long": 95}  # nobody decodes yet: the full budget
    second = step(s)
    assert scheduled(second) == {"short": 1, "long": 8}  # short decodes: the long prompt trickles
    for i in range(30):  # more decoders: the long prompt's share grows to half their number
        s.add_request(make_request(f"d{i}", prompt_len=1, max_tokens=60))
    step(s)
    assert scheduled(step(s))["long"] == 31 // 2
    left, chunks = 300 - 95 - 8 - 8 - 15, []
    while sum(chunks) < left:  # its last chunks stay capped too
        chunks.append(scheduled(step(s))["long"])
    assert chunks[:-1] == [15] * (len(chunks) - 1) and chunks[-1] == left - 15 * (len(chunks) - 1)


def test_prompts_within_the_threshold_or_with_threshold_zero_are_not_capped():
    for threshold, prompt_len in ((50, 40), (0, 300)):
        s = make_scheduler(num_blocks=200, budget=100, long_prefill_token_threshold=threshold,
                           long_prefill_min_chunk=8)
        s.add_request(make_request("short", prompt_len=5, max_tokens=20))
        step(s)
        s.add_request(make_request("other", prompt_len=prompt_len, max_tokens=2))
        assert scheduled(step(s)) == {"short": 1, "other": min(prompt_len, 99)}


def test_long_prompts_share_one_allowance_per_step():
    s = make_scheduler(num_blocks=400, budget=100, max_num_seqs=10, long_prefill_token_threshold=50,
                       long_prefill_min_chunk=8)
    s.add_request(make_request("short", prompt_len=5, max_tokens=60))
    step(s)
    for i in range(3):
        s.add_request(make_request(f"long{i}", prompt_len=300, max_tokens=2))
    assert scheduled(step(s)) == {"short": 1, "long0": 8}  # the others wait: the share is spent
    s.add_request(make_request("late", prompt_len=3, max_tokens=2))
    # long0 takes the share again; admission stops at long1 (FCFS), so "late" waits behind it
    assert scheduled(step(s)) == {"short": 1, "long0": 8}


def test_a_replay_after_preemption_counts_its_output_toward_long():
    """Recompute replays prompt + output: a short prompt with a long output replays held back."""
    s = make_scheduler(num_blocks=400, budget=100, long_prefill_token_threshold=50, long_prefill_min_chunk=8)
    s.add_request(make_request("short", prompt_len=5, max_tokens=200, ignore_eos=True))
    s.add_request(make_request("r", prompt_len=30, max_tokens=200, ignore_eos=True))
    for _ in range(30):
        step(s)
    r = s.requests["r"]
    s._preempt(r, "pool_full")
    assert r.num_computed_tokens == 0 and r.num_tokens > 50
    assert scheduled(step(s))["r"] == 8


@pytest.mark.parametrize("field", ["long_prefill_token_threshold", "long_prefill_min_chunk"])
def test_bad_long_prefill_settings_are_rejected(field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=64, **{field: -1})


def test_engine_default_threshold_is_one_steps_budget():
    config = SchedulerConfig.from_engine(EngineConfig(max_num_batched_tokens=256), max_model_len=1024)
    assert config.long_prefill_token_threshold == 256
    off = SchedulerConfig.from_engine(EngineConfig(long_prefill_token_threshold=0), max_model_len=1024)
    assert off.long_prefill_token_threshold == 0


def run_ahead(scheduler, check=None) -> dict[str, int]:
    """Async scheduling as the engine runs it: each step is scheduled and launched (advance)
    before the one in flight is updated. Returns the tokens computed for each request."""
    from fakes import fake_token, fake_vector

    from tokenmill.outputs import RunnerOutput
    computed: dict[str, int] = {}
    in_flight = None
    while scheduler.has_unfinished_requests():
        assert len(computed) < 10_000
        sched = scheduler.schedule()
        ends = [r for r, n in zip(sched.requests, sched.num_scheduled_tokens)
                if r.num_computed_tokens + n == r.num_tokens + r.num_pending_tokens]
        result = RunnerOutput({r.request_id: [fake_token(r)] for r in ends if r.pooling is None},
                              pooled={r.request_id: fake_vector(r) for r in ends if r.pooling is not None})
        for r, n in zip(sched.requests, sched.num_scheduled_tokens):
            assert n <= r.num_remaining_prefill
            computed[r.request_id] = computed.get(r.request_id, 0) + n
        scheduler.advance(sched)
        if in_flight is not None:
            scheduler.update(*in_flight, advanced=True)
        in_flight = (sched, result)
        if check is not None:
            check(scheduler)
    return computed


def test_async_scheduling_computes_no_token_past_a_length_end():
    """A request whose in-flight token is its last (max_tokens) is not scheduled again, so
    ending by length costs no step; outputs are as many as asked."""
    s = make_scheduler(budget=10)
    prompts = {"a": 3, "b": 17, "c": 1}
    for rid, n in prompts.items():
        s.add_request(make_request(rid, prompt_len=n, max_tokens=5, ignore_eos=True))
    reqs = dict(s.requests)
    computed = run_ahead(s)
    assert computed == {rid: n + 5 - 1 for rid, n in prompts.items()}
    assert all(r.num_output_tokens == 5 and r.status == RequestStatus.FINISHED_LENGTH for r in reqs.values())
    assert s.kv.pool.num_used_blocks == 0


def test_async_scheduling_preempts_requests_with_a_token_in_flight():
    """Preempted while its token is in flight: the token is still appended, before the request
    can be readmitted (its replayed context must hold it)."""
    s = make_scheduler(num_blocks=10, block_size=4, budget=16)
    for i in range(4):
        s.add_request(make_request(f"r{i}", prompt_len=6, max_tokens=8, ignore_eos=True))
    reqs = dict(s.requests)

    def check(scheduler):
        for r in scheduler.running:
            assert r.num_computed_tokens <= r.num_tokens + r.num_pending_tokens
    run_ahead(s, check)
    assert s.num_preemptions > 0
    assert all(r.num_output_tokens == 8 and r.num_pending_tokens == 0 for r in reqs.values())
    assert s.kv.pool.num_used_blocks == 0


def test_prompt_logprobs_are_merged_by_prompt_index_once_each():
    """A chunk's prompt logprobs extend the request's list at their own index: entries a chunk
    scores again (a recompute launched before the earlier chunk reached the host, under async
    scheduling) are not appended twice."""
    from tokenmill.outputs import RunnerOutput
    from tokenmill.request import Request
    from tokenmill.sampling_params import SamplingParams

    s = make_scheduler(budget=4)
    r = Request(request_id="a", prompt_token_ids=list(range(2, 8)), params=SamplingParams(prompt_logprobs=0),
                max_tokens=2)
    s.add_request(r)
    assert r.prompt_logprobs == [None]
    s.update(s.schedule(), RunnerOutput({}, prompt_logprobs={"a": (1, [{t: -1.0} for t in (3, 4, 5, 6)],
                                                                   [1, 2, 3, 4])}))
    last = s.schedule()  # positions 4 and 5: the rest of the prompt, scored from index 3 again
    s.update(last, RunnerOutput({"a": [9]}, prompt_logprobs={"a": (3, [{5: -2.0}, {6: -2.0}, {7: -2.0}],
                                                                   [30, 40, 50])}))
    assert r.prompt_logprobs == [None, {3: -1.0}, {4: -1.0}, {5: -1.0}, {6: -1.0}, {7: -2.0}]
    assert r.prompt_logprob_ranks == [None, 1, 2, 3, 4, 50]
    assert r.output_token_ids == [9]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_under_priority_an_urgent_prompt_goes_before_less_urgent_decodes(policy):
    """Less urgent requests decode; an urgent long prompt runs beside them. Under priority it takes
    the budget first and is not held back for them (they get what it leaves); under fcfs the
    decodes go first and the long prompt trickles."""
    s = make_scheduler(num_blocks=400, budget=100, max_num_seqs=40, policy=policy,
                       long_prefill_token_threshold=50, long_prefill_min_chunk=8)
    for i in range(10):
        s.add_request(make_request(f"d{i}", prompt_len=1, max_tokens=60, priority=5))
    step(s)  # the decoders are in
    s.add_request(make_request("urgent", prompt_len=300, max_tokens=2, arrival=1.0, priority=0))
    admitted, chunks = scheduled(step(s)), scheduled(step(s))
    if policy == "priority":
        assert admitted["urgent"] == 90  # what the decodes left, not held back for them
        assert chunks["urgent"] == 100 and not any(k.startswith("d") for k in chunks)
    else:
        assert admitted["urgent"] == chunks["urgent"] == 8
        assert sum(v for k, v in chunks.items() if k.startswith("d")) == 10


# ---- embedding requests ----------------------------------------------------------------------

def test_an_embedding_request_runs_its_prompt_in_chunks_samples_nothing_and_stops_with_its_vector():
    s = make_scheduler(budget=10)
    e = make_embedding_request("e", prompt_len=25)
    s.add_request(e)
    steps = [step(s) for _ in range(3)]
    assert [scheduled(sched) for sched in steps] == [{"e": 10}, {"e": 10}, {"e": 5}]
    assert [[r.request_id for r in sched.pooling] for sched in steps] == [["e"], ["e"], ["e"]]
    assert e.status == RequestStatus.FINISHED_STOPPED and e.finish_reason == "stop"
    assert e.output_token_ids == [] and e.embedding == fake_vector(e)
    assert not s.has_unfinished_requests() and s.kv.pool.num_used_blocks == 0


def test_embedding_and_generation_requests_share_steps_and_each_gets_its_own_result():
    s = make_scheduler(budget=16)
    g, e = make_request("g", prompt_len=6, max_tokens=3, ignore_eos=True), make_embedding_request("e", prompt_len=14)
    s.add_request(g)
    s.add_request(e)
    first, second, third = step(s), step(s), step(s)
    assert scheduled(first) == {"g": 6, "e": 10} and first.pooling == [e]
    assert scheduled(second) == {"g": 1, "e": 4} and second.pooling == [e]
    assert scheduled(third) == {"g": 1} and third.pooling == []
    assert e.finish_reason == "stop" and e.output_token_ids == [] and e.embedding == fake_vector(e)
    assert g.finish_reason == "length" and g.num_output_tokens == 3 and g.embedding is None


def test_a_mean_pooled_embedding_takes_nothing_from_the_prefix_cache_and_a_last_pooled_one_does():
    """Mean pooling reads every prompt position's hidden state, so the whole prompt is computed;
    the last token's state needs only the last token (the cache leaves at least one to compute)."""
    s = make_scheduler(budget=64, block_size=4, prefix_caching=True)
    s.add_request(make_request("g", prompt_len=12, max_tokens=1))
    run_to_completion(s)  # its 2 full blocks of prompt stay cached
    s.add_request(make_embedding_request("last", prompt_len=12))
    s.add_request(make_embedding_request("mean", prompt_len=12, pooling="mean"))
    assert scheduled(step(s)) == {"last": 4, "mean": 12}
    assert not s.has_unfinished_requests()


def test_under_async_scheduling_an_embedding_request_holds_no_pending_token_and_ends_at_its_update():
    s = make_scheduler(budget=8)
    s.add_request(make_request("g", prompt_len=4, max_tokens=3, ignore_eos=True))
    e = make_embedding_request("e", prompt_len=12)
    s.add_request(e)

    def check(scheduler):
        assert e.num_pending_tokens == 0 and e.num_computed_tokens <= e.num_tokens
    computed = run_ahead(s, check)
    assert computed == {"g": 4 + 3 - 1, "e": 12}  # its prompt once, nothing after it
    assert e.status == RequestStatus.FINISHED_STOPPED and e.embedding == fake_vector(e)
    assert s.kv.pool.num_used_blocks == 0


def test_an_encoders_request_runs_its_whole_prompt_in_one_step_or_waits_for_one_with_room():
    """Budget 16: a generation request takes 6, the 14-token encoder prompt does not fit the 10 left
    and waits (uncut) with the one behind it; the next step runs it whole beside the decode. Its
    blocks, though cached, give the next one nothing (its tokens depend on the whole prompt)."""
    s = make_scheduler(budget=16, block_size=4, prefix_caching=True)
    g = make_request("g", prompt_len=6, max_tokens=3, ignore_eos=True)
    encoded = [make_embedding_request(name, prompt_len=n) for name, n in (("e", 14), ("f", 2), ("e2", 14))]
    encoded[2].prompt_token_ids[:] = encoded[0].prompt_token_ids
    encoded[2].token_ids[:] = encoded[0].token_ids
    for r in encoded:
        r.bidirectional = True
    for r in (g, *encoded):
        s.add_request(r)
    assert [scheduled(step(s)) for _ in range(3)] == [{"g": 6}, {"g": 1, "e": 14}, {"g": 1, "f": 2}]
    assert scheduled(step(s)) == {"e2": 14} and encoded[2].num_cached_tokens == 0
    assert all(r.finish_reason == "stop" and r.embedding == fake_vector(r) for r in encoded)


def test_a_windowed_request_gives_back_the_blocks_behind_its_window_as_it_grows():
    """Window 8, 4-token blocks, 10-token chunks: before each step the blocks wholly before the
    next query's window (first position computed - 7) go back to the pool, so the request never
    holds more than the window's and the chunk's blocks; its table keeps every position."""
    s = make_scheduler(budget=10, window=8)
    s.add_request(make_request("a", prompt_len=25, max_tokens=6))
    request, held = s.requests["a"], []
    while s.has_unfinished_requests():
        step(s)
        held.append((request.num_released_blocks, s.kv.pool.num_used_blocks))
    # computed before each step c = 0, 10, 20, 25, 26, 27, 28, 29: the next query sees c - 7 on, so
    # (c - 7) // 4 blocks are released and blocks up to the step's last token held; freed when done
    assert held == [(0, 3), (0, 5), (3, 4), (4, 3), (4, 3), (5, 2), (5, 3), (0, 0)]
    assert s.kv.pool.num_free_blocks == 64
