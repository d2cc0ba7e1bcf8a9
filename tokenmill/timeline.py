"""A request's life as events on one monotonic clock, and the latencies derived from them.

    arrival -> tokenized -> admitted(cached) -> chunk(step, tokens)... -> first_token
            -> [preempted(mode, tokens) -> resumed(cached | swapped) -> chunk...]
            -> spec(proposed, accepted)... -> finished(finish_reason)

The scheduler records every event after arrival and tokenizing (it alone changes a request's
state); each output token's time goes into `token_times` rather than into an event of its own,
eight bytes a token. The latencies that /metrics reports are read from here, so a timeline and
the metrics always agree:

    queue time    admitted - arrival          (the first admission)
    TTFT          first_token - arrival
    prefill time  first_token - admitted
    decode time   finished - first_token
    end to end    finished - arrival
    ITL           differences of token_times  (tokens of one step share its time)

`cached` counts prompt tokens the prefix cache served at the first admission only: what a
preempted request gets back from the cache when it resumes is its own discarded work, recorded
as the resumption's `cached` and never counted as a prefix-cache hit.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

EVENT_KINDS = ("arrival", "tokenized", "loading", "admitted", "chunk", "first_token", "preempted", "resumed", "spec",
               "finished")


@dataclass
class TimelineEvent:
    time: float                                         # monotonic seconds
    kind: str                                           # one of EVENT_KINDS
    data: dict[str, int | str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"time": self.time, "event": self.kind, **self.data}


@dataclass
class Timeline:
    events: list[TimelineEvent] = field(default_factory=list)
    token_times: array = field(default_factory=lambda: array("d"))  # one entry per output token
    # kind -> the time of its first event: every output of every step reads three of these
    _first_times: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for e in reversed(self.events):
            self._first_times[e.kind] = e.time

    def add(self, time: float, kind: str, **data: int | str) -> None:
        self.events.append(TimelineEvent(time, kind, data))
        self._first_times.setdefault(kind, time)

    def first(self, kind: str) -> TimelineEvent | None:
        return next((e for e in self.events if e.kind == kind), None)

    def time_of(self, kind: str) -> float | None:
        """When the first event of a kind happened (None: not yet)."""
        return self._first_times.get(kind)

    @property
    def queue_time(self) -> float | None:
        return _between(self.time_of("arrival"), self.time_of("admitted"))

    @property
    def ttft(self) -> float | None:
        return _between(self.time_of("arrival"), self.time_of("first_token"))

    @property
    def prefill_time(self) -> float | None:
        return _between(self.time_of("admitted"), self.time_of("first_token"))

    @property
    def decode_time(self) -> float | None:
        return _between(self.time_of("first_token"), self.time_of("finished"))

    @property
    def e2e(self) -> float | None:
        return _between(self.time_of("arrival"), self.time_of("finished"))

    def itl(self, start: int = 0) -> list[float]:
        """Gaps between output tokens from token `start` on (0: all)."""
        times = self.token_times
        return [times[i] - times[i - 1] for i in range(max(1, start), len(times))]

    def as_dict(self) -> dict:
        """The JSON form: events in order, each output token's time, the derived latencies."""
        events, times = list(self.events), self.token_times.tolist()  # copies: the engine thread appends
        snapshot = Timeline(events, array("d", times))
        return {"events": [e.as_dict() for e in events], "token_times": times,
                "latency": {"queue_time": snapshot.queue_time, "ttft": snapshot.ttft,
                            "prefill_time": snapshot.prefill_time, "decode_time": snapshot.decode_time,
                            "e2e": snapshot.e2e}}


def _between(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None
