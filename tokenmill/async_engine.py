"""AsyncLLMEngine: the synchronous engine stepping in its own thread, bridged to asyncio.

    event loop (server)                     engine thread
    make_request (validate, may raise)
    generate()  -> commands.put(("add", r)) ->  drain commands: engine.add / engine.abort
    await stream.get()  <- call_soon_threadsafe(deliver, outputs)  <- engine.step()

The event loop never waits on a forward pass: the engine thread owns the engine, takes
adds and aborts from a thread-safe command queue between steps, and hands each step's
outputs to the loop in one call_soon_threadsafe; the loop routes them to one slot per request,
where an output the consumer has not taken yet is merged with the next (a client that stops
reading holds one output, not one per step). A client that goes away (its generator is closed
or cancelled) aborts its request, which leaves the batch within one step with its KV blocks
back in the pool.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from tokenmill.engine import LLMEngine
from tokenmill.input_processor import Prompt
from tokenmill.outputs import RequestOutput, StepStats
from tokenmill.pooling_params import PoolingParams
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
LOAD_POLL_SECONDS = 0.001  # how often the engine thread asks for KV loads when nothing else can run


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error it could not recover from."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down: it finishes the requests it has and takes no new ones."""


@dataclass
class _Stream:
    """One request's outputs not yet taken by its consumer: at most one. Outputs are cumulative,
    so one that arrives before the consumer took the last absorbs it (RequestOutput.merged): a
    client that stops reading holds one output, not a copy of its output so far per step."""

    pending: RequestOutput | None = None
    error: BaseException | None = None      # the engine loop died: raised once pending is taken
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False

    def put(self, out: RequestOutput) -> None:
        self.pending = out if self.pending is None else self.pending.merged(out)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.pending is None:
            if self.error is not None:
                raise self.error
            self.ready.clear()
            await self.ready.wait()
        out, self.pending = self.pending, None
        return out


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine,
                 listeners: Sequence[Callable[[StepStats | None, list[RequestOutput]], None]] = (),
                 idle_wait: float = 0.05) -> None:
        self.engine = engine
        # Called on the engine thread with each step's stats and outputs, and with (None, outputs)
        # for requests ended by an abort (metrics and spans hang off this).
        self.listeners = list(listeners)
        self.idle_wait = idle_wait
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closing = False  # abort_all was called: requests added from then on end at once
        self._drain_started: float | None = None  # when drain was called: requests arriving later are refused
        self.error: BaseException | None = None  # set when the loop died

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread. Call it on the thread that built the engine (its OpenMP
        workers are let go here: see LLMEngine.release_threads)."""
        self._loop = asyncio.get_running_loop()
        self.engine.release_threads()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def rank_death(self) -> str | None:
        """What ended a tensor-parallel rank the engine started (every step then fails), or None."""
        ranks = self.engine.ranks
        return ranks.death() if ranks is not None else None

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def closing(self) -> bool:
        """Whether abort_all was called (the server is shutting down)."""
        return self._closing

    @property
    def draining(self) -> bool:
        """Whether drain (or abort_all) was called: the server is shutting down."""
        return self._drain_started is not None or self._closing

    def drain(self) -> None:
        """Shutdown with time to finish: requests that arrived before it run on (one still being
        tokenized included); make_request and make_embedding_request raise EngineDrainingError
        for one that arrives later."""
        self._drain_started = time.monotonic()

    def abort_all(self) -> None:
        """End every request (shutdown): each stream gets a final output with finish_reason "abort".
        So does each request added from now on: one still being tokenized when the signal came
        would otherwise run in full, past uvicorn's graceful timeout, and have its connection cut."""
        self._closing = True
        self._commands.put(("abort_all", None))
        self._wake.set()

    # ---- requests --------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
                     deadline: float | None = None, arrival_time: float | None = None) -> Request:
        """Validate on the caller's thread (ValueError for a request that can never be served;
        EngineDrainingError once the server is draining; EngineDeadError once a tensor-parallel
        rank has exited)."""
        self._check_admitting(arrival_time)
        return self.engine.input_processor.make_request(request_id, prompt, params, arrival_time=arrival_time,
                                                        priority=priority, deadline=deadline)

    def make_embedding_request(self, request_id: str, prompt: Prompt, pooling: PoolingParams | None = None,
                               arrival_time: float | None = None) -> Request:
        """An embedding request, validated on the caller's thread; `generate` runs it."""
        self._check_admitting(arrival_time)
        return self.engine.input_processor.make_embedding_request(request_id, prompt, pooling, arrival_time)

    def _check_admitting(self, arrival_time: float | None) -> None:
        started = self._drain_started
        if started is not None and (arrival_time is None or arrival_time >= started):
            raise EngineDrainingError("the server is shutting down: it takes no new requests")
        if (death := self.rank_death()) is not None:  # every step would fail: refused, not run to a failure
            raise EngineDeadError(death)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs (from make_request) step by step until it finishes.
        Raises EngineDeadError if the engine loop died."""
        if not self.is_alive:
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = _Stream()
        self._commands.put(("add", request))
        self._wake.set()
        try:
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    stream.finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:  # the consumer went away: free the request's blocks
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    async def call_between_steps(self, fn: Callable[[], T]) -> T:
        """What `fn()` returns, called on the engine thread between two steps (at once while it
        idles): a consistent read of state that only that thread changes (the dashboard's
        snapshot), which costs the engine nothing while nobody asks. Raises EngineDeadError if the
        engine loop is not running, and what `fn` raised."""
        if not self.is_alive:
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")
        future = self._loop.create_future()
        self._commands.put(("call", (fn, future)))
        self._wake.set()
        return await future

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            engine.use_device()
            while not self._stopping:
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    engine.idle()
                    self._wake.wait(self.idle_wait)
                    self._wake.clear()
                    continue
                if engine.waiting_on_loads():  # K/V on its way from a prefill instance: poll, not step
                    self._wake.wait(LOAD_POLL_SECONDS)
                    self._wake.clear()
                    continue
                self._step()
            # Stopping: an abort_all queued behind whatever is pending (an add that came after the
            # server's own abort_all, say) ends every open stream, so that none waits forever.
            self._commands.put(("abort_all", None))
            self._drain_commands()
        except BaseException as exc:  # the loop cannot go on: fail every waiting client
            logger.exception("engine loop died")
            self.error = exc
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine loop died: {exc!r}"))

    def _step(self) -> None:
        """One step, its outputs handed to the loop and to the listeners (and not kept here: while the
        engine idles, the last step's outputs are only where their consumers hold them)."""
        outputs = self.engine.step()
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        for listener in self.listeners:
            listener(self.engine.last_stats, outputs)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                self._call(*arg)
                continue
            if kind == "add":
                self.engine.add(arg)
                if not self._closing:
                    continue
                kind, arg = "abort", arg.request_id
            ids = self.engine.unfinished_request_ids() if kind == "abort_all" else [arg]
            outputs = [out for out in map(self.engine.abort, ids) if out is not None]
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
                for listener in self.listeners:
                    listener(None, outputs)

    def _call(self, fn: Callable[[], T], future: asyncio.Future) -> None:
        """Run a call_between_steps function and hand its result (or error) to the waiting caller."""
        try:
            result, error = fn(), None
        except Exception as exc:  # the caller's to handle, not the engine's
            result, error = None, exc
        self._loop.call_soon_threadsafe(_settle, future, result, error)

    # ---- on the event loop -----------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(error)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    """Resolve a call_between_steps future, unless its caller stopped waiting (cancelled)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
