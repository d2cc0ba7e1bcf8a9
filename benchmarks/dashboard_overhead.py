"""What a dashboard client costs the engine (issue 30): step time and step period with 256 requests
running in a 10,000-block pool, in alternate phases without and with a client polling
/dashboard/state every half second, as the page does.

    python benchmarks/dashboard_overhead.py [--running 256] [--blocks 10000] [--phases 6] [--seconds 8]

The server runs in this process (create_app under uvicorn, the tests' tiny random llama: the cost
at stake is the host's, which a big model's step would hide), so that every step's figures are
read exactly (engine.stats_listeners). The load and the dashboard client run in a child process
(`--client URL`): it keeps `--running` completions in flight (a 64-token prefix they share, then
16 tokens of their own, 100 to 499 tokens out, ignore_eos: their ends spread out, so the batch
stays full) and, once that many run, alternates phases of
`--seconds`: odd ones poll the state. Per phase: the steps' own time (StepStats.time_total), the
period from one step's start to the next (which also holds the between-step work: the listeners,
and the snapshot a poll asks for on the engine thread), and for the polls the engine thread's read
time, the response time and size. Also the always-on StepHistory listener's time per step, and
the snapshot's and the JSON body's cost alone, on a fake scheduler with as many requests running
in as big a pool (no other thread wanting the GIL), and, given chromium, the page's drawing of
that state (Playwright).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent.parent
PREFIX = list(range(5, 69))  # 64 tokens every request shares (4 blocks of 16)


# ---- the child: load and dashboard client ------------------------------------------------------

async def client(url: str, running: int, phases: int, seconds: float) -> list[dict]:
    limits = httpx.Limits(max_connections=running + 4, max_keepalive_connections=running + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        stop = asyncio.Event()

        async def worker(i: int) -> None:
            n = 0
            while not stop.is_set():
                own = [70 + (i * 16 + j + n * 7) % 300 for j in range(16)]
                await http.post(url + "/v1/completions", json={"prompt": PREFIX + own, "ignore_eos": True,
                                                               "max_tokens": 100 + (i * 37 + n * 53) % 400})
                n += 1

        workers = [asyncio.create_task(worker(i)) for i in range(running)]
        while (await http.get(url + "/dashboard/state")).json()["num_running"] < running:
            await asyncio.sleep(1.0)  # (the warm-up polls come before the first phase)
        marks = []
        for k in range(phases):
            polling, reads = k % 2 == 1, []
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                if polling:
                    t0 = time.monotonic()
                    r = await http.get(url + "/dashboard/state")
                    body = r.json()
                    pool = body["pool"]
                    in_use = pool["owned"] + pool["shared"]
                    reads.append((time.monotonic() - t0, len(r.content), body["read_ms"], in_use))
                await asyncio.sleep(0.5)
            marks.append({"polling": polling, "start": start, "end": time.monotonic(), "reads": reads})
        stop.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return marks


# ---- the parent: the server, and the figures ---------------------------------------------------

def serve(model: Path, running: int, blocks: int):
    """The app on 127.0.0.1 under uvicorn in a thread; returns (url, engine, app, server, thread)."""
    import uvicorn

    from tokenmill.config import EngineConfig
    from tokenmill.engine import LLMEngine
    from tokenmill.server.api import create_app
    engine = LLMEngine(EngineConfig(model=str(model), max_num_seqs=running, num_kv_blocks=blocks, block_size=16,
                                    max_num_batched_tokens=512))
    app = create_app(engine, "tiny")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", engine, app, server, thread


class Timed:
    """A listener wrapped to add up the seconds it takes."""

    def __init__(self, listener) -> None:
        self.listener, self.seconds, self.calls = listener, 0.0, 0

    def __call__(self, stats, outputs) -> None:
        t0 = time.perf_counter()
        self.listener(stats, outputs)
        self.seconds += time.perf_counter() - t0
        self.calls += 1


def phase_figures(mark: dict, steps: list[tuple[float, float, int]]) -> dict:
    """A phase's steps (those that began within it; start times are CLOCK_MONOTONIC in both processes)."""
    inside = [s for s in steps if mark["start"] <= s[0] <= mark["end"]]
    times = [s[1] * 1e3 for s in inside]
    figures = {"client polling": mark["polling"], "steps": len(inside),
               "mean batch": round(statistics.mean(s[2] for s in inside), 1),
               "step ms median": round(statistics.median(times), 2), "step ms mean": round(statistics.mean(times), 2),
               "period ms": round((inside[-1][0] - inside[0][0]) / (len(inside) - 1) * 1e3, 2)}
    if mark["reads"]:
        response, size, read, in_use = zip(*mark["reads"])
        figures.update({"polls": len(response), "blocks in use": round(statistics.mean(in_use)),
                        "read ms (engine thread) median": round(statistics.median(read), 2),
                        "response ms median": round(statistics.median(response) * 1e3, 1),
                        "state kB": round(statistics.mean(size) / 1e3, 1)})
    return figures


