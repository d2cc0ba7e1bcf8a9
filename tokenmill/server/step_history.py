"""The dashboard's recent past: the last steps' token split, and a minute of throughput and of
finished requests' latencies, recorded by a listener on the engine thread after each step.

Recording is a few appends a step (one tuple per step, one per-second bucket, one tuple per
finished request), cheap enough to run whether or not anyone watches: a page opened now shows
the minute before it. `copy()` takes plain lists on the engine thread (the dashboard calls it
between steps, so nothing changes while it copies); `summary()` turns them into the figures the
page shows, anywhere.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.outputs import RequestOutput, StepStats

STEPS_KEPT = 120          # steps the bar chart shows
WINDOW_SECONDS = 60       # the span of the throughput and latency figures
LATENCIES_KEPT = 10_000   # finished requests kept for the percentiles (a bound for floods of tiny requests)

# A per-second bucket: [second, prompt tokens, generated tokens, steps, busy seconds, preemptions, finished,
# step seconds]. Busy seconds are the part of that second some step ran in (at most 1); step seconds the
# whole time of the steps that ended in it (for the mean step time).
SECOND, PROMPT, GENERATED, STEPS, BUSY, PREEMPTIONS, FINISHED, STEP_TIME = range(8)


@dataclass(frozen=True)
class HistoryCopy:
    """StepHistory's records at one moment, as plain lists."""

    now: float
    steps: list[tuple[int, int, int, float]]           # (prefill tokens, decode tokens, preemptions, seconds)
    seconds: list[list]                                 # per-second buckets, oldest first (fields above)
    latencies: list[tuple[float, float, float, float | None]]  # (finished at, ttft, e2e, mean itl)


class StepHistory:
    def __init__(self, clock: Callable[[], float] = time.monotonic, steps_kept: int = STEPS_KEPT,
                 window: float = WINDOW_SECONDS) -> None:
        self.clock, self.window = clock, window
        self.steps: deque[tuple[int, int, int, float]] = deque(maxlen=steps_kept)
        self.seconds: deque[list] = deque()
        self.latencies: deque[tuple[float, float, float, float | None]] = deque(maxlen=LATENCIES_KEPT)

    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after each step (stats None: outputs of aborted requests)."""
        now = self.clock()
        bucket = self._bucket(now)
        if stats is not None and stats.time_total > 0:
            self.steps.append((stats.num_prefill_tokens, stats.num_decode_tokens, stats.num_preemptions,
                               stats.time_total))
            bucket[PROMPT] += stats.num_prefill_tokens
            bucket[STEPS] += 1
            bucket[STEP_TIME] += stats.time_total
            bucket[PREEMPTIONS] += stats.num_preemptions
            self._spread_busy(now - stats.time_total, now)
        for out in outputs:
            bucket[GENERATED] += len(out.new_token_ids)
            if out.finished:
                bucket[FINISHED] += 1
                timeline = out.timeline
                if timeline is not None and timeline.ttft is not None and timeline.e2e is not None:
                    times = timeline.token_times
                    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
                    self.latencies.append((now, timeline.ttft, timeline.e2e, itl))

    def copy(self) -> HistoryCopy:
        """The records as plain lists (call it on the engine thread, between steps)."""
        now = self.clock()
        self._trim(now)
        return HistoryCopy(now, list(self.steps), [list(b) for b in self.seconds], list(self.latencies))

    def _bucket(self, now: float) -> list:
        second = int(now)
        if not self.seconds or self.seconds[-1][SECOND] != second:
            self.seconds.append(_new_bucket(second))
            self._trim(now)
        return self.seconds[-1]

    def _spread_busy(self, start: float, end: float) -> None:
        """A step's time over the seconds it ran in (the last one's bucket made by _bucket): a step
        of 8 s counts in 8 buckets, and only its part inside the window (each second at most 1 s
        busy, however steps overlap)."""
        second, i = int(end), len(self.seconds) - 1
        while second >= int(start) and second > int(end) - self.window:
            if i >= 0 and self.seconds[i][SECOND] == second:
                bucket, i = self.seconds[i], i - 1
            else:  # a second no step ended in: its bucket goes in before the later ones
                bucket = _new_bucket(second)
                self.seconds.insert(i + 1, bucket)
            overlap = min(end, second + 1) - max(start, second)
            bucket[BUSY] = min(1.0, bucket[BUSY] + overlap)
            second -= 1

    def _trim(self, now: float) -> None:
        oldest = int(now) - self.window
        while self.seconds and self.seconds[0][SECOND] <= oldest:
            self.seconds.popleft()
        while self.latencies and self.latencies[0][0] <= now - self.window:
            self.latencies.popleft()


def summary(h: HistoryCopy, window: float = WINDOW_SECONDS) -> dict:
    """The page's figures: the last steps' split (and time), per-second series over the window
    (oldest first, zeros for idle seconds), its rates (totals / window) and latency percentiles."""
    last = int(h.now)
    first = last - int(window) + 1
    series = {name: [0] * int(window) for name in ("prompt", "generated")}
    totals = [0, 0, 0, 0.0, 0, 0, 0.0]  # prompt, generated, steps, busy, preemptions, finished, step time
    for bucket in h.seconds:
        if first <= bucket[SECOND] <= last:
            series["prompt"][bucket[SECOND] - first] = bucket[PROMPT]
            series["generated"][bucket[SECOND] - first] = bucket[GENERATED]
            for i, field in enumerate((PROMPT, GENERATED, STEPS, BUSY, PREEMPTIONS, FINISHED, STEP_TIME)):
                totals[i] += bucket[field]
    prompt, generated, steps, busy, preemptions, finished, step_time = totals
    columns = list(zip(*h.latencies)) if h.latencies else [(), (), (), ()]
    ttft, e2e, itl = (sorted(x for x in column if x is not None) for column in columns[1:])
    return {
        "steps": {"prefill": [s[0] for s in h.steps], "decode": [s[1] for s in h.steps],
                  "preemptions": [s[2] for s in h.steps], "ms": [round(s[3] * 1e3, 3) for s in h.steps]},
        "last_minute": {
            "seconds": int(window), "prompt_per_second": series["prompt"],
            "generated_per_second": series["generated"],
            "prompt_tokens_per_s": prompt / window, "generation_tokens_per_s": generated / window,
            "steps": steps, "busy": busy / window, "mean_step_ms": step_time / steps * 1e3 if steps else None,
            "preemptions": preemptions, "requests_finished": finished,
            "ttft": _percentiles(ttft), "itl": _percentiles(itl), "e2e": _percentiles(e2e)},
    }


def _new_bucket(second: int) -> list:
    return [second, 0, 0, 0, 0.0, 0, 0, 0.0]


def _percentiles(values: list[float]) -> dict:
    """p50 and p95 (nearest rank) of sorted values, in seconds; None for none."""
    n = len(values)
    if not n:
        return {"p50": None, "p95": None, "count": 0}
    return {"p50": values[-(-50 * n // 100) - 1], "p95": values[-(-95 * n // 100) - 1], "count": n}
