"""LLMEngine: the step loop that ties scheduler, runner and detokenizer together.

    step() = schedule -> run the model once -> update counters and tokens -> detokenize

It is single-threaded; the async front (async_engine.py) runs it in a thread for the
server, and `LLM` (llm.py) drives it to completion for offline use. On a GPU it keeps the
device ahead of the host: outputs are built while the next step runs (`async_output`), and
with async scheduling (`_step_ahead`) each step is launched before the last one is collected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from safetensors import SafetensorError

from tokenmill.attention import make_backend
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_size
from tokenmill.detokenizer import IncrementalDetokenizer
from tokenmill.kv_cache import KVCacheManager
from tokenmill.model_runner import ModelRunner, PendingStep
from tokenmill.models.loader import (
    BROKEN_FILE_ERRORS,
    load_model,
    load_tokenizer,
    open_checkpoint,
    resolve_model_path,
    unreadable,
)
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput, RunnerOutput, SchedulerOutput, StepStats
from tokenmill.proposers import make_proposer
from tokenmill.request import Request, RequestStatus
from tokenmill.sampler import bad_words_token_ids
from tokenmill.sampling_params import SamplingParams, is_unicode
from tokenmill.scheduler import Scheduler
from tokenmill.spec_decode import SpeculationPolicy, Speculator
from tokenmill.structured import GrammarCompiler

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict
DEFAULT_CPU_KV_MEMORY = 4 * 1024**3


def resolve_device(name: str) -> torch.device:
    """The engine's device, with its index ("cuda" is the current GPU: torch.cuda.set_device needs
    an index); a CUDA device on a torch that sees none is an error before anything loads."""
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this torch build sees no CUDA GPU "
                         f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'})")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.use_device()
        self.dtype = getattr(torch, config.torch_dtype_name)
        self.kv_dtype = getattr(torch, config.kv_dtype_name)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        path = resolve_model_path(config.model)
        self.model_path = path
        checkpoint = open_checkpoint(path)
        self.model_config: ModelConfig = checkpoint.config
        self.tokenizer = load_tokenizer(path, config.tokenizer)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)

        max_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                      self.model_config.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > max_len:
            logger.warning("max_model_len %d is past the model's %d positions: lowered to %d",
                           config.max_model_len, max_len, max_len)
        try:
            model = load_model(checkpoint, max_len, self.dtype, self.device, config.kernels, config.gguf_blocks,
                               config.gguf_int8_rows)
        except (*BROKEN_FILE_ERRORS, SafetensorError) as exc:
            raise unreadable(path, exc) from exc
        # A draft model is loaded before the pool is sized (on a GPU, from the memory left), and its
        # own pool gets as many blocks: each block then costs the two models' K/V.
        proposer = (make_proposer(config.speculative, config, self.model_config.vocab_size)
                    if config.speculative is not None else None)
        self._draft_kv_per_token = proposer.kv_elements_per_token if proposer is not None else 0
        num_blocks = self._num_kv_blocks(max_len)
        if num_blocks * config.block_size < max_len:
            logger.warning("KV pool holds %d tokens: max_model_len lowered from %d",
                           num_blocks * config.block_size, max_len)
            max_len = num_blocks * config.block_size
        self.max_model_len = max_len
        self.cache_config = CacheConfig(num_blocks, config.block_size, config.enable_prefix_caching)
        bytes_per_block = config.block_size * self.model_config.kv_bytes_per_token * self.kv_dtype.itemsize
        num_host_blocks = parse_size(config.swap_space) // bytes_per_block if config.preemption_mode == "swap" else 0
        backend = make_backend(config.attention_backend, self.device, config.block_size, self.model_config.head_dim,
                               self.dtype)
        try:  # the pool's tensors first, then its bookkeeping (a list entry per block)
            self.runner = ModelRunner(model, self.model_config, self.cache_config, backend, self.device,
                                      self.kv_dtype, config.seed, num_host_blocks)
            self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks)
        except (MemoryError, OSError, RuntimeError) as exc:  # mmap's ENOMEM, torch's allocators, CUDA OOM
            raise MemoryError(self._pool_too_big(num_blocks, num_host_blocks, bytes_per_block, exc)) from exc
        self.scheduler = Scheduler(SchedulerConfig.from_engine(config, max_len), self.kv)
        if self.device.type == "cuda" and not config.enforce_eager and getattr(backend, "graph_safe", False):
            self.runner.capture_graphs(config.max_num_seqs, max_len)
        self.speculator = None
        if proposer is not None:
            proposer.allocate(num_blocks, config.block_size)
            self.speculator = Speculator(proposer, SpeculationPolicy(config.num_speculative_tokens),
                                         adaptive=config.speculative_adaptive)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Build outputs one step late, during the next step's device work (see step()); on a CPU
        # the forward pass runs on the host itself, so there is nothing to overlap.
        self.async_output = config.async_output if config.async_output is not None else self.device.type == "cuda"
        self._unreported: list[Request] = []  # requests with tokens whose outputs are still to build
        # Schedule and launch each step before the last one's tokens reach the host (see _step_ahead).
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda" and self.speculator is None)
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None  # launched, not yet collected
        self.last_stats = StepStats()
        self._preemptions_recorded = 0  # the scheduler's count when stats were last recorded
        self.stats_listeners: list[Callable[[StepStats], None]] = []

    def _num_kv_blocks(self, max_len: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_token = self.model_config.kv_bytes_per_token + self._draft_kv_per_token
        bytes_per_block = cfg.block_size * per_token * self.kv_dtype.itemsize
        if cfg.kv_cache_memory is not None:
            budget = parse_size(cfg.kv_cache_memory)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.85)
        else:  # enough for every sequence at full length, up to 4 GiB (untouched pages cost nothing)
            budget = min(DEFAULT_CPU_KV_MEMORY, cfg.max_num_seqs * max_len * bytes_per_block // cfg.block_size)
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={cfg.kv_cache_memory!r} holds no block of "
                             f"{bytes_per_block} bytes")
        return num_blocks

    def _pool_too_big(self, num_blocks: int, num_host_blocks: int, bytes_per_block: int, exc: Exception) -> str:
        """The pools asked for, in blocks and bytes, and the options that sized them: "Cannot allocate
        memory" alone named neither."""
        reason = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        pools = (f"the pool of {num_blocks} blocks x {bytes_per_block} bytes "
                 f"({num_blocks * bytes_per_block / 1024**3:.2f} GiB) on {self.device}")
        flags = "--num-kv-blocks" if self.config.num_kv_blocks is not None else "--kv-cache-memory"
        if num_host_blocks:
            pools += (f" and the swap pool of {num_host_blocks} blocks "
                      f"({num_host_blocks * bytes_per_block / 1024**3:.2f} GiB) in host memory")
            flags += " or --swap-space"
        return f"cannot allocate the KV cache ({reason}): {pools}; lower {flags}"

    # ---- requests ------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) from a string, a list of token ids, or {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not is_unicode(prompt):  # bytes that were no UTF-8 (a shell argument, stdin)
                raise ValueError("prompt is not valid UTF-8 text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                     arrival_time: float | None = None, priority: int = 0,
                     deadline: float | None = None, fit_to_context: bool = False) -> Request:
        """Tokenize and validate; raises ValueError for anything the engine could never serve.
        fit_to_context: a max_tokens past the context ends the output there instead (the offline
        API's choice, as vLLM's; the server answers 400, as vLLM's and OpenAI's do).

        Touches no engine state, so the server calls it on its own thread and returns 400s
        without waiting for a step."""
        params = params or SamplingParams()
        if priority and self.config.scheduling_policy != "priority":  # as vLLM: not silently ignored
            raise ValueError(f"priority {priority} needs scheduling_policy 'priority' "
                             f"(this engine runs '{self.config.scheduling_policy}')")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            text, ids = None, ids[-params.truncate_prompt_tokens:]  # the text no longer matches the ids
        vocab = self.model_config.vocab_size
        for name, tokens in (("prompt token ids", ids), ("stop_token_ids", params.stop_token_ids),
                             ("logit_bias token ids", params.logit_bias or ()),
                             ("allowed_token_ids", params.allowed_token_ids or ())):
            if not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
                raise ValueError(f"{name} must be integers in [0, {vocab})")
        bad_words = [seq for seq in bad_words_token_ids(self.tokenizer, params.bad_words or [])
                     if all(t < vocab for t in seq)]  # (a word with a token past the logits is never sampled)
        banned_always = {seq[0] for seq in bad_words if len(seq) == 1}
        if params.allowed_token_ids is not None:
            allowed = set(params.allowed_token_ids)
            if allowed <= banned_always:
                raise ValueError("allowed_token_ids holds only tokens that bad_words bans")
            # under min_tokens the sampler also bans EOS (ignore_eos too, as vLLM) and the stop tokens
            if params.min_tokens and allowed <= banned_always | set(params.stop_token_ids) | set(self.eos_token_ids):
                raise ValueError("allowed_token_ids holds only stop tokens and tokens that bad_words bans, "
                                 "which min_tokens forbids at first")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt has {len(ids)} tokens but the model's context length is "
                             f"{self.max_model_len}: no room for any output")
        if params.max_tokens is not None and params.max_tokens > room and not fit_to_context:
            raise ValueError(f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                             f"the model's context length ({self.max_model_len})")
        grammar = (self.grammars.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        return Request(request_id=request_id, prompt_token_ids=ids, params=params,
                       max_tokens=min(params.max_tokens or room, room), eos_token_ids=self.eos_token_ids,
                       prompt=text, priority=priority, deadline=deadline,
                       arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
                       grammar=grammar, bad_words_token_ids=bad_words)

    def add(self, request: Request) -> None:
        """Queue a request built by make_request."""
        if request.request_id in self.detokenizers:  # not finished, or its end not yet reported
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.scheduler.add_request(request)
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    deadline: float | None = None) -> Request:
        """make_request + add."""
        request = self.make_request(request_id, prompt, params, arrival_time, priority, deadline)
        self.add(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is; its blocks return to the pool at once. Returns its
        final output (finish_reason "abort"), or None for an unknown or finished request; with
        async_output, a request that finished but whose end was not reported yet gets that end;
        with async scheduling, a token of it still in flight is dropped."""
        return self._end(request_id, RequestStatus.FINISHED_ABORTED)

    def release_threads(self) -> None:
        """Let the OpenMP worker threads that the calling thread started exit (building the engine
        ran parallel kernels on it). AsyncLLMEngine calls it before stepping the engine on a thread
        of its own: each thread that runs parallel kernels keeps a team of workers, and with more
        workers than cores libgomp makes idle ones sleep at once instead of spinning, so that every
        kernel call has to wake them (a batch-1 decode step of the default model took 6.95 ms on
        the new thread against 6.4 on the one that built the engine, 6.4 again after this)."""
        kernels = getattr(self.runner.backend, "kernel", None)  # the CPU backend's C++ module
        if kernels is not None:
            kernels.release_threads()

    def use_device(self) -> None:
        """Make the engine's GPU the calling thread's current device: Triton launches, CUDA events
        and graph captures act on the current device, not on their tensors' (with "cuda:1", on
        device 0 otherwise). AsyncLLMEngine calls it on its engine thread."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def unfinished_request_ids(self) -> list[str]:
        """Every request whose final output is still to come."""
        return list(self.detokenizers)

    def has_unfinished_requests(self) -> bool:
        # (a step still in flight holds no other requests: those not finished are the scheduler's)
        return self.scheduler.has_unfinished_requests() or bool(self._unreported)

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run, update, detokenize. Returns outputs of requests that
        got new tokens or finished.

        With `async_output` (on a GPU) a step's outputs are built during the next step, while
        the device computes it: they arrive one step later, and the host's detokenizing no
        longer adds to the step's time. A stop string found then ends its request while the
        next step is in flight; the token that step computed for it is dropped. Timestamps
        (first token, finish) stay those of the sampling step, not of the report."""
        if self.async_scheduling:
            if self._can_step_ahead():
                return self._step_ahead()
            if self._in_flight is not None:  # a request with penalties needs its tokens on the host
                previous, self._in_flight = self._in_flight, None
                return self._finish(previous, time.perf_counter())
        t0 = time.perf_counter()
        if self.speculator is not None:
            self._propose()
        sched = self.scheduler.schedule()
        earlier, self._unreported = self._unreported, []
        t1 = time.perf_counter()
        try:
            pending = self.runner.launch(sched)
        except Exception as exc:  # fail this step's requests, keep the engine serving
            return self._outputs(earlier) + self._fail_step(sched, exc)
        t2 = time.perf_counter()
        outputs = self._outputs(earlier)  # empty unless async_output
        t3 = time.perf_counter()
        try:
            result = self.runner.collect(pending) if pending is not None else RunnerOutput({})
        except Exception as exc:  # the device failed the step
            return outputs + self._fail_step(sched, exc)
        t4 = time.perf_counter()
        changed = self.scheduler.update(sched, result)
        t5 = time.perf_counter()
        if self.async_output:
            self._unreported = changed
        else:
            outputs = self._outputs(changed)
        t6 = time.perf_counter()
        self._record_stats(sched, result, time_schedule=(t1 - t0) + (t5 - t4),
                           time_detokenize=(t3 - t2) + (t6 - t5), start=t0, end=t6)
        if self.speculator is not None:
            self.speculator.observe(self.last_stats, sched.finished_request_ids, changed)
        return outputs

    def _can_step_ahead(self) -> bool:
        """Penalties, grammars and bad words read a request's past tokens on the host, so they need
        the last step's."""
        return not any(r.params.has_penalties or r.grammar is not None or r.bad_words_token_ids
                       for r in self.scheduler.requests.values())

    def _step_ahead(self) -> list[RequestOutput]:
        """Async scheduling: schedule and launch this step while the last one still runs on the
        device (its sampled tokens feed this one's decodes there), then collect the last one.
        The host's scheduling and input preparation no longer leave the device idle; outputs
        come back one step after their tokens were sampled, as with async_output. A request that
        stops on EOS or a stop string has a token computed in vain, dropped."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        earlier, self._unreported = self._unreported, []  # from steps run before in sync
        t1 = time.perf_counter()
        previous, self._in_flight = self._in_flight, None
        try:
            pending = self.runner.launch(sched)
        except Exception as exc:
            return self._outputs(earlier) + self._finish(previous, t0, t1 - t0) + self._fail_step(sched, exc)
        if pending is not None:
            self.scheduler.advance(sched)
            self._in_flight = (sched, pending)  # before collecting the last one, so it is never lost
        if previous is None:
            self.last_stats = StepStats()  # no step completed in this call
        return self._outputs(earlier) + self._finish(previous, t0, t1 - t0)

    def _finish(self, step: tuple[SchedulerOutput, PendingStep] | None, start: float,
                time_schedule: float = 0.0) -> list[RequestOutput]:
        """Collect a launched step (waiting for the device), append its tokens, build outputs.
        Its stats take the host's time since `start` (scheduling the next step meanwhile
        included) with the prepare, forward and sample times of its own launch."""
        if step is None:
            return []
        sched, pending = step
        try:
            result = self.runner.collect(pending)  # its wait for the device counts as sampling time
        except Exception as exc:  # the device failed the step
            return self._fail_step(sched, exc)
        t1 = time.perf_counter()
        changed = self.scheduler.update(sched, result, advanced=True)
        t2 = time.perf_counter()
        outputs = self._outputs(changed)
        end = time.perf_counter()
        self._record_stats(sched, result, time_schedule=time_schedule + (t2 - t1), time_detokenize=end - t2,
                           start=start, end=end)
        return outputs

    def _outputs(self, requests: list[Request]) -> list[RequestOutput]:
        return [out for r in requests if (out := self._make_output(r)) is not None]

    def _fail_step(self, sched, exc: Exception) -> list[RequestOutput]:
        """Fail the step's requests, and distrust what the step may have left half done: forget
        every cached prefix (a request a late stop string ended meanwhile is not among the
        failed), recompute requests it swapped out, and release the draft state of its requests
        and of those that ended before it (the speculator learns of them after a step that
        completes)."""
        logger.exception("step failed; failing its %d requests", len(sched.requests))
        self.kv.forget_cached(self.scheduler.running)
        for request_id in sched.preempted_request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None and request.swapped_block_ids:
                self.kv.free(request)  # its host copy may never have been written
        self.last_stats = StepStats()  # the failed step ran nothing that listeners should count
        error = f"the engine step that ran this request failed: {type(exc).__name__}: {exc}"
        outputs = [self._fail(r, error) for r in sched.requests if not r.is_finished]
        if self.speculator is not None:
            for request_id in sched.finished_request_ids + [r.request_id for r in sched.requests]:
                self.speculator.proposer.release(request_id)
        return outputs

    def _propose(self) -> None:
        sched = self.scheduler
        waiting = sum(r.num_remaining_prefill for r in sched.waiting)
        waiting += sum(r.num_remaining_prefill for r in sched.running if r.num_remaining_prefill > 1)
        self.speculator.propose(sched.running, waiting, self.config.max_num_batched_tokens, self.max_model_len)

    def _make_output(self, request: Request) -> RequestOutput | None:
        detok = self.detokenizers[request.request_id]
        new_ids = request.token_ids[request.num_prompt_tokens + detok.num_tokens:]  # (not a copy of every output token)
        # (the scheduler finishes as "stopped" on an EOS or stop token, or on a completed grammar,
        # whose last token is text; stop strings are found just below)
        last = new_ids[-1] if new_ids else None
        ended_on_stop_token = (request.status == RequestStatus.FINISHED_STOPPED
                               and (last in request.eos_token_ids or last in request.params.stop_token_ids))
        fed = detok.num_tokens
        delta, stop = detok.update(new_ids, stop_token=ended_on_stop_token)
        if stop is not None and request.status != RequestStatus.FINISHED_ERROR:  # a failed grammar stays an error
            used = detok.num_tokens - fed  # accepted drafts past the one that completed the stop string
            if used < len(new_ids):
                request.drop_output_tokens(len(new_ids) - used)
                new_ids = new_ids[:used]
            if not request.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            request.status = RequestStatus.FINISHED_STOPPED  # a stop string outranks a length limit
            request.stop_reason = stop
        elif request.is_finished:
            delta += detok.flush()
        if request.is_finished:
            del self.detokenizers[request.request_id]
        elif request.params.output_kind == "final":
            return None  # (its text is still followed: stop strings end it)
        return self._output(request, detok.text[:detok.emitted], delta, new_ids)

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
            return self._make_output(unreported)
        if request is None:  # unknown, or finished by a step that was cut short (Ctrl-C) before its output
            self.detokenizers.pop(request_id, None)
            return None
        detok = self.detokenizers.pop(request_id, None)
        delta = detok.flush() if detok else ""  # the held-back tail: no stop string can match now
        return self._output(request, detok.text[:detok.emitted] if detok else "", delta, [])

    def _output(self, request: Request, text: str, delta: str, new_ids: list[int]) -> RequestOutput:
        if request.params.output_kind == "final":  # its one report: all of it is new
            delta, new_ids = text, request.output_token_ids
        completion = CompletionOutput(
            index=0, text=text, token_ids=request.output_token_ids, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=list(request.output_logprobs) if request.params.logprobs is not None else None,
            cumulative_logprob=request.cumulative_logprob if request.params.logprobs is not None else None)
        times = request.times
        metrics = RequestMetrics(times.arrival, times.first_scheduled, times.first_token, times.finished,
                                 request.num_cached_tokens, request.num_preemptions)
        grammar = request.grammar
        failed = grammar is not None and grammar.failed and request.status == RequestStatus.FINISHED_ERROR
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                             request.is_finished, new_text=delta, new_token_ids=new_ids, metrics=metrics,
                             prompt_logprobs=request.prompt_logprobs if request.params.prompt_logprobs is not None
                             else None,
                             error=f"its structured output's grammar failed: {grammar.error}" if failed else None)

    def _record_stats(self, sched, result: RunnerOutput, time_schedule: float, time_detokenize: float,
                      start: float, end: float) -> None:
        """The step's figures; preemptions: all since the last record (a step that failed, or an
        async-scheduling call that completed no step, records none)."""
        pool = self.kv.pool
        s = StepStats(
            num_seqs=len(sched.requests), num_tokens=sched.total_num_tokens,
            num_prefill_tokens=sched.num_prefill_tokens, num_decode_tokens=sched.num_decode_tokens,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=pool.num_used_blocks, kv_blocks_total=pool.num_blocks,
            kv_slots_used=self.kv.slots_filled(self.scheduler.running),
            prefix_tokens_queried=self.kv.prompt_tokens_queried, prefix_tokens_hit=self.kv.prompt_tokens_hit,
            num_evictions=pool.num_evictions,
            num_preemptions=self.scheduler.num_preemptions - self._preemptions_recorded,
            time_schedule=time_schedule, time_prepare=result.time_prepare, time_forward=result.time_forward,
            time_sample=result.time_sample, time_detokenize=time_detokenize, time_total=end - start,
            start=start, num_draft_tokens=result.num_draft_tokens, num_accepted_tokens=result.num_accepted_tokens)
        self._preemptions_recorded = self.scheduler.num_preemptions
        self.last_stats = s
        for listener in self.stats_listeners:
            listener(s)
