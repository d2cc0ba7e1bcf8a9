"""A fake model for scheduler tests: deterministic tokens, no torch."""

from __future__ import annotations

from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.outputs import RunnerOutput, SchedulerOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler

EOS = 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_token(request: Request) -> int:
    """A token that depends only on the sequence so far (never EOS)."""
    return 10 + (sum(request.token_ids) * 31 + request.num_tokens) % 50


def fake_vector(request: Request) -> list[float]:
    """An embedding request's vector: its prompt's length and first token."""
    return [float(request.num_prompt_tokens), float(request.prompt_token_ids[0])]


def fake_run(sched: SchedulerOutput) -> RunnerOutput:
    """Sample for every request whose scheduled chunk reaches the end of its tokens (an embedding
    request gets its vector instead)."""
    out = RunnerOutput(sampled_token_ids={})
    for r, n in zip(sched.requests, sched.num_scheduled_tokens):
        if r.num_computed_tokens + n == r.num_tokens:
            if r.pooling is not None:
                out.pooled[r.request_id] = fake_vector(r)
            else:
                out.sampled_token_ids[r.request_id] = [fake_token(r)]
    return out


def make_request(request_id: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0,
                 **kwargs) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=kwargs.pop("ignore_eos", False))
    return Request(request_id=request_id, prompt_token_ids=[2 + i % 90 for i in range(prompt_len)],
                   params=params, max_tokens=max_tokens, eos_token_ids=frozenset({EOS}),
                   arrival_time=arrival, **kwargs)


def make_embedding_request(request_id: str, prompt_len: int, pooling: str = "last", arrival: float = 0.0) -> Request:
    """An embedding request as the input processor builds it: its prompt only, max_tokens 0."""
    return Request(request_id=request_id, prompt_token_ids=[2 + i % 90 for i in range(prompt_len)],
                   params=SamplingParams(max_tokens=1), max_tokens=0, eos_token_ids=frozenset({EOS}),
                   arrival_time=arrival, pooling=PoolingParams(pooling))


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   budget: int = 32, max_model_len: int = 256, prefix_caching: bool = False,
                   clock: FakeClock | None = None, connector=None, window: int | None = None,
                   **kwargs) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len, kv_watermark=kwargs.pop("kv_watermark", 0.0), **kwargs)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching, window=window)
    return Scheduler(config, kv, clock=clock or FakeClock(), connector=connector)


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000, check=None) -> list[SchedulerOutput]:
    """Step until every request finished; returns each step's SchedulerOutput."""
    steps = []
    while scheduler.has_unfinished_requests():
        assert len(steps) < max_steps, "scheduler made no progress"
        sched = scheduler.schedule()
        scheduler.update(sched, fake_run(sched))
        steps.append(sched)
        if check is not None:
            check(scheduler)
    return steps
