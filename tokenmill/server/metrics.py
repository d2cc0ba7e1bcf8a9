"""Prometheus metrics, updated on the engine thread after every step.

Request latencies (queue time, TTFT, ITL, prefill, decode, end to end) are read from each
request's timeline (timeline.py), the same events `GET /v1/requests/{id}` shows, so the two
always agree. Beside tokenmill's own names, the queue and KV-cache figures are exported under
vLLM's (`vllm:num_requests_running`, ..., labelled with the served model's name), so routers
written for vLLM (its production-stack router, llm-d) balance tokenmill replicas too; so are the
token counters, finished requests and latency histograms (`vllm:prompt_tokens_total`,
`vllm:request_success_total`, `vllm:time_to_first_token_seconds`, ...), so that dashboards built
for vLLM show tokenmill's. Each server owns its CollectorRegistry (no process-wide default
registry), so tests can run several servers in one process.
"""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.outputs import RequestOutput, SchedulerStats, StepStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, engine, model_name: str = "") -> None:
        self.engine = engine
        self.registry = r = CollectorRegistry()
        self.vllm = _VllmNames(r, model_name)
        self.running = Gauge("tokenmill_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("tokenmill_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_used = Gauge("tokenmill_kv_blocks_used", "KV blocks referenced by live requests", registry=r)
        self.kv_free = Gauge("tokenmill_kv_blocks_free", "KV blocks free or evictable (cached)", registry=r)
        self.kv_total = Gauge("tokenmill_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.hit_rate = Gauge("tokenmill_prefix_cache_hit_rate",
                              "Share of looked-up prompt tokens served from the prefix cache", registry=r)
        twin = functools.partial(_Twin.make, r, model_name)
        self.preemptions = twin(Counter, "preemptions", "num_preemptions", "Requests preempted")
        self.prompt_tokens = twin(Counter, "prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests")
        self.prefill_computed = Counter("tokenmill_prompt_tokens_computed",
                                        "Tokens computed in prompt chunks: prompts past their cached or "
                                        "transferred part, and stretches recomputed after preemption",
                                        registry=r)
        self.transferred = Counter("tokenmill_kv_transfer_tokens_received",
                                   "Prompt tokens whose K/V a KV connector brought in (disaggregated decode)",
                                   registry=r)
        self._transferred = 0  # the cumulative figure already counted
        self.missed_deadlines = Counter("tokenmill_requests_missed_deadline",
                                        "Requests that finished after their deadline (scheduling policy edf)",
                                        registry=r)
        self._missed = 0
        self.generation_tokens = twin(Counter, "generation_tokens", "generation_tokens", "Tokens generated")
        self.finished = twin(Counter, "requests_finished", "request_success", "Finished requests",
                             ("finish_reason",), ("finished_reason",))
        self.draft_tokens = Counter("tokenmill_spec_draft_tokens", "Speculative tokens proposed and verified",
                                    registry=r)
        self.accepted_tokens = Counter("tokenmill_spec_accepted_tokens", "Speculative tokens accepted", registry=r)
        latency = functools.partial(twin, Histogram, buckets=_LATENCY_BUCKETS)
        self.ttft = latency("time_to_first_token_seconds", "time_to_first_token_seconds", "Time to first token")
        self.itl = latency("inter_token_latency_seconds", "inter_token_latency_seconds", "Time between output tokens")
        self.e2e = latency("e2e_request_latency_seconds", "e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = latency("request_queue_time_seconds", "request_queue_time_seconds",
                                  "Arrival to first scheduled")
        self.prefill_time = latency("request_prefill_time_seconds", "request_prefill_time_seconds",
                                    "First scheduled to first token")
        self.decode_time = latency("request_decode_time_seconds", "request_decode_time_seconds",
                                   "First token to finish")
        self._tokens_seen: dict[str, int] = {}   # request id -> output tokens whose gaps are observed
        self.observe_pool()

    def observe_pool(self) -> None:
        s = self.engine.scheduler.stats()
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_used.set(s.kv_blocks_used)
        self.kv_free.set(s.kv_blocks_free)
        self.kv_total.set(s.kv_blocks_total)
        self.hit_rate.set(s.prefix_tokens_hit / s.prefix_tokens_queried if s.prefix_tokens_queried else 0.0)
        self.transferred.inc(s.num_external_tokens - self._transferred)
        self._transferred = s.num_external_tokens
        self.missed_deadlines.inc(s.num_missed_deadlines - self._missed)
        self._missed = s.num_missed_deadlines
        self.vllm.observe(s)

    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after each step (stats None: outputs of aborted requests)."""
        self.observe_pool()
        if stats is not None:
            self.preemptions.inc(stats.num_preemptions)
            self.prefill_computed.inc(stats.num_prefill_tokens)
            self.draft_tokens.inc(stats.num_draft_tokens)
            self.accepted_tokens.inc(stats.num_accepted_tokens)
        for out in outputs:
            if out.new_token_ids:
                self.generation_tokens.inc(len(out.new_token_ids))
            if out.timeline is not None:
                self._observe_tokens(out)
            if out.finished:
                self.on_finished(out)

    def _observe_tokens(self, out: RequestOutput) -> None:
        """At its first token: the prompt, queue time and TTFT; then each new gap between tokens."""
        timeline, rid = out.timeline, out.request_id
        seen, count = self._tokens_seen.get(rid, 0), len(timeline.token_times)
        if count == seen:
            return
        if seen == 0:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.ttft.observe(timeline.ttft)
            if timeline.queue_time is not None:
                self.queue_time.observe(timeline.queue_time)
            if timeline.prefill_time is not None:
                self.prefill_time.observe(timeline.prefill_time)
        for gap in timeline.itl(start=max(seen, 1)):
            self.itl.observe(gap)
        self._tokens_seen[rid] = count

    def on_finished(self, out: RequestOutput) -> None:
        self._tokens_seen.pop(out.request_id, None)
        self.finished.labels(out.outputs[0].finish_reason or "unknown").inc()
        timeline = out.timeline
        if out.embedding is not None:  # an embedding request: no first token to count its prompt at
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            if timeline is not None and timeline.queue_time is not None:
                self.queue_time.observe(timeline.queue_time)
        if timeline is None:
            return
        if timeline.e2e is not None:
            self.e2e.observe(timeline.e2e)
        if timeline.decode_time is not None:
            self.decode_time.observe(timeline.decode_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Twin:
    """One figure under tokenmill's name and vLLM's (with its `model_name` label): each count or
    observation goes to both; `collect` reads tokenmill's."""

    def __init__(self, ours, theirs, model_name: str) -> None:
        self.ours, self.theirs, self.model_name = ours, theirs, model_name

    @classmethod
    def make(cls, r: CollectorRegistry, model_name: str, kind, ours: str, theirs: str, documentation: str,
             labels: tuple[str, ...] = (), their_labels: tuple[str, ...] | None = None, **options) -> "_Twin":
        """tokenmill_`ours` and vllm:`theirs`, of `kind` (Counter, Histogram), in registry `r`."""
        mine = kind(f"tokenmill_{ours}", documentation, list(labels), registry=r, **options)
        vllm = kind(f"vllm:{theirs}", documentation, ["model_name", *(their_labels or labels)], registry=r, **options)
        return cls(mine, vllm if labels else vllm.labels(model_name), model_name)

    def labels(self, *values: str) -> "_Twin":
        return _Twin(self.ours.labels(*values), self.theirs.labels(self.model_name, *values), self.model_name)

    def inc(self, amount: float = 1) -> None:
        self.ours.inc(amount)
        self.theirs.inc(amount)

    def observe(self, value: float) -> None:
        self.ours.observe(value)
        self.theirs.observe(value)

    def collect(self):
        return self.ours.collect()


class _VllmNames:
    """The scheduler's figures under vLLM's metric names and its `model_name` label."""

    def __init__(self, r: CollectorRegistry, model_name: str) -> None:
        label = {"model_name": model_name}
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", ["model_name"],
                             registry=r).labels(**label)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", ["model_name"],
                             registry=r).labels(**label)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Share of KV blocks in use (1 = full)", ["model_name"],
                              registry=r).labels(**label)
        self.queries = Counter("vllm:prefix_cache_queries",
                               "Prompt tokens looked up in the prefix cache (first admissions)", ["model_name"],
                               registry=r).labels(**label)
        self.hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache", ["model_name"],
                            registry=r).labels(**label)
        self._queried = self._hit = 0   # the cumulative figures already counted

    def observe(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        self.queries.inc(s.prefix_tokens_queried - self._queried)
        self.hits.inc(s.prefix_tokens_hit - self._hit)
        self._queried, self._hit = s.prefix_tokens_queried, s.prefix_tokens_hit
