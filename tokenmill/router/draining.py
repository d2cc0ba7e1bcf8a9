"""The router's uvicorn server, which drains before it ends.

At a first SIGINT/SIGTERM uvicorn takes no new connections and waits for the open ones; this
server sets `stopping` (forward.py: what is still in flight then ends at once, cleanly)
`drain_s` seconds later, or at once at a second signal, instead of uvicorn's forced exit, which
would cut streams off without a word. It exits 0 rather than re-raising the signal, as
`tokenmill serve` does: the shutdown the signal asked for is a clean one.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

logger = logging.getLogger("tokenmill.router")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, stopping: asyncio.Event, drain_s: float) -> None:
        super().__init__(config)
        self.stopping, self.drain_s = stopping, drain_s
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        # a signal handler: the loop is reached through call_soon_threadsafe, which wakes it
        if self.loop is None or not self.should_exit:
            logger.warning("stopping: requests in flight have %g s to finish", self.drain_s)
            super().handle_exit(sig, frame)
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.loop.call_later, self.drain_s, self.stopping.set)
        else:
            logger.warning("stopping now: ending the requests in flight")
            self.loop.call_soon_threadsafe(self.stopping.set)
        self._captured_signals.clear()
