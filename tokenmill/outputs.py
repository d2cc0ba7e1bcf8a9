"""The dataclasses handed between layers, one per arrow of the data path:

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.launch() / collect() -> RunnerOutput
    -> Scheduler.update() -> LLMEngine (detokenize) -> RequestOutput -> LLM / server
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tokenmill.request import Request, RequestStatus
from tokenmill.timeline import Timeline


@dataclass
class SchedulerOutput:
    """One step's batch: which requests run and how many tokens each computes."""

    requests: list[Request]              # batch order: decodes first, then prompt chunks
    num_scheduled_tokens: list[int]      # tokens each request computes this step, same order
    num_draft_tokens: list[int] = field(default_factory=list)  # speculative tokens among each one's
                                         # scheduled tokens (verified this step), same order
    num_decode_tokens: int = 0           # tokens of requests that were already generating
    preempted_request_ids: list[str] = field(default_factory=list)  # preempted while scheduling
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) block copies, before
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device) the forward pass
    finished_request_ids: list[str] = field(default_factory=list)   # ended since the last step
    pooling: list[Request] = field(default_factory=list)  # those of `requests` that pool their prompt
                                         # instead of sampling (embeddings), same order

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return self.total_num_tokens - self.num_decode_tokens


@dataclass
class RunnerOutput:
    """What one forward pass produced, keyed by request id."""

    sampled_token_ids: dict[str, list[int]]  # new tokens per request that reached its end (1, or more
                                             # with speculation); absent for partial prompt chunks
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # per new token:
                                             # {token id: logprob} for the sampled one and the top-n
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]], list[int]]] = field(default_factory=dict)
                                             # (index of the first prompt token, its entry and the next
                                             # ones, their tokens' ranks), for requests with
                                             # prompt_logprobs and a prompt chunk
    time_prepare: float = 0.0                # seconds building step tensors
    time_forward: float = 0.0                # seconds in the model
    time_sample: float = 0.0                 # seconds in the sampler (incl. the host sync)
    num_draft_tokens: int = 0                # speculative tokens proposed this step
    num_accepted_tokens: int = 0             # of which accepted
    pooled: dict[str, list[float]] = field(default_factory=dict)  # per embedding request whose prompt
                                             # ended this step: its pooled vector (hidden size floats)


