"""Scheduler.snapshot (what the dashboard draws): each block's state and each request's
progress, exactly, for a small pool."""

from __future__ import annotations

from fakes import fake_run, make_scheduler

from tokenmill.kv_cache import BLOCK_CACHED, BLOCK_FREE, BLOCK_OWNED, BLOCK_SHARED, BlockPool
from tokenmill.outputs import RequestProgress
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

FREE, OWN, SHR, CACH = BLOCK_FREE, BLOCK_OWNED, BLOCK_SHARED, BLOCK_CACHED


def request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, params=SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens, eos_token_ids=frozenset({1}))


def step(scheduler) -> None:
    sched = scheduler.schedule()
    scheduler.update(sched, fake_run(sched))


def test_snapshot_gives_a_cached_block_two_shared_two_owned_and_three_free_and_each_requests_progress():
    s = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=2, budget=32, prefix_caching=True)
    # "old" fills block 0 (hashed) and half of block 1, then ends: 0 stays cached (evictable), 1 is free.
    s.add_request(request("old", [200, 201, 202, 203, 204, 205], max_tokens=1))
    step(s)
    assert not s.requests
    # "a" and "b" share an 8-token prefix (blocks 1 and 2); each owns its tail block; "c" finds no seat.
    prefix = [100, 101, 102, 103, 104, 105, 106, 107]
    s.add_request(request("a", prefix + [50, 51]))
    s.add_request(request("b", prefix + [60, 61, 62]))
    s.add_request(request("c", [70, 71, 72, 73, 74]))
    step(s)

    snap = s.snapshot()

    assert snap.block_states == bytes([CACH, SHR, SHR, OWN, OWN, FREE, FREE, FREE])
    assert snap.step == 2 and snap.block_size == 4 and snap.num_preemptions == 0
    assert snap.running == [
        RequestProgress("a", num_prompt_tokens=10, num_computed_tokens=10, num_output_tokens=1, max_tokens=4,
                        num_blocks=3, num_cached_tokens=0, num_preemptions=0, preempted=False),
        RequestProgress("b", num_prompt_tokens=11, num_computed_tokens=11, num_output_tokens=1, max_tokens=4,
                        num_blocks=3, num_cached_tokens=8, num_preemptions=0, preempted=False)]
    assert snap.waiting == [
        RequestProgress("c", num_prompt_tokens=5, num_computed_tokens=0, num_output_tokens=0, max_tokens=4,
                        num_blocks=0, num_cached_tokens=0, num_preemptions=0, preempted=False)]
    assert snap.num_waiting == 1


def test_snapshot_lists_the_first_2_of_5_waiting_requests_and_counts_all_5():
    s = make_scheduler(num_blocks=8, block_size=4)
    for i in range(5):
        s.add_request(request(f"w{i}", [10 + i, 11, 12]))
    snap = s.snapshot(max_waiting=2)
    assert [r.request_id for r in snap.waiting] == ["w0", "w1"] and snap.num_waiting == 5
    assert snap.running == [] and snap.block_states == bytes(8)


def test_snapshot_lists_waiting_requests_in_the_policys_order_not_their_arrival():
    s = make_scheduler(num_blocks=8, block_size=4, policy="priority")
    for i, priority in enumerate([5, 1, 3, 0, 4]):
        r = request(f"w{i}", [10 + i, 11, 12])
        r.priority = priority
        s.add_request(r)
    snap = s.snapshot(max_waiting=3)
    assert [r.request_id for r in snap.waiting] == ["w3", "w1", "w2"] and snap.num_waiting == 5


def test_the_request_preempted_for_lack_of_blocks_waits_marked_preempted_with_no_blocks():
    # 3 blocks of 4 tokens: two 4-token prompts grow until "x" needs a third block and "y" gives way.
    s = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2)
    s.add_request(request("x", [10, 11, 12, 13], max_tokens=8))
    s.add_request(request("y", [20, 21, 22, 23], max_tokens=8))
    while not s.num_preemptions:
        step(s)
    snap = s.snapshot()
    assert [r.request_id for r in snap.running] == ["x"] and snap.running[0].num_blocks == 2
    assert snap.waiting == [RequestProgress("y", num_prompt_tokens=4, num_computed_tokens=0, num_output_tokens=1,
                                            max_tokens=8, num_blocks=0, num_cached_tokens=0, num_preemptions=1,
                                            preempted=True)]
    assert snap.block_states == bytes([OWN, FREE, OWN]) and snap.num_preemptions == 1


def test_block_states_clamp_300_references_to_shared():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.share([blocks[0]] * 299)
    assert pool.block_states() == bytes([SHR, OWN, FREE])
