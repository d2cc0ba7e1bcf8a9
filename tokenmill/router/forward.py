"""Sending a request to a replica, and to another one if it fails before the client got a byte.

An attempt fails when the replica cannot be reached, drops the connection before its whole
answer (a whole JSON body) or its first server-sent event (a stream), or answers 502, 503 or 504
(an engine that died, too many connections). A replica that fails in transport leaves routing at
once (replicas.py); the request then goes to the next candidate the policy picks among the healthy
replicas not yet tried. Every other answer, 4xx included, reaches the client unchanged. Once a
stream's first event has gone to the client the request is the replica's: a failure after that
ends the stream with an error event, as the server's own streams end when a step fails.

Streams are relayed by whole events (the replica's "data: ...\\n\\n"), so an error event never
lands inside a cut one. The router's in-flight count for a replica covers a request from its
send until its last byte (or the client leaving).

When the router is told to stop (server/draining.py sets `Forwarder.stopping` once the drain time after
a signal is up, or at a second signal), what is still in flight ends at once, cleanly: a request
whose answer has not begun gets a 503 (router_shutting_down), a relayed stream an error event of
that code; the replicas' responses are closed, so they abort the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
from fastapi.responses import JSONResponse, Response

from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import CacheAware, LeastLoaded, RoundRobin, least_loaded
from tokenmill.router.prefix import DEFAULT_DECODE_TOKENS
from tokenmill.router.replicas import Replica
from tokenmill.server.protocol import error_body

logger = logging.getLogger("tokenmill.router")

T = TypeVar("T")

RETRIED_STATUSES = (502, 503, 504)
FORWARDED_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
KEPT_RESPONSE_HEADERS = ("content-type", "retry-after", "allow", "www-authenticate", "x-request-id")
REPLICA_HEADER = "x-tokenmill-replica"   # names the replica that answered
STREAM_WRITE_TIMEOUT = 60.0              # default seconds a stream's client may take nothing before it is let go


class AttemptFailed(Exception):
    """An attempt that the client saw nothing of; `answer`: the replica's retryable answer, what the
    client gets if no other replica answers."""

    def __init__(self, answer: Response | None = None) -> None:
        super().__init__()
        self.answer = answer


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class RouterStopping(Exception):
    """The router's shutdown ended a request before its answer was ready."""


async def until_disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def settle(work: Awaitable[T], receive, stopping: asyncio.Event) -> T:
    """`work`'s result; ClientGone if the client disconnects first, RouterStopping if `stopping`
    is set first (`work` cancelled either way)."""
    task = asyncio.ensure_future(work)
    gone, stop = asyncio.ensure_future(until_disconnected(receive)), asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, gone, stop):
            pending.cancel()
        await asyncio.gather(task, gone, stop, return_exceptions=True)
    if task.cancelled():
        raise ClientGone if not gone.cancelled() else RouterStopping
    return task.result()


def request_headers(headers) -> dict[str, str]:
    """The client's headers a replica needs (its API key among them), by FORWARDED_REQUEST_HEADERS."""
    return {name: headers[name] for name in FORWARDED_REQUEST_HEADERS if name in headers}


def answer_headers(upstream: httpx.Response, replica: Replica) -> dict[str, str]:
    kept = {name: upstream.headers[name] for name in KEPT_RESPONSE_HEADERS if name in upstream.headers}
    return {**kept, REPLICA_HEADER: replica.url}


SHUTTING_DOWN = "the router is shutting down"


def shutting_down() -> JSONResponse:
    """503 for a request the router's shutdown ended before its answer began."""
    return JSONResponse(error_body(SHUTTING_DOWN, "server_error", code="router_shutting_down"), status_code=503)


def no_replica(tried: list[Replica]) -> JSONResponse:
    """503 when no healthy replica is left to try."""
    message = (f"no replica answered ({len(tried)} tried)" if tried else "no replica is healthy")
    return JSONResponse(error_body(message, "server_error", code="no_replica_available"), status_code=503)


async def sse_events(upstream: httpx.Response) -> AsyncGenerator[bytes, None]:
    """The replica's stream cut after whole events (each ending in a blank line); a partial last
    event of a stream that ends without its blank line comes last."""
    pending = b""
    async for chunk in upstream.aiter_raw():
        pending += chunk
        cut = pending.rfind(b"\n\n")
        if cut >= 0:
            yield pending[:cut + 2]
            pending = pending[cut + 2:]
    if pending:
        yield pending


