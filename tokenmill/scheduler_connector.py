"""The scheduler's steps that involve a KV connector (kv_connector.py), apart from the rest of
its loop: loads started at admission and collected as they end, and blocks held for a peer.

`ConnectorSteps` is a part of Scheduler (scheduler.py), not a component of its own: its methods
read and write the scheduler's requests, queues and KV manager as the scheduler's other methods
do, and the scheduler calls them at the points kv_connector.py describes.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_connector import KVConnector
from tokenmill.request import Request, RequestStatus


class ConnectorSteps:
    connector: KVConnector | None
    kv: KVCacheManager
    clock: Callable[[], float]
    waiting: list[Request]
    running: list[Request]
    requests: dict[str, Request]
    held: dict[str, Request]                      # finished, blocks kept for a KV connector's peer
    loading: dict[str, tuple[Request, int]]       # waiting on a KV connector's load: (request, tokens)
    num_external_tokens: int
    _watermark_blocks: int
    _free: Callable[[Request], None]              # the scheduler's own: its blocks back to the pool
    _count_hit: Callable[[Request, int], None]    # the scheduler's own: a prefix hit's tokens computed
    _count_admission: Callable[[Request], None]   # the scheduler's own: a first admission in the counters

    def release_held(self) -> None:
        """Free the blocks of held requests the connector has released (once per schedule(), and
        while the engine idles)."""
        if self.connector is None or not self.held:
            return
        for request_id in self.connector.released():
            request = self.held.pop(request_id, None)
            if request is not None:
                self._free(request)

    def only_loading(self) -> bool:
        """Whether every unfinished request waits on a KV connector's load: a step has nothing to run."""
        return bool(self.loading) and len(self.loading) == len(self.requests)

    def _start_load(self, request: Request) -> bool | None:
        """Start a KV connector's load of the prompt tokens it can supply past the local prefix hit
        (leaving the last one to compute), into blocks allocated for them now but offered to the
        prefix cache only once loaded: the request then waits apart (`loading`, holding a seat)
        until collect_loads, and this returns True. False if there is nothing to load, or the load
        did not start (its blocks given back); either way it is admitted as any other. None if the
        blocks do not fit yet: it waits, as a request short of room does, rather than compute what
        a peer computed (and keeps that peer's blocks held meanwhile)."""
        if self.connector is None or request.swapped_block_ids:
            return False
        hit = self.kv.find_prefix(request)
        external = self._external_tokens(request, hit.num_tokens)
        if not external:
            return False
        if not self.kv.can_allocate(request, external, hit, reserve=self._watermark_blocks if self.running else 0):
            return None
        self.kv.allocate(request, external, hit, register=False)
        self._count_hit(request, hit.num_tokens)
        if not self.connector.start_load(request, request.block_ids, hit.num_tokens, external):
            self._free(request)  # admitted as any other, from its prefix hit again
            request.num_cached_tokens = 0
            return False
        self.waiting.remove(request)
        self.loading[request.request_id] = (request, external)
        request.timeline.add(self.clock(), "loading", tokens=external)
        return True

    def _external_tokens(self, request: Request, num_local: int) -> int:
        """Prompt tokens the KV connector supplies past the local hit, leaving the last one to compute."""
        if self.connector is None or request.needs_every_position:
            return 0
        offered = self.connector.num_matched_tokens(request, num_local)
        return max(0, min(offered, request.num_tokens - 1 - num_local))

    def collect_loads(self) -> None:
        """Requests whose load ended join the running batch (admitted now, in their blocks): past
        the loaded tokens, or (a failed load) to compute them here; from then on they are
        scheduled, and preempted, as any running request. A connector that failed to answer fails
        every load in flight."""
        if not self.loading:
            return
        ended = self.connector.finished_loads()
        if ended is None:
            for request_id in self.loading:
                self.connector.cancel_load(request_id)
            ended = dict.fromkeys(self.loading, False)
        for request_id, loaded in ended.items():
            request, external = self.loading.pop(request_id, (None, 0))
            if request is None:
                continue
            if loaded:
                request.num_computed_tokens += external
                request.num_external_tokens += external
                self.num_external_tokens += external
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._count_admission(request)
            request.timeline.add(self.clock(), "admitted", cached=request.num_cached_tokens,
                                 loaded=external if loaded else 0)
