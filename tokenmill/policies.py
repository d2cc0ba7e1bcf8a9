"""Scheduling policies: in what order the scheduler serves requests, and whom it preempts.

The scheduler owns the queues, the budget and the KV pool; a policy only ranks requests.
Each policy answers, in one class, every question the scheduler asks it:

  - `next_waiting`: which waiting request is admitted next;
  - `running_order`: in which order running requests take the step's budget and free blocks
    (those first in line take the last blocks, so this order decides who runs out);
  - `pick_victim`: which running request gives its blocks back when the pool is empty;
  - `preempts_at_admission` / `admission_victims`: whether a waiting request may preempt
    running ones to get in, and which, most expendable first;
  - `decodes_ahead_of`: how many of the step's decodes a long prompt is held back for
    (the budget rule: see `Scheduler._chunk`).

Every policy ranks requests with `rank`: smaller is served first and preempted last. The
base class builds the answers from that rank; a policy overrides only where it differs.
Whatever the policy, a request that has waited `starvation_seconds` is admitted ahead of
the policy's order (oldest first), so that no rank keeps a request out for ever.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar

from tokenmill.request import Request, RequestStatus


class SchedulingPolicy:
    """The base ranking shared by fcfs, srpf and edf; subclasses define `rank`."""

    name: ClassVar[str]
    preempts_at_admission: ClassVar[bool] = False  # whether to look for `admission_victims` at all

    def __init__(self, starvation_seconds: float) -> None:
        self.starvation_seconds = starvation_seconds

    def rank(self, request: Request) -> tuple:
        """The request's place under this policy: smaller is served first and preempted last."""
        raise NotImplementedError

    def is_starving(self, request: Request, now: float) -> bool:
        return now - request.arrival_time >= self.starvation_seconds

    def waiting_rank(self, request: Request, now: float) -> tuple:
        """Preempted requests first (they already got part of their service; oldest first), then
        starving ones (oldest first), then the policy's rank."""
        if request.status == RequestStatus.PREEMPTED:
            return (0, request.arrival_time)
        if self.is_starving(request, now):
            return (1, request.arrival_time)
        return (2, *self.rank(request))

    def next_waiting(self, waiting: Iterable[Request], now: float) -> Request:
        """The request to admit next among `waiting` (not empty) at time `now`."""
        return min(waiting, key=lambda r: self.waiting_rank(r, now))

    def waiting_order(self, waiting: Iterable[Request], now: float) -> Iterator[Request]:
        """`waiting` in the order to admit them at time `now` (ties in the order given), produced as
        they are asked for: the first by one scan (most steps admit one), the rest from a heap
        ranked once (a scan per admission would be quadratic in the queue)."""
        items = list(waiting)
        if not items:
            return
        first = self.next_waiting(items, now)
        yield first
        heap = [(self.waiting_rank(r, now), i, r) for i, r in enumerate(items) if r is not first]
        heapq.heapify(heap)
        while heap:
            yield heapq.heappop(heap)[2]

    def running_order(self, running: Sequence[Request]) -> list[Request]:
        """Decodes before prompt chunks (a decode is one token that a user is waiting on), each
        group in the policy's rank."""
        return sorted(running, key=lambda r: (r.num_remaining_prefill > 1, *self.rank(r)))

    def pick_victim(self, candidates: Sequence[Request]) -> Request | None:
        """The request to preempt among `candidates` (in admission order): the one ranked last,
        ties the latest admitted. None if there are none."""
        if not candidates:
            return None
        return max(enumerate(candidates), key=lambda ir: (*self.rank(ir[1]), ir[0]))[1]

    def admission_victims(self, request: Request, running: Sequence[Request]) -> list[Request]:
        """The running requests (in admission order) that waiting `request` may preempt to be
        admitted, the first to go first. Only consulted when `preempts_at_admission`."""
        return []

    def decodes_ahead_of(self, request: Request, decodes: Sequence[Request]) -> int:
        """How many of the step's `decodes` so far a long prompt of `request` is held back for."""
        return len(decodes)


class FcfsPolicy(SchedulingPolicy):
    """First come, first served: by arrival while waiting, by admission once running.

    A request readmitted after a preemption is admitted again later than requests that arrived
    after it, so among running requests admission order, not arrival, decides."""

    name = "fcfs"

    def rank(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def running_order(self, running: Sequence[Request]) -> list[Request]:
        return sorted(running, key=lambda r: r.num_remaining_prefill > 1)  # stable: admission order

    def pick_victim(self, candidates: Sequence[Request]) -> Request | None:
        return candidates[-1] if candidates else None


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` value first, then arrival; the priority comes before anything else.

    Priorities are served in order, each one's decodes before its prompt chunks: a more urgent
    prompt takes the budget and blocks before less urgent decodes, and a long one is held back
    only for decodes at least as urgent as it. A waiting request preempts running requests of
    lower priority to get in; a request preempted that way waits behind the more urgent ones
    (it comes first only among its own priority, so the request that preempted it is not
    preempted back)."""

    name = "priority"
    preempts_at_admission = True

    def rank(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)

    def waiting_rank(self, request: Request, now: float) -> tuple:
        if self.is_starving(request, now):
            return (1, request.arrival_time)
        return (2, request.priority, request.status != RequestStatus.PREEMPTED, request.arrival_time)

    def running_order(self, running: Sequence[Request]) -> list[Request]:
        return sorted(running, key=lambda r: (r.priority, r.num_remaining_prefill > 1, r.arrival_time))

    def admission_victims(self, request: Request, running: Sequence[Request]) -> list[Request]:
        """Those of lower priority than `request`: lowest first, ties the latest admitted."""
        lower = [(r.priority, i, r) for i, r in enumerate(running) if r.priority > request.priority]
        return [r for _, _, r in sorted(lower, key=lambda pir: pir[:2], reverse=True)]

    def decodes_ahead_of(self, request: Request, decodes: Sequence[Request]) -> int:
        return sum(1 for r in decodes if r.priority <= request.priority)


class SrpfPolicy(SchedulingPolicy):
    """Shortest remaining prefill first: fewest tokens left to compute before the request
    samples (its prompt; its prompt and output when replayed after a preemption), then arrival."""

    name = "srpf"

    def rank(self, request: Request) -> tuple:
        return (request.num_remaining_prefill, request.arrival_time)


class EdfPolicy(SchedulingPolicy):
    """Earliest deadline first, then arrival; a request without a deadline comes after all
    those with one."""

    name = "edf"

    def rank(self, request: Request) -> tuple:
        deadline = request.deadline if request.deadline is not None else float("inf")
        return (deadline, request.arrival_time)


POLICIES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls for cls in (FcfsPolicy, PriorityPolicy, SrpfPolicy, EdfPolicy)}


def make_policy(name: str, starvation_seconds: float) -> SchedulingPolicy:
    """The policy called `name` (one of `config.SCHEDULING_POLICIES`); ValueError for another."""
    if name not in POLICIES:
        raise ValueError(f"scheduling policy must be one of {tuple(POLICIES)}, got {name!r}")
    return POLICIES[name](starvation_seconds)
