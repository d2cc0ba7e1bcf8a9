"""--trace-file: the engine's steps and every request's life as Chrome trace events (JSON array
format), for chrome://tracing or ui.perfetto.dev.

    process "engine"    track "steps": one slice per step, named by its prefill + decode split,
                        its phases laid end to end inside it in the order they run (schedule,
                        prepare, forward, sample, detokenize; the scheduler's update counts as
                        schedule); counters "kv blocks" (used, cached, free) and "requests"
    process "requests"  one track per request: a slice from arrival to its end, inside it
                        queued, prefill and decode (and a "preempted" slice until each
                        resumption), instants for tokenizing, each chunk and each speculative step

Requests are written when they end, from their timelines (timeline.py); steps as they run.
Times are microseconds from the writer's start on the monotonic clock (step times come from
time.perf_counter, which on Linux reads the same CLOCK_MONOTONIC). The file is valid JSON
after every write: each event goes in before the closing bracket, which is written again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tokenmill.outputs import RequestOutput, StepStats
from tokenmill.timeline import Timeline

ENGINE_PID, REQUESTS_PID, STEPS_TID = 1, 2, 1
_PHASES = ("schedule", "prepare", "forward", "sample", "detokenize")


class TraceWriter:
    def __init__(self, path: str | Path, origin: float | None = None) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 (open for the engine's life; closed by close())
        self._file.write(b"[")
        self._end = 1                  # where the next event goes (before the closing bracket)
        self._origin = origin if origin is not None else time.monotonic()  # time 0 in the file
        self._num_steps = 0
        self._tracks: dict[str, int] = {}  # request id -> its track
        self._write([_meta("process_name", ENGINE_PID, None, "engine"),
                     _meta("thread_name", ENGINE_PID, STEPS_TID, "steps"),
                     _meta("process_name", REQUESTS_PID, None, "requests")])

    def close(self) -> None:
        self._file.close()

    def on_step(self, stats: StepStats, outputs: list[RequestOutput]) -> None:
        """A step that ran (stats.time_total > 0), then the requests that ended in it."""
        if stats.time_total > 0:
            self._num_steps += 1
            self._write(self._step_events(stats))
        self.on_outputs(outputs)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Requests that ended (aborted ones too) get their tracks."""
        events = []
        for out in outputs:
            if out.finished and out.timeline is not None and out.request_id not in self._tracks:
                events += self._request_events(out.request_id, out.timeline)
        self._write(events)

    def _us(self, t: float) -> float:
        return round((t - self._origin) * 1e6, 3)

    def _step_events(self, s: StepStats) -> list[dict]:
        start = self._us(s.start)
        name = f"step {self._num_steps}: {s.num_prefill_tokens} prefill + {s.num_decode_tokens} decode"
        events = [_slice(name, ENGINE_PID, STEPS_TID, start, s.time_total * 1e6,
                         {"seqs": s.num_seqs, "prefill_tokens": s.num_prefill_tokens,
                          "decode_tokens": s.num_decode_tokens, "preemptions": s.num_preemptions})]
        at = start
        for phase in _PHASES:
            duration = getattr(s, f"time_{phase}") * 1e6
            events.append(_slice(phase, ENGINE_PID, STEPS_TID, at, duration))
            at += duration
        free = s.kv_blocks_total - s.kv_blocks_used
        events.append({"name": "kv blocks", "ph": "C", "ts": start, "pid": ENGINE_PID,
                       "args": {"used": s.kv_blocks_used, "cached": s.kv_blocks_cached,
                                "free": free - s.kv_blocks_cached}})
        events.append({"name": "requests", "ph": "C", "ts": start, "pid": ENGINE_PID,
                       "args": {"running": s.num_running, "waiting": s.num_waiting}})
        return events

    def _request_events(self, request_id: str, timeline: Timeline) -> list[dict]:
        tid = self._tracks[request_id] = len(self._tracks) + 1
        events = [_meta("thread_name", REQUESTS_PID, tid, request_id)]
        times = {kind: timeline.time_of(kind) for kind in ("arrival", "admitted", "first_token", "finished")}
        spans = [(request_id, "arrival", "finished"), ("queued", "arrival", "admitted"),
                 ("prefill", "admitted", "first_token"), ("decode", "first_token", "finished")]
        for name, begin, end in spans:
            if times[begin] is not None and times[end] is not None:
                events.append(_slice(name, REQUESTS_PID, tid, self._us(times[begin]),
                                     (times[end] - times[begin]) * 1e6))
        preempted_at = None
        for e in timeline.events:
            if e.kind == "preempted":
                preempted_at = e.time
            elif e.kind in ("resumed", "finished") and preempted_at is not None:
                events.append(_slice("preempted", REQUESTS_PID, tid, self._us(preempted_at),
                                     (e.time - preempted_at) * 1e6))
                preempted_at = None
            if e.kind in ("tokenized", "chunk", "spec", "preempted", "resumed"):
                events.append({"name": e.kind, "ph": "i", "s": "t", "ts": self._us(e.time), "pid": REQUESTS_PID,
                               "tid": tid, "args": dict(e.data)})
        return events

    def _write(self, events: list[dict]) -> None:
        if not events:
            return
        body = b",\n".join(json.dumps(e, separators=(",", ":")).encode() for e in events)
        self._file.seek(self._end)
        self._file.write((b"\n" if self._end == 1 else b",\n") + body)
        self._end = self._file.tell()
        self._file.write(b"\n]\n")
        self._file.truncate()
        self._file.flush()


def _slice(name: str, pid: int, tid: int, start_us: float, duration_us: float, args: dict | None = None) -> dict:
    event = {"name": name, "ph": "X", "ts": round(start_us, 3), "dur": round(duration_us, 3), "pid": pid, "tid": tid}
    if args:
        event["args"] = args
    return event


def _meta(kind: str, pid: int, tid: int | None, name: str) -> dict:
    event = {"name": kind, "ph": "M", "pid": pid, "args": {"name": name}}
    if tid is not None:
        event["tid"] = tid
    return event
