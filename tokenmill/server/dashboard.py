"""GET /dashboard: a live page of the scheduler at work; GET /dashboard/state: what it draws.

The page (static/dashboard.html, HTML with inline JS and CSS, no build step) fetches the state
from this server alone (its Content-Security-Policy allows no other origin) every half second:
the KV pool as a grid of blocks (free, cached-evictable, owned by one request, shared by
several), the running and waiting requests with their progress, the last steps' token budget
split between prefill and decode, preemptions, and throughput and latency over the last minute.

The state is read on the engine thread between two steps (AsyncLLMEngine.call_between_steps):
the scheduler's snapshot (its pool, one byte per block, and its requests) and the step
history's records, both copies, so the engine pays for a read only when a client asks, and at
most once per FRESH_SECONDS however many clients poll. Everything else (base64, percentiles,
JSON) runs on the event loop.

The page itself holds no data and is served to anyone, as /docs is; /dashboard/state needs the
API key (ApiKeyMiddleware guards it). The page takes the key from its address's
fragment (`/dashboard#key=KEY`: a fragment is never sent to the server, so it stays out of
access logs) or asks for it when the state answers 401, keeps it for the tab (sessionStorage)
and sends it as 'Authorization: Bearer KEY'.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from importlib import resources

from fastapi.responses import HTMLResponse, Response

from tokenmill.async_engine import AsyncLLMEngine
from tokenmill.kv_cache import BLOCK_CACHED, BLOCK_FREE, BLOCK_OWNED, BLOCK_SHARED
from tokenmill.outputs import RequestProgress, SchedulerSnapshot
from tokenmill.scheduler import Scheduler
from tokenmill.server.errors import APIError
from tokenmill.server.step_history import HistoryCopy, StepHistory, summary

FRESH_SECONDS = 0.2    # a state younger than this is served again rather than read again
READ_TIMEOUT = 10.0    # seconds to wait for the engine thread (a step of a big batch on a slow CPU)

# Scripts and styles inline, fetches to this origin only, images only as data: URLs (the favicon).
PAGE_HEADERS = {"content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; "
                "form-action 'none'; frame-ancestors 'none'",
                "cache-control": "no-store", "x-content-type-options": "nosniff"}


def page_html() -> bytes:
    """The page, as shipped in the package (pyproject's package-data)."""
    return resources.files("tokenmill.server").joinpath("static", "dashboard.html").read_bytes()


@dataclass
class DashboardHandler:
    async_engine: AsyncLLMEngine
    scheduler: Scheduler             # read only on the engine thread, through call_between_steps
    history: StepHistory             # the same (its listener runs there)
    max_num_seqs: int
    max_num_batched_tokens: int      # a step's token budget: the bar chart's full height
    page: bytes = field(default_factory=page_html)
    _latest: tuple[float, bytes] | None = field(default=None, init=False)  # (when read, JSON body)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    async def dashboard(self):
        return HTMLResponse(self.page, headers=PAGE_HEADERS)

    async def state(self):
        async with self._lock:  # clients that poll together share one read
            if self._latest is None or time.monotonic() - self._latest[0] > FRESH_SECONDS:
                self._latest = (time.monotonic(), await self._read())
        return Response(self._latest[1], media_type="application/json", headers={"cache-control": "no-store"})

    async def _read(self) -> bytes:
        try:  # (an engine loop that died raises EngineDeadError: a 503 from errors.py)
            snap, history, seconds = await asyncio.wait_for(self.async_engine.call_between_steps(self._copy),
                                                            READ_TIMEOUT)
        except asyncio.TimeoutError:
            raise APIError(503, f"the engine thread did not answer within {READ_TIMEOUT:g} s", "server_error",
                           code="engine_busy") from None
        body = state_body(snap, history, seconds)
        body.update(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)
        return json.dumps(body, separators=(",", ":")).encode()

    def _copy(self) -> tuple[SchedulerSnapshot, HistoryCopy, float]:
        """On the engine thread, between steps: the copies, and the seconds they took."""
        start = time.perf_counter()
        snap, history = self.scheduler.snapshot(), self.history.copy()
        return snap, history, time.perf_counter() - start


def state_body(snap: SchedulerSnapshot, history: HistoryCopy, read_seconds: float) -> dict:
    """/dashboard/state's JSON: the pool's states base64-encoded (one byte per block, 13 kB for
    10,000 blocks) with their counts, the requests' progress, the history's summary."""
    states = snap.block_states
    return {
        "object": "dashboard.state", "step": snap.step, "read_ms": round(read_seconds * 1e3, 3),
        "pool": {"num_blocks": len(states), "block_size": snap.block_size,
                 "states": base64.b64encode(states).decode(),
                 "free": states.count(BLOCK_FREE), "owned": states.count(BLOCK_OWNED),
                 "shared": states.count(BLOCK_SHARED), "cached": states.count(BLOCK_CACHED)},
        "num_running": len(snap.running), "num_waiting": snap.num_waiting, "num_preemptions": snap.num_preemptions,
        "running": [_progress(r) for r in snap.running], "waiting": [_progress(r) for r in snap.waiting],
        **summary(history),
    }


def _progress(r: RequestProgress) -> dict:
    return {"id": r.request_id, "prompt": r.num_prompt_tokens, "computed": r.num_computed_tokens,
            "output": r.num_output_tokens, "max_tokens": r.max_tokens, "blocks": r.num_blocks,
            "cached": r.num_cached_tokens, "preemptions": r.num_preemptions, "preempted": r.preempted}
