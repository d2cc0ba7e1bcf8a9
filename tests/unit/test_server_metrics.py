"""/metrics latencies are the timelines' own: a scheduler on a fake clock, its outputs fed to the
metrics as the engine thread feeds them, each histogram's count and sum checked exactly."""

from __future__ import annotations

from fakes import FakeClock, fake_run, make_request, make_scheduler

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.server.metrics import ServerMetrics


class SchedulerOnly:
    """What ServerMetrics reads of an engine: its scheduler's stats."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler


def output(r: Request, new: int) -> RequestOutput:
    return RequestOutput(r.request_id, None, r.prompt_token_ids,
                         [CompletionOutput(0, "", r.output_token_ids, finish_reason=r.finish_reason)],
                         finished=r.is_finished, new_token_ids=r.output_token_ids[-new:] if new else [],
                         timeline=r.timeline)


def run(s, clock: FakeClock, metrics: ServerMetrics, steps: int, abort: tuple[float, str] | None = None) -> None:
    for _ in range(steps):
        clock.now += 1.0
        sched = s.schedule()
        before = {r.request_id: r.num_output_tokens for r in sched.requests}
        changed = s.update(sched, fake_run(sched))
        metrics.on_step(None, [output(r, r.num_output_tokens - before[r.request_id]) for r in changed])
    if abort is not None:
        clock.now, rid = abort
        r = s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        metrics.on_step(None, [output(r, 0)])


def histogram(h) -> tuple[float, float]:
    samples = {s.name.rsplit("_", 1)[-1]: s.value for s in h.collect()[0].samples}
    return samples["count"], samples["sum"]


def test_every_latency_comes_from_the_timeline_preempted_and_aborted_requests_included() -> None:
    clock = FakeClock()
    s = make_scheduler(budget=5, clock=clock)
    metrics = ServerMetrics(SchedulerOnly(s))
    a = make_request("a", prompt_len=6, max_tokens=3)                # admitted at 1, tokens at 2, 3, 4.5
    b = make_request("b", prompt_len=2, max_tokens=20, arrival=0.5)  # admitted at 2 (budget), tokens at 2, 3
    s.add_request(a)
    s.add_request(b)
    run(s, clock, metrics, steps=3)
    clock.now = 3.5
    s._preempt(b, "pool_full")  # b: tokens at 2, 3; its 4 tokens replayed at 4.5
    run(s, clock, metrics, steps=1)
    assert a.timeline.token_times.tolist() == [2.0, 3.0, 4.5] and a.is_finished
    assert b.timeline.token_times.tolist() == [2.0, 3.0, 4.5]
    run(s, clock, metrics, steps=1, abort=(6.0, "b"))  # b's fourth token at 5.5, then the abort
    assert b.timeline.token_times.tolist() == [2.0, 3.0, 4.5, 5.5]
    assert histogram(metrics.queue_time) == (2, 1.0 + 1.5)
    assert histogram(metrics.ttft) == (2, 2.0 + 1.5)
    assert histogram(metrics.prefill_time) == (2, 1.0 + 0.0)
    assert histogram(metrics.itl) == (5, (1.0 + 1.5) + (1.0 + 1.5 + 1.0))  # nothing after b's abort
    assert histogram(metrics.decode_time) == (2, 2.5 + 4.0)
    assert histogram(metrics.e2e) == (2, 4.5 + 5.5)
    finished = {s.labels["finish_reason"]: s.value for s in metrics.finished.collect()[0].samples
                if s.name.endswith("_total")}
    assert finished == {"length": 1.0, "abort": 1.0}
    # the same figures under vLLM's names, for dashboards built for vLLM
    page = metrics.render().decode()
    for ours, theirs in (("queue_time", "request_queue_time_seconds"), ("ttft", "time_to_first_token_seconds"),
                         ("itl", "inter_token_latency_seconds"), ("e2e", "e2e_request_latency_seconds"),
                         ("prefill_time", "request_prefill_time_seconds"),
                         ("decode_time", "request_decode_time_seconds")):
        count, total = histogram(getattr(metrics, ours))
        assert f'vllm:{theirs}_count{{model_name=""}} {count}' in page
        assert f'vllm:{theirs}_sum{{model_name=""}} {total}' in page
    assert 'vllm:request_success_total{finished_reason="length",model_name=""} 1.0' in page
    assert 'vllm:request_success_total{finished_reason="abort",model_name=""} 1.0' in page
    assert 'vllm:num_preemptions_total{model_name=""} 0.0' in page  # (counted from step stats, none here)
    assert f'vllm:generation_tokens_total{{model_name=""}} {float(a.num_output_tokens + b.num_output_tokens)}' in page


def test_the_queue_and_cache_figures_are_also_exported_under_vllm_names() -> None:
    clock = FakeClock()
    s = make_scheduler(num_blocks=10, budget=8, prefix_caching=True, clock=clock)
    metrics = ServerMetrics(SchedulerOnly(s), model_name="tiny")
    s.add_request(make_request("a", prompt_len=9, max_tokens=2))
    s.add_request(make_request("b", prompt_len=9, max_tokens=2))
    run(s, clock, metrics, steps=1)  # a: 8 of 9 tokens (3 blocks); b waits, none of it queried yet
    text = metrics.render().decode()
    assert 'vllm:num_requests_running{model_name="tiny"} 1.0' in text
    assert 'vllm:num_requests_waiting{model_name="tiny"} 1.0' in text
    assert 'vllm:kv_cache_usage_perc{model_name="tiny"} 0.2' in text  # 2 blocks of 10 hold its 8 tokens
    run(s, clock, metrics, steps=3)
    stats = s.stats()
    text = metrics.render().decode()
    assert f'vllm:prefix_cache_queries_total{{model_name="tiny"}} {float(stats.prefix_tokens_queried)}' in text
    assert f'vllm:prefix_cache_hits_total{{model_name="tiny"}} {float(stats.prefix_tokens_hit)}' in text
    assert stats.prefix_tokens_hit == 8  # b found a's two full blocks
