"""Request timelines: the scheduler's events on a fake clock, and the latencies derived from them."""

from __future__ import annotations

import json

from fakes import FakeClock, fake_run, make_request, make_scheduler

from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.outputs import RunnerOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.scheduler import Scheduler


def step(s: Scheduler, clock: FakeClock) -> None:
    """One step at the next whole second: schedule and update share its time."""
    clock.now += 1.0
    sched = s.schedule()
    s.update(sched, fake_run(sched))


def events(r: Request) -> list[tuple]:
    return [(e.time, e.kind, *e.data.values()) for e in r.timeline.events]


def test_a_chunked_request_records_admission_each_chunk_its_first_token_and_its_end() -> None:
    clock = FakeClock()
    s = make_scheduler(budget=4, clock=clock)
    r = make_request("a", prompt_len=10, max_tokens=3)
    s.add_request(r)
    for _ in range(5):
        step(s, clock)
    assert events(r) == [(0.0, "arrival", 10), (1.0, "admitted", 0), (1.0, "chunk", 1, 4), (2.0, "chunk", 2, 4),
                         (3.0, "chunk", 3, 2), (3.0, "first_token"), (5.0, "finished", "length")]
    assert r.timeline.token_times.tolist() == [3.0, 4.0, 5.0]
    t = r.timeline
    assert (t.queue_time, t.ttft, t.prefill_time, t.decode_time, t.e2e) == (1.0, 3.0, 2.0, 2.0, 5.0)
    assert t.itl() == [1.0, 1.0]


def test_a_recompute_preemption_records_the_discarded_tokens_and_the_resumption() -> None:
    clock = FakeClock()
    s = make_scheduler(budget=32, clock=clock)
    r = make_request("a", prompt_len=8, max_tokens=4)
    s.add_request(r)
    step(s, clock)
    step(s, clock)  # computed: 8 prompt tokens + the first output token
    clock.now = 2.5
    s._preempt(r, "pool_full")
    step(s, clock)  # replays all 10 tokens, samples the third
    assert events(r)[4:] == [(2.5, "preempted", "pool_full", "recompute", 9), (3.5, "resumed", 0),
                             (3.5, "chunk", 3, 10)]
    assert r.num_preemptions == 1 and r.timeline.token_times.tolist() == [1.0, 2.0, 3.5]


def test_tokens_a_resumed_request_finds_in_the_prefix_cache_are_no_prefix_hit() -> None:
    clock = FakeClock()
    s = make_scheduler(budget=32, clock=clock, prefix_caching=True)
    r = make_request("a", prompt_len=8, max_tokens=4)
    s.add_request(r)
    step(s, clock)
    step(s, clock)
    s._preempt(r, "pool_full")
    step(s, clock)
    resumed = r.timeline.events[5]
    assert (resumed.kind, resumed.data) == ("resumed", {"cached": 8})  # its own two full blocks
    assert r.timeline.first("admitted").data == {"cached": 0} and r.num_cached_tokens == 0


def test_a_swap_preemption_records_the_swapped_tokens_and_blocks() -> None:
    clock = FakeClock()
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, kv_watermark=0.0,
                             preemption_mode="swap")
    s = Scheduler(config, KVCacheManager(64, 4, enable_prefix_caching=False, num_host_blocks=16), clock=clock)
    r = make_request("a", prompt_len=8, max_tokens=4)
    s.add_request(r)
    step(s, clock)
    clock.now = 1.5
    s._preempt(r, "admission")
    step(s, clock)
    assert events(r)[4:] == [(1.5, "preempted", "admission", "swap", 8), (2.5, "resumed", 2)]  # two blocks


def test_a_request_aborted_while_waiting_has_no_admission_and_no_first_token() -> None:
    clock = FakeClock()
    s = make_scheduler(clock=clock)
    r = make_request("a", prompt_len=8, arrival=0.5)
    s.add_request(r)
    clock.now = 2.0
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert events(r) == [(0.5, "arrival", 8), (2.0, "finished", "abort")]
    t = r.timeline
    assert (t.queue_time, t.ttft, t.decode_time, t.e2e, t.itl()) == (None, None, None, 1.5, [])


def test_an_abort_mid_decode_ends_the_token_times_at_the_abort() -> None:
    clock = FakeClock()
    s = make_scheduler(clock=clock)
    r = make_request("a", prompt_len=8, max_tokens=20)
    s.add_request(r)
    for _ in range(4):
        step(s, clock)
    clock.now = 7.0
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    step(s, clock)  # later steps add nothing
    assert r.timeline.token_times.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert r.timeline.itl() == [1.0, 1.0, 1.0] and r.timeline.decode_time == 6.0
    assert events(r)[-1] == (7.0, "finished", "abort")


def test_a_speculative_step_records_the_drafts_proposed_and_accepted() -> None:
    clock = FakeClock()
    s = make_scheduler(clock=clock)
    r = make_request("a", prompt_len=8, max_tokens=20)
    s.add_request(r)
    step(s, clock)
    r.draft_token_ids = [40, 41]
    clock.now = 2.0
    sched = s.schedule()
    assert sched.num_scheduled_tokens == [3] and sched.num_draft_tokens == [2]
    s.update(sched, RunnerOutput(sampled_token_ids={"a": [40, 55]}))  # one draft kept, then its own token
    assert events(r)[-1] == (2.0, "spec", 2, 1)
    assert r.timeline.token_times.tolist() == [1.0, 2.0, 2.0]
    assert r.timeline.itl() == [1.0, 0.0]


def test_the_json_form_lists_events_token_times_and_latencies() -> None:
    clock = FakeClock()
    s = make_scheduler(budget=4, clock=clock)
    r = make_request("a", prompt_len=6, max_tokens=2)
    s.add_request(r)
    for _ in range(3):
        step(s, clock)
    d = json.loads(json.dumps(r.timeline.as_dict()))
    assert d["events"][:3] == [{"time": 0.0, "event": "arrival", "prompt_tokens": 6},
                               {"time": 1.0, "event": "admitted", "cached": 0},
                               {"time": 1.0, "event": "chunk", "step": 1, "tokens": 4}]
    assert d["events"][-1] == {"time": 3.0, "event": "finished", "finish_reason": "length"}
    assert d["token_times"] == [2.0, 3.0]
    assert d["latency"] == {"queue_time": 1.0, "ttft": 2.0, "prefill_time": 1.0, "decode_time": 1.0, "e2e": 3.0}