@dataclass
class SchedulerStats:
    """The scheduler's queues and its KV pool, as of now (Scheduler.stats)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int               # referenced by live requests
    kv_blocks_free: int               # free or evictable (cached)
    kv_blocks_cached: int             # of the free ones, those evictable: cached content kept for reuse
    kv_blocks_total: int
    kv_slots_used: int                # allocated slots that hold a computed token
    prefix_tokens_queried: int        # cumulative: tokens looked up in the prefix cache at admission
    prefix_tokens_hit: int            # cumulative: of which served from the cache
    num_evictions: int                # cumulative: cached blocks evicted to make room
    num_preemptions: int              # cumulative
    num_external_tokens: int = 0      # cumulative: prompt tokens whose K/V a KV connector brought in
    num_held_requests: int = 0        # finished requests whose blocks a KV connector holds for a peer
    kv_blocks_held: int = 0           # their blocks (among kv_blocks_used, shared ones counted per request)
    num_missed_deadlines: int = 0     # cumulative: requests that finished after their deadline (edf)


@dataclass(frozen=True)
class FinishResult:
    """What a KV connector says of a request that ended (kv_connector.KVConnector.on_finish)."""

    kv_transfer_params: dict | None = None  # for the request's output (the proxy passes them on)
    hold_blocks: bool = False               # keep its blocks until the connector's released() names it


@dataclass(slots=True)
class RequestProgress:
    """One request's progress as of a snapshot (Scheduler.snapshot)."""

    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int          # prompt and output tokens whose K/V are in its blocks
    num_output_tokens: int
    max_tokens: int
    num_blocks: int                   # device blocks it holds (swapped-out ones are on the host)
    num_cached_tokens: int            # prompt tokens the prefix cache served at admission
    num_preemptions: int
    preempted: bool                   # waiting again after a preemption

    @classmethod
    def of(cls, request: Request) -> RequestProgress:
        return cls(request_id=request.request_id, num_prompt_tokens=request.num_prompt_tokens,
                   num_computed_tokens=request.num_computed_tokens, num_output_tokens=request.num_output_tokens,
                   max_tokens=request.max_tokens, num_blocks=len(request.block_ids),
                   num_cached_tokens=request.num_cached_tokens, num_preemptions=request.num_preemptions,
                   preempted=request.status == RequestStatus.PREEMPTED)


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The scheduler's pool and queues at one moment between steps, as plain data (for the
    dashboard): taken on the engine thread, read anywhere."""

    step: int                         # steps scheduled so far
    block_size: int
    block_states: bytes               # one byte per block: kv_cache.BLOCK_FREE, _OWNED, _SHARED, _CACHED
    running: list[RequestProgress]    # admission order
    waiting: list[RequestProgress]    # queue order, the first `max_waiting` of them
    num_waiting: int                  # all of them
    num_preemptions: int              # cumulative
    num_external_tokens: int = 0      # cumulative: prompt tokens whose K/V a KV connector brought in


@dataclass
class StepStats:
    """Per-step figures for benchmarks, metrics and the step-time split."""

    num_seqs: int = 0                 # requests in the batch
    num_tokens: int = 0               # tokens in the flat batch
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_running: int = 0              # after the step
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0         # free but holding cached content (evictable)
    kv_blocks_total: int = 0
    kv_slots_used: int = 0            # allocated slots that hold a computed token (for the waste figure)
    prefix_tokens_queried: int = 0    # cumulative: tokens looked up in the prefix cache at admission
    prefix_tokens_hit: int = 0        # cumulative: of which served from the cache
    num_evictions: int = 0            # cumulative: cached blocks evicted to make room
    num_preemptions: int = 0          # preemptions in this step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    time_schedule: float = 0.0
    time_prepare: float = 0.0
    time_forward: float = 0.0
    time_sample: float = 0.0
    time_detokenize: float = 0.0
    time_total: float = 0.0
    start: float = 0.0                # monotonic time the step began

    @classmethod
    def of(cls, sched: SchedulerOutput, result: RunnerOutput, now: SchedulerStats, num_preemptions: int,
           time_schedule: float, time_detokenize: float, start: float, end: float) -> StepStats:
        """A collected step's figures: its batch and runner times, the scheduler's state after it."""
        return cls(
            num_seqs=len(sched.requests), num_tokens=sched.total_num_tokens,
            num_prefill_tokens=sched.num_prefill_tokens, num_decode_tokens=sched.num_decode_tokens,
            num_running=now.num_running, num_waiting=now.num_waiting, kv_blocks_used=now.kv_blocks_used,
            kv_blocks_cached=now.kv_blocks_cached, kv_blocks_total=now.kv_blocks_total, kv_slots_used=now.kv_slots_used,
            prefix_tokens_queried=now.prefix_tokens_queried, prefix_tokens_hit=now.prefix_tokens_hit,
            num_evictions=now.num_evictions, num_preemptions=num_preemptions,
            time_schedule=time_schedule, time_prepare=result.time_prepare, time_forward=result.time_forward,
            time_sample=result.time_sample, time_detokenize=time_detokenize, time_total=end - start,
            start=start, num_draft_tokens=result.num_draft_tokens, num_accepted_tokens=result.num_accepted_tokens)


@dataclass
class CompletionOutput:
    index: int
    text: str                                   # cumulative, stop string removed
    token_ids: list[int]                        # cumulative
    finish_reason: str | None = None            # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None        # the stop token id or string that matched
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None     # sum over token_ids, when logprobs are asked for


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_external_tokens: int = 0      # prompt tokens whose K/V a KV connector brought in (disaggregation)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Prompt tokens not computed for this request: the prefix cache's and a KV connector's
        (a disaggregated decode's whole prompt), what vLLM and OpenAI report as cached_tokens."""
        return self.num_cached_tokens + self.num_external_tokens


@dataclass
class RequestOutput:
    """A request's state after a step: cumulative output plus what it added since the output
    before it (this step's, or several steps' when outputs a consumer had not taken were merged)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_text: str = ""                          # text added since the last output (UTF-8 safe, stop-safe)
    new_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    timeline: Timeline | None = None            # the request's events so far (timeline.py), shared, growing
    error: str | None = None                    # set when finish_reason is "error"
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token, if asked (first: None)
    prompt_logprob_ranks: list[int | None] | None = None  # each prompt token's rank there (1: the most likely)
    kv_transfer_params: dict | None = None      # disaggregation: where this request's prompt K/V waits
                                                # for a decode instance (kv_connector.py), once finished
    embedding: list[float] | None = None        # an embedding request's pooled vector, once it finished

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This output and the `later` one of the same request as one output, for a consumer that
        did not take this one yet: the later cumulative state (text, token ids, logprobs, finish
        reason, metrics) with both steps' additions as its new text and new token ids. A consumer
        that lags thus holds one output per request, and deltas taken from it are those it would
        have read from both."""
        return replace(later, new_text=self.new_text + later.new_text,
                       new_token_ids=self.new_token_ids + later.new_token_ids)