@dataclass
class Forwarder:
    client: httpx.AsyncClient
    replicas: list[Replica]
    policy: CacheAware | RoundRobin | LeastLoaded
    metrics: RouterMetrics
    write_timeout: float = STREAM_WRITE_TIMEOUT  # a stream's client that takes nothing this long is let go
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # set: end what is in flight (shutdown)

    async def forward(self, method: str, path: str, content: bytes, headers: dict[str, str],
                      hashes: list[bytes] | None, decode_tokens: int = DEFAULT_DECODE_TOKENS) -> Response:
        """The first answer a replica gives that is not a failed attempt. hashes: the request's
        prefix chain, for the policy; None for a request that generates nothing (any replica,
        the least loaded, takes it). decode_tokens: the decode steps it asks for (prefix.decode_tokens)."""
        tried: list[Replica] = []
        last_answer: Response | None = None
        while candidates := [r for r in self.replicas if r.healthy and r not in tried]:
            if hashes is None:
                replica, reason = least_loaded(candidates), "other"
            else:
                replica, reason = self.policy.choose(candidates, hashes, decode_tokens)
            tried.append(replica)
            self.metrics.routed.labels(replica.url, reason).inc()
            uncached = replica.route(hashes) if hashes is not None else 0
            try:
                return await self._attempt(replica, self.client.build_request(
                    method, replica.url + path, content=content, headers=headers), uncached)
            except AttemptFailed as failed:
                self.metrics.failed.labels(replica.url).inc()
                last_answer = failed.answer or last_answer
        return last_answer or no_replica(tried)

    async def _attempt(self, replica: Replica, request: httpx.Request, uncached: int) -> Response:
        """The replica's answer: whole, or a stream whose first event has come. Until then the
        request counts in the replica's prefilling requests, its `uncached` chunks in its backlog."""
        replica.in_flight += 1
        replica.prefilling += 1
        replica.backlog += uncached
        upstream: httpx.Response | None = None
        relayed = False   # a stream's relay releases the upstream and the in-flight count itself
        try:
            upstream = await self.client.send(request, stream=True)
            if "text/event-stream" not in upstream.headers.get("content-type", ""):
                body = await upstream.aread()
                answer = Response(body, upstream.status_code, answer_headers(upstream, replica))
                if upstream.status_code in RETRIED_STATUSES:
                    logger.warning("replica %s answered %d to %s; trying another", replica.url,
                                   upstream.status_code, request.url.path)
                    raise AttemptFailed(answer)
                return answer
            events = sse_events(upstream)
            first = await anext(events)
            relayed = True
            return RelayResponse(upstream.status_code, answer_headers(upstream, replica), first, events,
                                 upstream, replica, self.write_timeout, self.stopping)
        except (httpx.HTTPError, StopAsyncIteration) as exc:
            replica.mark_down(f"{request.url.path}: {type(exc).__name__} {exc}")
            raise AttemptFailed() from None
        finally:
            replica.prefilling -= 1
            replica.backlog -= uncached
            if not relayed:
                replica.in_flight -= 1
                if upstream is not None:
                    await upstream.aclose()


class RelayResponse(Response):
    """A response relaying a replica's event stream, whose first event has come, event by
    event. It ends when the replica's stream does (with an error event if the replica fails), when
    the client disconnects, when the client takes nothing for `write_timeout` seconds, or when
    `stopping` is set (with an error event); in each case the replica's response is closed (the
    replica then aborts the request) and the replica's in-flight count given back."""

    def __init__(self, status: int, headers: dict[str, str], first: bytes, events: AsyncGenerator[bytes, None],
                 upstream: httpx.Response, replica: Replica, write_timeout: float, stopping: asyncio.Event) -> None:
        super().__init__(status_code=status)
        self.relayed_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.first, self.events, self.upstream, self.replica = first, events, upstream, replica
        self.write_timeout, self.stopping = write_timeout, stopping
        self.started = False  # whether the answer's head went out

    async def __call__(self, scope, receive, send) -> None:
        relay = asyncio.ensure_future(self._relay(send))
        gone = asyncio.ensure_future(until_disconnected(receive))
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({relay, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, gone, stop):
                task.cancel()
            await asyncio.gather(relay, gone, stop, return_exceptions=True)
            await self.events.aclose()
            await self.upstream.aclose()
            self.replica.in_flight -= 1
        if relay.cancelled() and gone.cancelled():  # the shutdown's: the client is told, within a second
            stopped = error_body(SHUTTING_DOWN, "server_error", code="router_shutting_down")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    if not self.started:
                        await self._start(send)
                    await send({"type": "http.response.body", "more_body": False,
                                "body": f"data: {json.dumps(stopped)}\n\ndata: [DONE]\n\n".encode()})

    async def _relay(self, send) -> None:
        await self._start(send)
        await self._send_body(send, self.first)
        try:
            async for event in self.events:
                await self._send_body(send, event)
        except httpx.HTTPError as exc:
            self.replica.mark_down(f"stream: {type(exc).__name__} {exc}")
            failure = error_body(f"the replica serving this stream failed: {type(exc).__name__}", "server_error",
                                 code="replica_failed")
            await self._send_body(send, f"data: {json.dumps(failure)}\n\ndata: [DONE]\n\n".encode())
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _start(self, send) -> None:
        self.started = True
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.relayed_headers})

    async def _send_body(self, send, data: bytes) -> None:
        try:  # a timeout scope, not wait_for: that runs each send as a task of its own
            async with asyncio.timeout(self.write_timeout):
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except TimeoutError:
            logger.info("a stream's client took nothing for %g s: ended", self.write_timeout)
            raise
