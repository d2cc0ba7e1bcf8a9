"""--trace-file: Chrome trace events for steps and request timelines, valid JSON after every write."""

from __future__ import annotations

import json

from tokenmill.outputs import CompletionOutput, RequestOutput, StepStats
from tokenmill.timeline import Timeline
from tokenmill.trace import ENGINE_PID, REQUESTS_PID, STEPS_TID, TraceWriter


def finished(request_id: str, timeline: Timeline) -> RequestOutput:
    return RequestOutput(request_id, None, [1], [CompletionOutput(0, "", [2], finish_reason="stop")], finished=True,
                         timeline=timeline)


def test_a_step_is_a_slice_with_its_phases_end_to_end_and_pool_counters(tmp_path) -> None:
    path = tmp_path / "t.json"
    trace = TraceWriter(path, origin=10.0)
    stats = StepStats(num_seqs=3, num_prefill_tokens=20, num_decode_tokens=2, num_running=3, num_waiting=1,
                      kv_blocks_used=5, kv_blocks_cached=2, kv_blocks_total=10, time_schedule=0.001,
                      time_prepare=0.002, time_forward=0.010, time_sample=0.001, time_detokenize=0.0005,
                      time_total=0.0145, start=10.5)
    trace.on_step(stats, [])
    events = json.loads(path.read_text())
    steps = [e for e in events if e["ph"] == "X" and e["pid"] == ENGINE_PID and e["tid"] == STEPS_TID]
    assert [(e["name"], e["ts"], e["dur"]) for e in steps] == [
        ("step 1: 20 prefill + 2 decode", 500000.0, 14500.0), ("schedule", 500000.0, 1000.0),
        ("prepare", 501000.0, 2000.0), ("forward", 503000.0, 10000.0), ("sample", 513000.0, 1000.0),
        ("detokenize", 514000.0, 500.0)]
    counters = {e["name"]: e["args"] for e in events if e["ph"] == "C"}
    assert counters == {"kv blocks": {"used": 5, "cached": 2, "free": 3}, "requests": {"running": 3, "waiting": 1}}


def test_a_request_gets_a_track_with_its_phases_preemption_and_chunks(tmp_path) -> None:
    path = tmp_path / "t.json"
    trace = TraceWriter(path, origin=0.0)
    t = Timeline()
    for time, kind, data in [(1.0, "arrival", {"prompt_tokens": 9}), (1.5, "tokenized", {}),
                             (2.0, "admitted", {"cached": 0}), (2.0, "chunk", {"step": 1, "tokens": 9}),
                             (2.0, "first_token", {}),
                             (3.0, "preempted", {"reason": "pool_full", "mode": "recompute", "tokens": 10}),
                             (4.0, "resumed", {"cached": 8}), (4.0, "chunk", {"step": 5, "tokens": 3}),
                             (6.0, "finished", {"finish_reason": "stop"})]:
        t.add(time, kind, **data)
    trace.on_step(StepStats(), [finished("req-a", t)])  # a step that ran nothing: no step slice
    events = json.loads(path.read_text())
    track = [e for e in events if e["pid"] == REQUESTS_PID and e.get("tid") == 1]
    assert {"name": "thread_name", "ph": "M", "pid": REQUESTS_PID, "tid": 1, "args": {"name": "req-a"}} in track
    slices = [(e["name"], e["ts"], e["dur"]) for e in track if e["ph"] == "X"]
    assert slices == [("req-a", 1e6, 5e6), ("queued", 1e6, 1e6), ("prefill", 2e6, 0.0), ("decode", 2e6, 4e6),
                      ("preempted", 3e6, 1e6)]
    instants = [(e["name"], e["ts"], e["args"]) for e in track if e["ph"] == "i"]
    assert instants == [("tokenized", 1.5e6, {}), ("chunk", 2e6, {"step": 1, "tokens": 9}),
                        ("preempted", 3e6, {"reason": "pool_full", "mode": "recompute", "tokens": 10}),
                        ("resumed", 4e6, {"cached": 8}), ("chunk", 4e6, {"step": 5, "tokens": 3})]
    assert not [e for e in events if e["ph"] == "X" and e["pid"] == ENGINE_PID]


def test_the_file_is_valid_json_after_every_write_and_a_request_is_written_once(tmp_path) -> None:
    path = tmp_path / "t.json"
    trace = TraceWriter(path, origin=0.0)
    assert len(json.loads(path.read_text())) == 3  # process and thread names
    t = Timeline()
    t.add(0.0, "arrival", prompt_tokens=1)
    t.add(1.0, "finished", finish_reason="abort")
    for i in range(3):
        trace.on_step(StepStats(time_total=0.01, start=float(i)), [finished("x", t)])
        events = json.loads(path.read_text())
    assert sum(e["name"] == "x" and e["ph"] == "X" for e in events) == 1
    assert sum(e["name"].startswith("step ") for e in events) == 3
    trace.close()
