"""Scheduling policies on the same arrivals, the starvation guard, the admission watermark,
and preemption by swapping (fake model)."""

from __future__ import annotations

import pytest
from fakes import FakeClock, fake_run, make_request, make_scheduler, run_to_completion

from tokenmill.request import RequestStatus


def arrivals():
    """a, b, c arrive in that order; they differ in priority, prompt length and deadline."""
    return [make_request("a", prompt_len=30, max_tokens=2, arrival=0.0, priority=2, deadline=10.0),
            make_request("b", prompt_len=10, max_tokens=2, arrival=1.0, priority=0, deadline=30.0),
            make_request("c", prompt_len=20, max_tokens=2, arrival=2.0, priority=1, deadline=5.0)]


def service_order(policy: str, clock: FakeClock | None = None) -> list[str]:
    s = make_scheduler(policy=policy, max_num_seqs=1, budget=64, clock=clock or FakeClock())
    for r in arrivals():
        s.add_request(r)
    order = []
    while s.has_unfinished_requests():
        sched = s.schedule()
        for r in sched.requests:
            if r.request_id not in order:
                order.append(r.request_id)
        s.update(sched, fake_run(sched))
    return order


@pytest.mark.parametrize("policy, expected", [
    ("fcfs", ["a", "b", "c"]),       # arrival order
    ("priority", ["b", "c", "a"]),   # lower priority value first
    ("srpf", ["b", "c", "a"]),       # shortest remaining prompt first: 10, 20, 30
    ("edf", ["c", "a", "b"]),        # earliest deadline first: 5, 10, 30
])
def test_each_policy_orders_the_same_arrivals(policy, expected):
    assert service_order(policy) == expected


def test_edf_records_missed_deadlines():
    clock = FakeClock()
    s = make_scheduler(policy="edf", max_num_seqs=1, budget=64, clock=clock)
    for r in arrivals():
        s.add_request(r)
    while s.has_unfinished_requests():
        clock.now += 4.0  # every step takes 4 s of (fake) time
        sched = s.schedule()
        s.update(sched, fake_run(sched))
    assert s.num_missed_deadlines == 2 == s.stats().num_missed_deadlines  # c ends at 8 (> 5), a at 16 (> 10),
    # b at 24 (< 30)


def test_starving_requests_win_over_the_policy():
    clock = FakeClock()
    clock.now = 100.0  # a has waited 100 s (> starvation_seconds = 30), b and c too, oldest first
    assert service_order("priority", clock) == ["a", "b", "c"]


@pytest.mark.parametrize("policy, victim", [("fcfs", "c"), ("priority", "a"), ("srpf", "a"), ("edf", "b")])
def test_each_policy_picks_its_preemption_victim(policy, victim):
    s = make_scheduler(policy=policy, max_num_seqs=3, budget=256)
    for r in arrivals():
        s.add_request(r)
    s.schedule()  # all three admitted, in policy order
    for r in s.running:
        r.num_computed_tokens = r.num_tokens - 1  # all decoding (1 token left each)...
    s.requests["a"].num_computed_tokens = 0       # ...but a, which has its whole prompt left
    assert s._pick_victim(exclude={}).request_id == victim


def test_under_priority_the_low_priority_request_is_preempted_even_if_admitted_first():
    """Both decode and cross a block boundary in the same step with one block left: the
    high-priority request takes it, whatever the admission order, and the low one is preempted."""
    s = make_scheduler(policy="priority", num_blocks=5, block_size=4, budget=64)
    low = make_request("low", prompt_len=7, max_tokens=12, arrival=0.0, priority=10)
    high = make_request("high", prompt_len=7, max_tokens=12, arrival=1.0, priority=0)
    s.add_request(low)
    s.update(sched := s.schedule(), fake_run(sched))      # low admitted first (2 blocks)
    s.add_request(high)
    preempted = []
    while s.has_unfinished_requests():
        sched = s.schedule()
        preempted += sched.preempted_request_ids
        s.update(sched, fake_run(sched))
    assert preempted and set(preempted) == {"low"} and high.num_preemptions == 0


def test_watermark_holds_back_admission_but_never_starves_an_empty_batch():
    s = make_scheduler(num_blocks=20, block_size=4, budget=200, kv_watermark=0.25)  # 5 blocks reserve
    big = make_request("big", prompt_len=60, max_tokens=2)  # 15 blocks + growth
    s.add_request(big)
    s.schedule()
    assert big.status == RequestStatus.RUNNING  # empty batch: admitted despite the watermark
    small = make_request("small", prompt_len=4, max_tokens=2)
    s.add_request(small)
    sched = s.schedule()
    assert small.status == RequestStatus.WAITING  # 4 free blocks, 1 needed, 5 reserved
    assert [r.request_id for r in sched.requests] == ["big"]


