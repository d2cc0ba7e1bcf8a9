"""GET /v1/requests/{id}: the timelines (timeline.py) of one response's engine requests, by the
`id` the response carried ("cmpl-...", "chatcmpl-..."), while they run and for a while after.

A response's requests are logged when they are built; once all have ended the response moves
to a ring of the last `size` ended ones, and the oldest falls out. Live responses are kept however
many there are, up to `size` times LIVE_FACTOR (a bound for requests an engine that died never
ends). The timelines are the requests' own objects, appended to by the engine thread; reading
them copies what is there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.request import Request
from tokenmill.server.errors import APIError
from tokenmill.timeline import Timeline

LIVE_FACTOR = 16


class RequestLog:
    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"request log size must be >= 0, got {size}")
        self.size = size
        self._live: OrderedDict[str, list[tuple[str, Timeline]]] = OrderedDict()
        self._ended: OrderedDict[str, list[tuple[str, Timeline]]] = OrderedDict()

    def add(self, response_id: str, requests: list[Request]) -> None:
        if self.size == 0:
            return
        self._sweep()
        self._live[response_id] = [(r.request_id, r.timeline) for r in requests]
        while len(self._live) > self.size * LIVE_FACTOR:
            self._live.popitem(last=False)

    def get(self, response_id: str) -> list[tuple[str, Timeline]] | None:
        self._sweep()
        return self._live.get(response_id) or self._ended.get(response_id)

    def _sweep(self) -> None:
        """Move responses whose requests have all ended into the ring of ended ones."""
        done = [rid for rid, entries in self._live.items()
                if all(t.time_of("finished") is not None for _, t in entries)]
        for rid in done:
            self._ended[rid] = self._live.pop(rid)
        while len(self._ended) > self.size:
            self._ended.popitem(last=False)


@dataclass
class RequestLogHandler:
    log: RequestLog

    async def request(self, response_id: str):
        entries = self.log.get(response_id)
        if entries is None:
            raise APIError(404, f"no request {response_id!r}: unknown, or ended before the last "
                                f"{self.log.size} kept", param="id", code="request_not_found")
        return {"id": response_id, "object": "request.timeline",
                "requests": [{"request_id": rid, **t.as_dict()} for rid, t in entries]}
