"""LLMEngine: the step loop that ties scheduler, runner and output processor together.

    step() = schedule -> launch -> collect (this step, or the one before) -> update -> outputs

It is single-threaded; the async front (async_engine.py) runs it in a thread for the server,
and `LLM` (llm.py) drives it to completion for offline use.

Overlapping host and device work is one pipeline, carried as data from one step() to the next:
`_ongoing` is a step launched but not collected, `_unreported` the requests of a collected step
whose outputs are still to build. On the CPU the forward pass runs on the host itself, so each
step collects what it just launched and builds its outputs at once. On a GPU (the defaults)
async scheduling launches each step before collecting the one before, so the device never waits
for the host's scheduling and detokenizing; while a request needs its tokens on the host before
the next step (penalties, grammars, bad words, drafts) the last step is collected first and
async_output builds its outputs while the next one runs.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.engine_parts import build_engine_parts
from tokenmill.input_processor import Prompt
from tokenmill.model_runner import PendingStep
from tokenmill.models.cpu_packing import amx_min_rows_of, bf16_weights_of, int8_rows_of
from tokenmill.outputs import RequestOutput, RunnerOutput, SchedulerOutput, StepStats
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.trace import TraceWriter

logger = logging.getLogger(__name__)


@dataclass
class Launched:
    """A step handed to the runner: its device work may still run."""
    sched: SchedulerOutput
    pending: PendingStep | None       # None: the step ran no request
    advanced: bool                    # the scheduler counted its tokens as computed at launch


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = build_engine_parts(config)
        self.device, self.dtype, self.kv_dtype = parts.device, parts.dtype, parts.kv_dtype
        self.model_path, self.model_config, self.tokenizer = parts.model_path, parts.model_config, parts.tokenizer
        self.eos_token_ids, self.max_model_len = parts.eos_token_ids, parts.max_model_len
        self.cache_config, self.runner, self.scheduler = parts.cache_config, parts.runner, parts.scheduler
        self.speculator = parts.speculator
        # tensor parallelism: ranks 1..N-1, ended by close(), or when the engine is collected or the process exits
        self.ranks = parts.ranks
        self._close_ranks = weakref.finalize(self, parts.ranks.close) if parts.ranks is not None else None
        self.input_processor, self.output_processor = parts.input_processor, parts.output_processor
        # The pipeline's two knobs (see the module docstring); both default on for CUDA.
        self.async_output = config.async_output if config.async_output is not None else self.device.type == "cuda"
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda" and self.speculator is None)
        self._ongoing: Launched | None = None   # launched, not yet collected
        self._unreported: list[Request] = []    # collected, their outputs still to build
        self.last_stats = StepStats()
        self._preemptions_recorded = 0  # the scheduler's count when stats were last recorded
        self.stats_listeners: list[Callable[[StepStats], None]] = []
        self.trace = TraceWriter(config.trace_file) if config.trace_file else None  # --trace-file

    # ---- requests ------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request built by input_processor.make_request (which touches no engine state: the
        server calls it on its own thread)."""
        self.output_processor.add(request)
        self.scheduler.add_request(request)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    deadline: float | None = None) -> Request:
        """Tokenize and validate (InputProcessor.make_request: ValueError for anything the engine could
        never serve), then queue."""
        request = self.input_processor.make_request(request_id, prompt, params, arrival_time, priority, deadline)
        self.add(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is; its blocks return to the pool at once. Returns its
        final output (finish_reason "abort"), or None for an unknown or finished request; a
        request that finished but whose end was not reported yet (async_output) gets that end;
        a token of it still in flight (async scheduling) is dropped."""
        out = self._end(request_id, RequestStatus.FINISHED_ABORTED)
        if out is not None and self.trace is not None:
            self.trace.on_outputs([out])
        return out

    def release_threads(self) -> None:
        """Let the OpenMP threads that building the engine started exit (ModelWorker.release_threads)."""
        self.runner.worker.release_threads()

    def reset_threads(self) -> None:
        """Leave the calling thread, which ran the steps, with every CPU thread (ModelWorker.reset_threads)."""
        self.runner.worker.reset_threads()

    def idle(self) -> None:
        """Between steps with no request to run: blocks a KV connector held for a peer and has since
        released go back to the pool (Scheduler.release_held)."""
        self.scheduler.release_held()

    def waiting_on_loads(self) -> bool:
        """Whether every unfinished request waits on a KV connector's load, after asking the
        connector which have ended: a step now would run nothing."""
        self.scheduler.collect_loads()
        return self.scheduler.only_loading()

    @property
    def arithmetic(self) -> dict:
        """What a step computes in: the activations' and the KV pool's dtypes, whether the products
        with float weights take them and x in bfloat16, the fewest rows of a step whose bfloat16
        products run on AMX tiles (0: none), and the most rows of a step whose GGUF block products
        take x in 8-bit blocks (0: none, the exact path)."""
        model = self.runner.worker.model
        return {"dtype": str(self.dtype).removeprefix("torch."), "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
                "bf16_weights": bf16_weights_of(model), "amx_min_rows": amx_min_rows_of(model),
                "gguf_int8_rows": int8_rows_of(model)}

    def close(self) -> None:
        """End the tensor-parallel ranks this engine started (nothing without them), let go of the KV
        connector's agents and listeners, and close the trace file; the engine runs no step after it."""
        if self._close_ranks is not None:
            self._close_ranks()
        if self.scheduler.connector is not None:
            self.scheduler.connector.close()
        if self.trace is not None:
            self.trace.close()

    def use_device(self) -> None:
        """Make the engine's device the calling thread's current one (the async engine's thread):
        Triton launches, CUDA events and graph captures act on the current device."""
        self.runner.worker.use_device()

    def unfinished_request_ids(self) -> list[str]:
        """Every request whose final output is still to come."""
        return list(self.output_processor.detokenizers)

    def has_unfinished_requests(self) -> bool:
        # (a step still in flight holds no other requests: those not finished are the scheduler's)
        return self.scheduler.has_unfinished_requests() or bool(self._unreported)

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration of the pipeline (module docstring). Returns the outputs of requests that
        got new tokens or finished; one step late under async_output or async scheduling, where a
        stop string found late ends its request while the next step runs, and the token that step
        computed for it is dropped. Timestamps stay those of the sampling step."""
        outputs = self._step()
        if self.trace is not None:
            self.trace.on_step(self.last_stats, outputs)
        return outputs

    def _step(self) -> list[RequestOutput]:
        ahead = self.async_scheduling and not self.scheduler.needs_past_tokens()
        if self._ongoing is not None and not ahead:  # a request needs the last step's tokens first
            return self._complete(self._take_ongoing(), time.perf_counter())
        start = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.scheduler.prompt_tokens_waiting(),
                                    self.config.max_num_batched_tokens, self.max_model_len)
        sched = self.scheduler.schedule()
        time_schedule = time.perf_counter() - start
        earlier, self._unreported = self._unreported, []
        previous = self._take_ongoing()
        try:
            launched = self._launch(sched, advance=ahead)
        except Exception as exc:  # a host-side failure: fail this step's requests, keep serving
            return (self.output_processor.outputs(earlier) + self._complete(previous, start, time_schedule)
                    + self._fail_step(sched, exc))
        t0 = time.perf_counter()
        outputs = self.output_processor.outputs(earlier)  # the last step's, while the device runs this one
        time_outputs = time.perf_counter() - t0
        if ahead:  # this step is collected in the next call, the last one now
            self._ongoing = launched if launched.pending is not None else None
            if previous is None:
                self.last_stats = StepStats()  # no step completed in this call
            return outputs + self._complete(previous, start, time_schedule)
        return outputs + self._complete(launched, start, time_schedule, time_outputs)

    def _take_ongoing(self) -> Launched | None:
        ongoing, self._ongoing = self._ongoing, None
        return ongoing

    def _launch(self, sched: SchedulerOutput, advance: bool) -> Launched:
        pending = self.runner.launch(sched)
        if advance and pending is not None:
            self.scheduler.advance(sched)  # so that the next step can be scheduled before this one's tokens
        return Launched(sched, pending, advanced=advance)

    def _complete(self, step: Launched | None, start: float, time_schedule: float = 0.0,
                  time_outputs: float = 0.0) -> list[RequestOutput]:
        """Collect a launched step (waiting for the device), append its tokens, build its outputs
        (or leave them for the next call, under async_output without async scheduling). Its stats
        take this call's host time since `start`, with the prepare, forward and sample times of
        its own launch."""
        if step is None:
            return []
        try:
            result = self.runner.collect(step.pending) if step.pending is not None else RunnerOutput({})
        except Exception as exc:  # the device failed the step
            return self._fail_step(step.sched, exc)
        t0 = time.perf_counter()
        changed = self.scheduler.update(step.sched, result, advanced=step.advanced)
        t1 = time.perf_counter()
        outputs = []
        if self.async_output and not step.advanced:
            self._unreported = changed
        else:
            outputs = self.output_processor.outputs(changed)
        end = time.perf_counter()
        self._record_stats(step.sched, result, time_schedule=time_schedule + (t1 - t0),
                           time_detokenize=time_outputs + (end - t1), start=start, end=end)
        if self.speculator is not None:
            self.speculator.observe(self.last_stats, step.sched.finished_request_ids, changed)
        return outputs

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Fail the step's requests; the scheduler distrusts what the step may have left half done,
        and the speculator releases the draft state of its requests and of those that ended before
        it (it learns of them after a step that completes)."""
        logger.exception("step failed; failing its %d requests", len(sched.requests))
        self.scheduler.distrust_step(sched)
        self.last_stats = StepStats()  # the failed step ran nothing that listeners should count
        error = f"the engine step that ran this request failed: {type(exc).__name__}: {exc}"
        outputs = [self._fail(r, error) for r in sched.requests if not r.is_finished]
        if self.speculator is not None:
            self.speculator.release(sched.finished_request_ids + [r.request_id for r in sched.requests])
        return outputs

    def _fail(self, request: Request, error: str) -> RequestOutput:
        out = self._end(request.request_id, RequestStatus.FINISHED_ERROR)
        out.error = error
        return out

    def _end(self, request_id: str, status: RequestStatus) -> RequestOutput | None:
        """Finish a request outside the token-level stop checks; its final output."""
        request = self.scheduler.finish_request(request_id, status)
        unreported = next((r for r in self._unreported if r.request_id == request_id), None)
        if unreported is not None:  # async_output: its last tokens, or its end, are still to report
            self._unreported.remove(unreported)
            return self.output_processor.outputs([unreported])[0]
        return self.output_processor.final_output(request_id, request)

    def _record_stats(self, sched: SchedulerOutput, result: RunnerOutput, time_schedule: float,
                      time_detokenize: float, start: float, end: float) -> None:
        """The step's figures; preemptions: all since the last record (a step that failed, or an
        async-scheduling call that completed no step, records none)."""
        now = self.scheduler.stats()
        s = StepStats.of(sched, result, now, now.num_preemptions - self._preemptions_recorded, time_schedule,
                         time_detokenize, start, end)
        self._preemptions_recorded = now.num_preemptions
        self.last_stats = s
        for listener in self.stats_listeners:
            listener(s)
