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
        self.deadline: asyncio.TimerHandle | None = None  # the head's or the body's (never both at once)
        self.timed_out = None  # what its end runs: _header_timed_out or _body_timed_out

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.app = over_capacity  # handle_events runs self.app for each request
        # a new connection that sends nothing is as idle as one after a response
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:  # the head is in, the body coming: each byte of it puts the deadline off
            self._set_deadline(self.body_timeout, self._body_timed_out)
        elif state is not h11.IDLE:  # the request is in (or the connection is done)
            self._cancel_deadline()
        elif self.deadline is None or self.timed_out != self._header_timed_out:  # the first bytes of a head:
            self._set_deadline(self.header_timeout, self._header_timed_out)  # later ones do not put it off

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _set_deadline(self, timeout: float, timed_out) -> None:
        self._cancel_deadline()
        if not self.transport.is_closing():
            self.deadline, self.timed_out = self.loop.call_later(timeout, timed_out), timed_out

    def _cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _header_timed_out(self) -> None:
        self.deadline = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._close(f"no whole request head within {self.header_timeout:g} s")

    def _body_timed_out(self) -> None:
        self.deadline = None
        if self.flow.read_paused:  # the app has not taken what came: the wait is the server's, not the client's
            self._set_deadline(self.body_timeout, self._body_timed_out)
        elif not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            self._close(f"no byte of its request body for {self.body_timeout:g} s")

    def _close(self, why: str) -> None:
        """Close the connection, first answering 408 with `why` where no response has begun (as
        nginx answers a request that stops coming), so that a client sees why."""
        logger.info("closed a connection from %s: %s", self.client[0] if self.client else "?", why)
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = json.dumps(error_body(why, code="request_timeout")).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
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
