"""Connections that cannot hold the server down: idle ones and half-sent requests are closed,
open ones are capped, and the open-file limit leaves room for them.

uvicorn's h11 protocol closes a connection idle after a response (timeout_keep_alive), but waits
without end on a new connection that sends nothing and on a request whose headers come a byte at
a time (slowloris); such connections pile up until accept() fails with "Too many open files" and
/health stops answering for everyone, before any API key is checked. `GuardedH11Protocol` closes a
new connection idle past the keep-alive timeout, and one whose request head (request line and
headers) is not complete within `header_timeout` of its first byte, and one whose request body
stops coming: no byte of it for `body_timeout` while the server waits for it (not while the app
has yet to take what came). A few such stalled bodies would otherwise hold the connection cap
for good. Past `max_connections` open connections, a new one's request gets a 503 and the
connection closes; uvicorn's own limit_concurrency answers text/plain, and at its limit refuses
requests on connections already open as well.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.server.protocol import error_body

logger = logging.getLogger("tokenmill.server")

# Open files kept for what is not a connection (the model's files, logs, the engine's own).
FILES_RESERVED = 128


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with deadlines for request heads and bodies and a cap on
    connections; `uvicorn.Config(http=functools.partial(GuardedH11Protocol, header_timeout=...,
    body_timeout=..., max_connections=...))`."""

    def __init__(self, *args, header_timeout: float, max_connections: int, body_timeout: float = 30.0,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout, self.body_timeout, self.max_connections = header_timeout, body_timeout, max_connections
        self.header_deadline: asyncio.TimerHandle | None = None
        self.body_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.app = over_capacity  # handle_events runs self.app for each request
        # a new connection that sends nothing is as idle as one after a response
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection is done)
            self._cancel_header_deadline()
        elif self.header_deadline is None and not self.transport.is_closing():  # the first bytes of a head
            self.header_deadline = self.loop.call_later(self.header_timeout, self._header_timed_out)
        self._await_body()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        self._cancel_body_deadline()
        super().connection_lost(exc)

    def _await_body(self) -> None:
        """(Re)start the body's deadline while the request's body is still coming; stop it once
        it is in."""
        self._cancel_body_deadline()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.body_deadline = self.loop.call_later(self.body_timeout, self._body_timed_out)

    def _cancel_body_deadline(self) -> None:
        if self.body_deadline is not None:
            self.body_deadline.cancel()
            self.body_deadline = None

    def _body_timed_out(self) -> None:
        self.body_deadline = None
        if self.flow.read_paused:  # the app has not taken what came: the wait is the server's, not the client's
            self._await_body()
        elif not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            logger.info("closed a connection from %s: no byte of its request body for %g s",
                        self.client[0] if self.client else "?", self.body_timeout)
            self.transport.close()

    def _cancel_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _header_timed_out(self) -> None:
        self.header_deadline = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            logger.info("closed a connection from %s: no whole request head within %g s",
                        self.client[0] if self.client else "?", self.header_timeout)
            self.transport.close()


async def over_capacity(scope, receive, send) -> None:
    """The answer on a connection past the cap: 503, and the connection closes."""
    body = json.dumps(error_body("the server has too many open connections; try again", "server_error",
                                 code="too_many_connections")).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})


def raise_open_file_limit() -> int | None:
    """Raise the soft limit on open files to the hard one (each connection is one); the soft
    limit in force after, or None where the system has no such limit."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an unlimited hard limit the kernel will not grant as a soft one
            pass
    return None if soft == resource.RLIM_INFINITY else soft


def connection_cap(requested: int, open_files: int | None) -> int:
    """The cap on open connections: `requested`, lowered to leave FILES_RESERVED of the open-file
    limit for what is not a connection (and at least 1)."""
    if open_files is None or requested <= open_files - FILES_RESERVED:
        return requested
    cap = max(1, open_files - FILES_RESERVED)
    logger.warning("--max-connections %d lowered to %d: the open-file limit is %d", requested, cap, open_files)
    return cap
