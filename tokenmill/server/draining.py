"""A uvicorn server that gives the requests in flight time to finish when a signal ends it.

At a first SIGINT/SIGTERM uvicorn takes no new connections and waits for the open ones. This
server calls `begin()` at once (the owner refuses what still comes on an open connection) and
`end()` `drain_s` seconds later, or at once where `drain_s` is 0: the owner ends what is still in
flight, each with a last word to its client, rather than have uvicorn cut it off. A second signal,
of either kind, calls `end()` at once and closes every connection a second later, so the shutdown
waits for no client (one stalled mid-body included) yet still runs the app's shutdown, which
uvicorn's forced exit would skip. The process exits 0 rather than re-raising the signal: the
shutdown the signal asked for is a clean one. `tokenmill serve` and `tokenmill router` both run
under it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import uvicorn

logger = logging.getLogger("tokenmill.server")

LAST_WORDS_S = 1.0  # at a second signal: the time `end()`'s last chunks and error events have to go out


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_s: float, end: Callable[[], None],
                 begin: Callable[[], None] = lambda: None) -> None:
        super().__init__(config)
        self.drain_s, self.end, self.begin = drain_s, end, begin
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        if first and self.drain_s:
            logger.warning("stopping: requests in flight have %g s to finish", self.drain_s)
            self.begin()
            self._in_loop(self._end_later)
        else:
            if not first:
                logger.warning("stopping now: ending the requests in flight")
            self._in_loop(self.end)
        super().handle_exit(sig, frame)
        if not first:
            self.force_exit = False
            self._in_loop(self._close_soon)
        # uvicorn re-raises captured signals after its shutdown (the exit status would say "killed")
        self._captured_signals.clear()

    def _end_later(self) -> None:
        self.loop.call_later(self.drain_s, self.end)

    def _close_soon(self) -> None:
        self.loop.call_later(LAST_WORDS_S, self.close_connections)

    def _in_loop(self, fn: Callable[[], None]) -> None:
        # a signal handler runs between two bytecodes of the loop's thread: call_soon_threadsafe
        # wakes the loop to run `fn`; before the loop runs (a signal at start-up) `end` runs here
        if self.loop is None:
            self.end()
        else:
            self.loop.call_soon_threadsafe(fn)

    def close_connections(self) -> None:
        for connection in list(self.server_state.connections):
            connection.transport.close()