def busy_scheduler(running: int, blocks: int):
    """A fake scheduler (tests/fakes.py) with `running` requests of the load's shape decoding in a
    `blocks`-block pool."""
    from fakes import fake_run, make_scheduler

    from tokenmill.request import Request
    from tokenmill.sampling_params import SamplingParams
    s = make_scheduler(num_blocks=blocks, block_size=16, max_num_seqs=running, budget=512, max_model_len=1024,
                       prefix_caching=True)
    for i in range(running):
        s.add_request(Request(f"cmpl-{i:032x}-0", PREFIX + [70 + (i * 16 + j) % 300 for j in range(16)],
                              SamplingParams(max_tokens=500, ignore_eos=True), max_tokens=500))
    while len(s.running) < running or any(r.num_output_tokens < 20 for r in s.running):
        sched = s.schedule()
        s.update(sched, fake_run(sched))
    return s


def micro(running: int, blocks: int) -> dict:
    """Scheduler.snapshot, StepHistory.copy and the JSON body alone, on busy_scheduler's."""
    import timeit

    from tokenmill.server.dashboard import state_body
    from tokenmill.server.step_history import StepHistory
    s = busy_scheduler(running, blocks)
    history = StepHistory()
    n = 200
    snapshot_ms = timeit.timeit(s.snapshot, number=n) / n * 1e3
    snap, copy = s.snapshot(), history.copy()
    body_ms = timeit.timeit(lambda: json.dumps(state_body(snap, copy, 0.0)), number=n) / n * 1e3
    return {"running": len(snap.running), "blocks": blocks, "blocks in use": blocks - snap.block_states.count(0),
            "snapshot ms": round(snapshot_ms, 3), "state body + JSON ms": round(body_ms, 3),
            "state kB": round(len(json.dumps(state_body(snap, copy, 0.0))) / 1e3, 1)}


def browser_draw(running: int, blocks: int, chromium: str) -> dict:
    """The page in headless chromium (Playwright) fed busy_scheduler's state twice a second, with
    the 10,000 blocks changing at every poll: the time each poll's drawing takes (the page's own
    window.dashboard.renderMs), over 20 polls."""
    from playwright.sync_api import sync_playwright

    from tokenmill.server.dashboard import page_html, state_body
    from tokenmill.server.step_history import StepHistory
    s, history = busy_scheduler(running, blocks), StepHistory()
    body = state_body(s.snapshot(), history.copy(), 0.0)
    body.update(max_num_seqs=running, max_num_batched_tokens=512)
    bodies = []
    for shift in range(2):  # two pools, alternately: every poll redraws the whole grid
        states = bytes((b + shift) % 4 for b in range(blocks))
        bodies.append(json.dumps({**body, "pool": {**body["pool"], "states": base64.b64encode(states).decode()}}))
    served = {"n": 0}

    def state(route) -> None:
        served["n"] += 1
        route.fulfill(status=200, content_type="application/json", body=bodies[served["n"] % 2])
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = b.new_page(viewport={"width": 1400, "height": 1000})
        page.route("http://bench.invalid/dashboard", lambda r: r.fulfill(status=200, content_type="text/html",
                                                                          body=page_html()))
        page.route("http://bench.invalid/dashboard/state", state)
        page.goto("http://bench.invalid/dashboard")
        draws = []
        while len(draws) < 20:
            page.wait_for_function(f"() => window.dashboard.renders > {len(draws)}", timeout=30_000)
            draws.append(page.evaluate("window.dashboard.renderMs"))
        b.close()
    return {"page draw ms median": round(statistics.median(draws), 1), "max": round(max(draws), 1),
            "running rows": running, "blocks": blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=10_000)
    parser.add_argument("--phases", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--chromium", default=shutil.which("chromium"),
                        help="also time the page's drawing in this browser (default: chromium on the PATH)")
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the child: the server's URL
    args = parser.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(client(args.client, args.running, args.phases, args.seconds))))
        return

    sys.path.insert(0, str(HERE / "tests"))
    from conftest import build_tiny_model
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "llama", "llama")
        url, engine, app, server, thread = serve(model, args.running, args.blocks)
        steps: list[tuple[float, float, int]] = []
        engine.stats_listeners.append(lambda s: steps.append((s.start, s.time_total, s.num_seqs)))
        listeners = app.state.async_engine.listeners
        history = next(i for i, f in enumerate(listeners) if type(f.__self__).__name__ == "StepHistory")
        listeners[history] = timed = Timed(listeners[history])
        child = subprocess.run([sys.executable, __file__, "--client", url, "--running", str(args.running),
                                "--phases", str(args.phases), "--seconds", str(args.seconds)],
                               capture_output=True, text=True)
        server.should_exit = True
        thread.join(30)
    if child.returncode != 0:
        raise SystemExit(child.stderr[-3000:])
    rows = [phase_figures(mark, steps) for mark in json.loads(child.stdout)]
    for row in rows:
        print(json.dumps(row))
    for polling in (False, True):
        chosen = [r for r in rows if r["client polling"] is polling]
        print(f"client polling {polling}: step ms mean of phase medians "
              f"{statistics.mean(r['step ms median'] for r in chosen):.2f}, period ms mean "
              f"{statistics.mean(r['period ms'] for r in chosen):.2f}")
    print(f"StepHistory.on_step: {timed.seconds / max(timed.calls, 1) * 1e6:.1f} us a call over {timed.calls} calls")
    print(json.dumps(micro(args.running, args.blocks)))
    if args.chromium:
        print(json.dumps(browser_draw(args.running, args.blocks, args.chromium)))


if __name__ == "__main__":
    main()