def test_swap_preemption_keeps_computed_tokens_and_copies_blocks_back():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, max_num_seqs=4, preemption_mode="swap")
    from tokenmill.kv_cache import KVCacheManager
    s.kv = KVCacheManager(6, 4, enable_prefix_caching=False, num_host_blocks=16)
    a = make_request("a", prompt_len=8, max_tokens=12, arrival=0.0)
    b = make_request("b", prompt_len=8, max_tokens=12, arrival=1.0)
    s.add_request(a)
    s.add_request(b)
    swaps_out, swaps_in, prefill_after_preemption = [], [], 0
    while s.has_unfinished_requests():
        sched = s.schedule()
        swaps_out += sched.swap_out
        swaps_in += sched.swap_in
        if swaps_out:
            prefill_after_preemption += sched.num_prefill_tokens
        s.update(sched, fake_run(sched))
        s.kv.pool.check_invariants()
        s.kv.host_pool.check_invariants()
    assert swaps_out and len(swaps_in) == len(swaps_out)  # every block that went out came back
    assert prefill_after_preemption == 0  # nothing recomputed: the swapped blocks came back
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert s.kv.host_pool.num_used_blocks == 0 and s.kv.pool.num_used_blocks == 0


def test_aborting_a_swapped_request_frees_its_host_blocks():
    s = make_scheduler(num_blocks=4, block_size=4, budget=64, preemption_mode="swap")
    from tokenmill.kv_cache import KVCacheManager
    s.kv = KVCacheManager(4, 4, enable_prefix_caching=False, num_host_blocks=8)
    s.add_request(make_request("a", prompt_len=7, max_tokens=10, arrival=0.0))
    s.add_request(make_request("b", prompt_len=7, max_tokens=10, arrival=1.0))
    while not s.requests["b"].swapped_block_ids:
        sched = s.schedule()
        s.update(sched, fake_run(sched))
    assert s.kv.host_pool.num_used_blocks > 0
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert s.kv.host_pool.num_used_blocks == 0
    run_to_completion(s)
    assert s.kv.pool.num_used_blocks == 0


def admit_low_then_high(s, high_prompt_len: int = 4, high_priority: int = 0):
    """Two low-priority requests (priorities 5 and 9) decode; a high-priority one arrives."""
    for rid, prio in (("low5", 5), ("low9", 9)):
        s.add_request(make_request(rid, prompt_len=4, max_tokens=20, priority=prio, ignore_eos=True))
    for _ in range(3):
        s.update(sched := s.schedule(), fake_run(sched))
    high = make_request("high", prompt_len=high_prompt_len, max_tokens=3, arrival=1.0, priority=high_priority)
    s.add_request(high)
    return high


def test_priority_preempts_the_lowest_to_admit_a_more_urgent_request_at_max_num_seqs():
    s = make_scheduler(policy="priority", max_num_seqs=2, budget=64)
    high = admit_low_then_high(s)
    sched = s.schedule()
    assert sched.preempted_request_ids == ["low9"]  # the lowest priority, not the one admitted last
    assert high in sched.requests and s.requests["low9"] not in sched.requests  # not readmitted at once
    s.update(sched, fake_run(sched))
    steps = run_to_completion(s)
    # the victim comes back only once high is done: it waits behind the request that preempted it
    back = next(i for i, st in enumerate(steps) if any(r.request_id == "low9" for r in st.requests))
    done = max(i for i, st in enumerate(steps) if high in st.requests)
    assert high.num_output_tokens == 3 and high.num_preemptions == 0 and back > done


def test_priority_preempts_as_many_as_it_takes_for_blocks():
    # 10 blocks of 4: low5 and low9 hold 2 each after 3 steps (6 tokens computed); high needs 9
    s = make_scheduler(policy="priority", num_blocks=10, block_size=4, max_num_seqs=8, budget=64)
    high = admit_low_then_high(s, high_prompt_len=36)
    sched = s.schedule()
    assert sched.preempted_request_ids == ["low9", "low5"] and high in sched.requests
    everyone = list(s.requests.values())
    s.update(sched, fake_run(sched))
    run_to_completion(s, check=lambda sc: sc.kv.pool.check_invariants())
    assert all(r.num_output_tokens == r.max_tokens for r in everyone)  # nothing lost


def test_priority_preempts_nobody_when_that_would_not_make_room():
    s = make_scheduler(policy="priority", num_blocks=10, block_size=4, max_num_seqs=8, budget=64)
    high = admit_low_then_high(s, high_prompt_len=44)  # 11 blocks: more than the whole pool frees
    sched = s.schedule()
    assert sched.preempted_request_ids == [] and high.status == RequestStatus.WAITING
    assert s.num_preemptions == 0


@pytest.mark.parametrize("policy, high_priority", [("priority", 9), ("fcfs", 0)])
def test_equal_priority_or_another_policy_never_preempts_to_admit(policy, high_priority):
    s = make_scheduler(policy=policy, max_num_seqs=2, budget=64)
    high = admit_low_then_high(s, high_priority=high_priority)
    steps = run_to_completion(s)
    assert s.num_preemptions == 0 and not any(st.preempted_request_ids for st in steps)
    assert high.num_output_tokens == 3


@pytest.mark.parametrize("policy, first", [("priority", "urgent"), ("fcfs", "victim")])
def test_a_preempted_request_waits_behind_more_urgent_ones_only_under_priority(policy, first):
    s = make_scheduler(policy=policy)
    victim = make_request("victim", prompt_len=4, arrival=5.0, priority=9)
    urgent = make_request("urgent", prompt_len=4, arrival=6.0, priority=3)
    s.add_request(victim)
    s.add_request(urgent)
    victim.status = RequestStatus.PREEMPTED
    assert s._next_waiting().request_id == first
