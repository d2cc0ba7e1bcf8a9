"""Plumbing for the server: merging request streams, the access log, the API key, the
request-body size limit, and request ids.

The middlewares are plain ASGI ones, not Starlette's BaseHTTPMiddleware (`@app.middleware`),
which hands every chunk of a streamed response through a memory stream and a task of its own:
per token, that work showed in a stream's inter-token time (BENCHMARKS.md, the server A/Bs). For
the same reason a request's single stream is read directly; merge_streams' tasks and slots serve
only requests with several streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from starlette.datastructures import Headers

from tokenmill.server.protocol import error_body

T = TypeVar("T")


async def merge_streams(streams: list[AsyncIterator[T]],
                        merge: Callable[[T, T], T]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index.

    Each iterator is read at once into one slot of its own: an item the consumer has not taken
    yet is merged with the next one of the same iterator (`merge(older, newer)`), so a consumer
    that lags holds one item per iterator, whatever the lag. Slots are taken in the order they
    filled. Closing the merged iterator (a client went away) cancels every pump task, which
    closes each underlying stream, which aborts its request in the engine. One stream (a
    request with one prompt and n = 1, the usual case) is read directly, without tasks.
    """
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    pending: dict[int, T] = {}  # (insertion order: the order the slots filled)
    errors: list[BaseException] = []
    ready = asyncio.Event()
    running = len(streams)

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        nonlocal running
        try:
            async for item in stream:
                pending[index] = merge(pending[index], item) if index in pending else item
                ready.set()
        except BaseException as exc:  # hand errors (and cancellation) to the consumer
            errors.append(exc)
            raise
        finally:
            running -= 1
            ready.set()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            if errors:
                raise errors[0]
            if pending:
                index = next(iter(pending))
                yield index, pending.pop(index)
            elif not running:
                return
            else:
                ready.clear()
                await ready.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class AccessLogMiddleware:
    """One log line per HTTP request once its response is complete: method, path, status and
    time taken (for a stream, until its last chunk); and, where given, `on_response(scope,
    status, seconds)` then (the router's metrics)."""

    def __init__(self, app, logger: logging.Logger, on_response: Callable | None = None) -> None:
        self.app, self.logger, self.on_response = app, logger, on_response

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), 500

        async def logging_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, logging_send)
        finally:
            seconds = time.monotonic() - start
            self.logger.info("%s %s %d %.0f ms", scope["method"], scope["path"], status, seconds * 1e3)
            if self.on_response is not None:
                self.on_response(scope, status, seconds)


class BodyLimitMiddleware:
    """Answer 413 for request bodies over `max_bytes`, by header or by counting the stream (a
    chunked upload has no length header)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send)
        received = 0
        rejected = started = False

        async def counting_receive():
            # Past the limit: answer 413 here (unless the app has begun its own answer) and tell
            # the app the client left. An exception would reach FastAPI's body parsing, which
            # turns any error into its own 400.
            nonlocal received, rejected
            message = await receive()
            if message["type"] == "http.request" and not rejected:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    rejected = True
                    if not started:
                        await self._reject(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if rejected and not started:  # after the 413, whatever the app answers is dropped
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _reject(self, send) -> None:
        await send_error(send, 413, error_body(f"request body exceeds {self.max_bytes} bytes", param="body",
                                               code="request_too_large"))


class RequestIdMiddleware:
    """A request's X-Request-Id header back on its response, whatever answers it (an endpoint, a
    middleware's error, or an error nothing handled): vLLM's --enable-request-id-headers, for a
    client or proxy that follows one request through logs. Completions, chat and embeddings also
    take it as the answer's id (answer_ids); with the header twice, both read the first. Added
    last, it is the outermost of the app's own layers, so an exception that escapes them before
    the response began gets its 500 here, as JSON with the header (Starlette's error layer outside
    then sends nothing more), and is raised on for the server to log and close the connection."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("x-request-id")
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if given:
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                    message = {**message, "headers": [*headers, (b"x-request-id", given.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if not started:  # the server closes the connection after this: say so to keep-alive clients
                await send_error(send_with_id, 500, error_body("internal server error", "server_error"),
                                 ((b"connection", b"close"),))
            raise


class ApiKeyMiddleware:
    """401 for a request to a protected path (every /v1 one, /tokenize, /detokenize, the
    dashboard's data, /dashboard/state) without 'Authorization: Bearer KEY', before its body is
    read: as a FastAPI dependency the check ran after the body was parsed, so malformed JSON got
    a 400 first. The dashboard page itself holds no data: it sends the key on its fetches."""

    PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/dashboard/state")

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # mounted under a prefix (or served with --root-path)
            path = path[len(root):]
        if scope["type"] == "http" and path.startswith(self.PROTECTED):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                return await send_error(send, 401, error_body(
                    "missing or incorrect API key (send 'Authorization: Bearer KEY')", "authentication_error",
                    code="invalid_api_key"))
        await self.app(scope, receive, send)


async def send_error(send, status: int, body: dict, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """A whole JSON error response, straight from a middleware."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})
