"""Each scheduling policy alone: orderings, victims and budget rule on hand-built requests
(no scheduler, no pool)."""

from __future__ import annotations

import pytest
from fakes import make_request

from tokenmill.config import SCHEDULING_POLICIES, SchedulerConfig
from tokenmill.policies import (
    POLICIES,
    EdfPolicy,
    FcfsPolicy,
    PriorityPolicy,
    SchedulingPolicy,
    SrpfPolicy,
    make_policy,
)
from tokenmill.request import Request, RequestStatus

STARVE = 30.0  # starvation_seconds of every policy below
NOW = 10.0     # the time the waiting orders are taken at: nobody starves unless arrival <= -20


def req(request_id: str, prompt_len: int = 8, arrival: float = 0.0, **kwargs) -> Request:
    return make_request(request_id, prompt_len=prompt_len, arrival=arrival, **kwargs)


def decoding(request: Request) -> Request:
    """The request with its whole prompt computed: one token left, a decode."""
    request.num_computed_tokens = request.num_tokens - 1
    return request


def preempted(request: Request) -> Request:
    request.status = RequestStatus.PREEMPTED
    return request


def admission_order(policy: SchedulingPolicy, waiting: list[Request], now: float = NOW) -> list[str]:
    """The order in which `policy` would admit `waiting`, one at a time."""
    left, order = list(waiting), []
    while left:
        chosen = policy.next_waiting(left, now)
        order.append(chosen.request_id)
        left.remove(chosen)
    return order


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


# ---- the factory ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, cls", [("fcfs", FcfsPolicy), ("priority", PriorityPolicy),
                                       ("srpf", SrpfPolicy), ("edf", EdfPolicy)])
def test_the_factory_makes_the_policy_named_with_the_starvation_limit_given(name, cls):
    policy = make_policy(name, starvation_seconds=12.5)
    assert type(policy) is cls and policy.name == name and policy.starvation_seconds == 12.5


def test_the_factory_knows_exactly_the_policies_the_config_accepts():
    assert sorted(POLICIES) == sorted(SCHEDULING_POLICIES) == ["edf", "fcfs", "priority", "srpf"]


def test_an_unknown_policy_name_is_a_value_error_from_the_factory_and_the_config():
    with pytest.raises(ValueError, match="'random'"):
        make_policy("random", STARVE)
    with pytest.raises(ValueError, match="'random'"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16, policy="random")


def test_only_priority_preempts_at_admission():
    assert [name for name in SCHEDULING_POLICIES if make_policy(name, STARVE).preempts_at_admission] == ["priority"]


# ---- fcfs -------------------------------------------------------------------------------------

def test_fcfs_admits_in_arrival_order_whatever_the_priority_length_or_deadline():
    waiting = [req("c", arrival=3.0, priority=0, prompt_len=2, deadline=1.0),
               req("a", arrival=1.0, priority=9, prompt_len=50),
               req("b", arrival=2.0)]
    assert admission_order(FcfsPolicy(STARVE), waiting) == ["a", "b", "c"]


def test_fcfs_runs_decodes_first_then_prompt_chunks_each_in_admission_order_not_arrival():
    # admitted x, y, z, w; y and w were readmitted after a preemption, so arrived before x
    running = [req("x", arrival=5.0), decoding(req("y", arrival=1.0)),
               decoding(req("z", arrival=6.0)), req("w", arrival=0.0)]
    assert ids(FcfsPolicy(STARVE).running_order(running)) == ["y", "z", "x", "w"]


def test_fcfs_preempts_the_latest_admitted_even_if_it_arrived_first():
    candidates = [req("x", arrival=5.0), req("y", arrival=6.0), req("z", arrival=0.0)]
    assert FcfsPolicy(STARVE).pick_victim(candidates).request_id == "z"


def test_no_policy_picks_a_victim_among_no_candidates():
    assert [make_policy(name, STARVE).pick_victim([]) for name in SCHEDULING_POLICIES] == [None] * 4


def test_fcfs_holds_a_long_prompt_back_for_every_decode_and_offers_no_admission_victims():
    policy = FcfsPolicy(STARVE)
    long_prompt = req("long", prompt_len=100, priority=0)
    decodes = [decoding(req("d1", priority=5)), decoding(req("d2", priority=9))]
    assert policy.decodes_ahead_of(long_prompt, decodes) == 2
    assert policy.admission_victims(long_prompt, decodes) == []


# ---- priority -------------------------------------------------------------------------------

def test_priority_admits_by_priority_then_arrival():
    waiting = [req("late-urgent", arrival=3.0, priority=0), req("early-lax", arrival=0.0, priority=2),
               req("early-urgent", arrival=1.0, priority=0), req("mid", arrival=2.0, priority=1)]
    assert admission_order(PriorityPolicy(STARVE), waiting) == ["early-urgent", "late-urgent", "mid", "early-lax"]


def test_under_priority_a_preempted_request_comes_first_only_among_its_own_priority():
    waiting = [preempted(req("victim", arrival=5.0, priority=1)), req("urgent", arrival=6.0, priority=0),
               req("peer", arrival=0.0, priority=1)]
    assert admission_order(PriorityPolicy(STARVE), waiting) == ["urgent", "victim", "peer"]


def test_priority_runs_each_priority_decodes_then_prompt_chunks_before_the_next_priority():
    running = [req("p1-prompt", arrival=0.0, priority=1), decoding(req("p1-decode", arrival=1.0, priority=1)),
               req("p0-prompt", arrival=2.0, priority=0), decoding(req("p0-decode-late", arrival=4.0, priority=0)),
               decoding(req("p0-decode", arrival=3.0, priority=0))]
    assert ids(PriorityPolicy(STARVE).running_order(running)) == [
        "p0-decode", "p0-decode-late", "p0-prompt", "p1-decode", "p1-prompt"]


