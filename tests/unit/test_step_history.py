"""The dashboard's step history (server/step_history.py), on a fake clock: the last steps' split,
per-second throughput over the last minute, and finished requests' latency percentiles."""

from __future__ import annotations

from array import array

from fakes import FakeClock

from tokenmill.outputs import CompletionOutput, RequestOutput, StepStats
from tokenmill.server.step_history import StepHistory, summary
from tokenmill.timeline import Timeline


def output(rid: str, new_tokens: int, finished: bool = False, token_times=(), arrival: float = 0.0,
           end: float = 0.0) -> RequestOutput:
    timeline = Timeline()
    timeline.add(arrival, "arrival")
    if token_times:
        timeline.add(token_times[0], "first_token")
        timeline.token_times = array("d", token_times)
    if finished:
        timeline.add(end, "finished", finish_reason="length")
    return RequestOutput(rid, None, [5], [CompletionOutput(0, "", [])], finished, new_token_ids=[7] * new_tokens,
                         timeline=timeline)


def test_two_steps_give_their_split_rates_over_60_s_and_one_requests_latencies():
    clock = FakeClock()
    history = StepHistory(clock=clock)
    clock.now = 100.2
    history.on_step(StepStats(num_prefill_tokens=30, num_decode_tokens=2, num_preemptions=1, time_total=0.010),
                    [output("a", 1), output("b", 1, finished=True, token_times=(99.5, 99.7, 100.1), arrival=99.0,
                                            end=100.2)])
    clock.now = 101.5
    history.on_step(StepStats(num_prefill_tokens=0, num_decode_tokens=3, time_total=0.020), [output("a", 3)])
    clock.now = 130.0

    s = summary(history.copy())

    assert s["steps"] == {"prefill": [30, 0], "decode": [2, 3], "preemptions": [1, 0], "ms": [10.0, 20.0]}
    m = s["last_minute"]
    # seconds 71..130: second 100 is index 29, second 101 index 30
    assert m["generated_per_second"][29:31] == [2, 3] and sum(m["generated_per_second"]) == 5
    assert m["prompt_per_second"][29] == 30 and sum(m["prompt_per_second"]) == 30
    assert m["prompt_tokens_per_s"] == 0.5 and m["generation_tokens_per_s"] == 5 / 60
    assert (m["steps"], m["preemptions"], m["requests_finished"]) == (2, 1, 1)
    assert abs(m["mean_step_ms"] - 15.0) < 1e-9 and abs(m["busy"] - 0.030 / 60) < 1e-12
    assert m["ttft"] == {"p50": 0.5, "p95": 0.5, "count": 1}
    assert abs(m["e2e"]["p50"] - 1.2) < 1e-9 and abs(m["itl"]["p50"] - 0.3) < 1e-9


def test_a_minute_later_only_the_second_step_and_no_latency_remain():
    clock = FakeClock()
    history = StepHistory(clock=clock)
    clock.now = 100.2
    history.on_step(StepStats(num_prefill_tokens=30, time_total=0.01),
                    [output("b", 1, finished=True, token_times=(100.0,), arrival=99.0, end=100.2)])
    clock.now = 101.5
    history.on_step(StepStats(num_decode_tokens=3, time_total=0.02), [output("a", 3)])
    clock.now = 160.5
    m = summary(history.copy())["last_minute"]
    # seconds 101..160: second 100 (the prompt, the finished request) has left the window
    assert sum(m["prompt_per_second"]) == 0 and m["generated_per_second"][0] == 3
    assert m["steps"] == 1 and m["requests_finished"] == 0
    assert m["ttft"] == {"p50": None, "p95": None, "count": 0}


def test_an_abort_counts_as_finished_without_a_step_and_a_one_token_request_has_no_itl():
    clock = FakeClock()
    history = StepHistory(clock=clock)
    clock.now = 5.0
    history.on_step(None, [output("x", 0, finished=True, token_times=(4.0,), arrival=3.0, end=5.0)])
    s = summary(history.copy())
    assert s["steps"]["prefill"] == [] and s["last_minute"]["steps"] == 0
    assert s["last_minute"]["requests_finished"] == 1
    assert s["last_minute"]["ttft"]["p50"] == 1.0 and s["last_minute"]["itl"]["count"] == 0


def test_p50_and_p95_are_nearest_rank_over_20_requests():
    clock = FakeClock()
    history = StepHistory(clock=clock)
    clock.now = 50.0
    history.on_step(None, [output(f"r{i}", 0, finished=True, token_times=(float(i + 1),), arrival=0.0, end=49.0)
                           for i in range(20)])
    ttft = summary(history.copy())["last_minute"]["ttft"]
    assert ttft == {"p50": 10.0, "p95": 19.0, "count": 20}


def test_the_bar_chart_keeps_the_last_3_steps_when_told_to_keep_3():
    history = StepHistory(clock=FakeClock(), steps_kept=3)
    for i in range(5):
        history.on_step(StepStats(num_decode_tokens=i, time_total=0.001), [])
    assert summary(history.copy())["steps"]["decode"] == [2, 3, 4]


def test_a_step_of_8_s_counts_busy_in_each_second_it_ran_and_only_inside_the_window():
    clock = FakeClock()
    history = StepHistory(clock=clock)
    clock.now = 95.5
    history.on_step(StepStats(num_decode_tokens=1, time_total=0.5), [])   # seconds 95.0-95.5
    clock.now = 103.5
    history.on_step(StepStats(num_decode_tokens=1, time_total=8.0), [])   # seconds 95.5-103.5, no gap
    m = summary(history.copy())["last_minute"]
    assert abs(m["busy"] - 8.5 / 60) < 1e-12 and abs(m["mean_step_ms"] - 4250.0) < 1e-9
    clock.now = 157.0  # the window is seconds 98..157: 5.5 s of the long step in it
    m = summary(history.copy())["last_minute"]
    assert abs(m["busy"] - 5.5 / 60) < 1e-12 and m["steps"] == 1 and abs(m["mean_step_ms"] - 8000.0) < 1e-9
    assert [b[0] for b in history.seconds] == list(range(98, 104))  # in order, one bucket a second