def test_priority_preempts_the_least_urgent_then_the_latest_arrival_then_the_latest_admitted():
    policy = PriorityPolicy(STARVE)
    assert policy.pick_victim([req("p9", priority=9), req("p1", priority=1, arrival=5.0)]).request_id == "p9"
    assert policy.pick_victim([req("late", priority=3, arrival=2.0),
                               req("early", priority=3, arrival=1.0)]).request_id == "late"
    first, second = req("first", priority=3), req("second", priority=3)
    assert policy.pick_victim([first, second]) is second


def test_priority_lets_a_waiting_request_preempt_only_lower_priorities_lowest_first_ties_latest_admitted():
    running = [req("p5-a", priority=5), req("p2", priority=2), req("p9", priority=9),
               req("p5-b", priority=5), req("p1", priority=1)]
    assert ids(PriorityPolicy(STARVE).admission_victims(req("new", priority=2), running)) == ["p9", "p5-b", "p5-a"]


def test_priority_holds_a_long_prompt_back_only_for_decodes_at_least_as_urgent():
    decodes = [decoding(req(f"d{p}", priority=p)) for p in (0, 1, 1, 2, 3)]
    policy = PriorityPolicy(STARVE)
    assert [policy.decodes_ahead_of(req("long", prompt_len=100, priority=p), decodes)
            for p in (0, 1, 2, 3, 4)] == [1, 3, 4, 5, 5]


# ---- srpf -------------------------------------------------------------------------------------

def test_srpf_admits_the_shortest_remaining_prompt_first_ties_by_arrival():
    waiting = [req("30", prompt_len=30, arrival=0.0), req("10-late", prompt_len=10, arrival=2.0),
               req("10", prompt_len=10, arrival=1.0), req("20", prompt_len=20, arrival=0.5)]
    assert admission_order(SrpfPolicy(STARVE), waiting) == ["10", "10-late", "20", "30"]


def test_srpf_counts_the_output_a_replay_must_recompute_and_not_what_is_computed():
    replay = req("replay", prompt_len=6)
    for token in (5, 6, 7, 8):
        replay.append_token(token, 0.0)        # 6 prompt + 4 output tokens, counter back at 0
    half_done = req("half", prompt_len=16)
    half_done.num_computed_tokens = 8         # 8 left
    policy = SrpfPolicy(STARVE)
    assert policy.rank(replay) == (10, 0.0) and policy.rank(half_done) == (8, 0.0)
    assert ids(policy.running_order([replay, half_done, decoding(req("dec", prompt_len=40))])) == [
        "dec", "half", "replay"]


def test_srpf_preempts_the_request_with_the_most_left_to_compute():
    candidates = [decoding(req("dec", prompt_len=40)), req("short", prompt_len=5), req("long", prompt_len=20)]
    assert SrpfPolicy(STARVE).pick_victim(candidates).request_id == "long"


# ---- edf --------------------------------------------------------------------------------------

def test_edf_admits_the_earliest_deadline_first_and_requests_without_one_last():
    waiting = [req("none", arrival=0.0), req("d30", arrival=1.0, deadline=30.0),
               req("d5", arrival=2.0, deadline=5.0), req("none-late", arrival=3.0),
               req("d5-early", arrival=0.5, deadline=5.0)]
    assert admission_order(EdfPolicy(STARVE), waiting) == ["d5-early", "d5", "d30", "none", "none-late"]


def test_edf_runs_decodes_first_by_deadline_and_preempts_the_latest_deadline():
    running = [req("prompt-d1", deadline=1.0), decoding(req("dec-d9", deadline=9.0)),
               decoding(req("dec-d2", deadline=2.0)), req("prompt-none")]
    policy = EdfPolicy(STARVE)
    assert ids(policy.running_order(running)) == ["dec-d2", "dec-d9", "prompt-d1", "prompt-none"]
    assert policy.pick_victim(running).request_id == "prompt-none"
    assert policy.pick_victim(running[:3]).request_id == "dec-d9"


# ---- preempted and starving requests, every policy ----------------------------------------

@pytest.mark.parametrize("name", ["fcfs", "srpf", "edf"])
def test_outside_priority_preempted_requests_come_first_then_starving_ones_each_oldest_first(name):
    waiting = [req("fresh", arrival=9.0, prompt_len=1, deadline=0.0),
               req("starving-late", arrival=-25.0), req("starving", arrival=-30.0),
               preempted(req("preempted-late", arrival=8.0)), preempted(req("preempted", arrival=7.0))]
    assert admission_order(make_policy(name, STARVE), waiting) == [
        "preempted", "preempted-late", "starving", "starving-late", "fresh"]


def test_under_priority_starving_requests_come_first_even_before_preempted_or_more_urgent_ones():
    waiting = [preempted(req("preempted", arrival=7.0, priority=0)), req("urgent", arrival=9.0, priority=0),
               req("starving-late", arrival=-25.0, priority=5), req("starving", arrival=-30.0, priority=9)]
    assert admission_order(PriorityPolicy(STARVE), waiting) == ["starving", "starving-late", "preempted", "urgent"]


def test_a_request_starves_exactly_when_it_has_waited_starvation_seconds():
    policy = FcfsPolicy(STARVE)
    assert policy.is_starving(req("r", arrival=0.0), now=30.0)
    assert not policy.is_starving(req("r", arrival=0.0), now=29.5)
