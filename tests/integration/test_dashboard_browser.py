"""The dashboard page in a real headless browser: Debian's chromium, driven by Playwright, against
a live server with traffic. The tests install chromium themselves (apt-get, as root) when it is
missing, so CI needs nothing beyond the test extra; Playwright's own browser download is not used.

A screenshot of the busy page goes to test-artifacts/dashboard.png (git-ignored)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
from test_server import running_server

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
KEY = "s3cret"
SEATS, REQUESTS = 8, 24   # 24 requests for 8 seats: 16 wait at first
TOKENS = 400              # each: three waves of 400 steps, seconds even on a quiet machine (the page polls at 2 Hz)


@pytest.fixture(scope="session")
def chromium() -> str:
    """The system chromium's path, installed with apt-get when missing (skips, saying why, when it
    cannot be: not root, no apt-get, or the install failed)."""
    path = shutil.which("chromium")
    if path is not None:
        return path
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("chromium is not installed, and installing it needs apt-get as root (apt-get install chromium)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:  # the package lists may be missing or stale
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    path = shutil.which("chromium")
    if path is None:
        pytest.skip(f"apt-get install chromium failed: {done.stderr[-500:]}")
    return path


@pytest.fixture(scope="module")
def browser(chromium):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    with sync_api.sync_playwright() as p:
        # --no-sandbox: chromium's sandbox does not run as root (CI containers)
        b = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def send_traffic(url: str) -> None:
    """24 requests at once from this thread (one HTTP request of 24 prompts), TOKENS tokens each."""
    prompts = [list(range(5, 37)) + [40 + i, 41 + i] for i in range(REQUESTS)]  # 2 shared blocks, then their own
    r = httpx.post(url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=300,
                   json={"prompt": prompts, "max_tokens": TOKENS, "ignore_eos": True})
    assert r.status_code == 200, r.text


def text(page, element_id: str) -> str:
    return page.inner_text(f"#{element_id}")


def test_the_page_shows_8_running_and_16_waiting_then_an_idle_pool_with_24_finished_and_no_console_errors(
        tiny_llama, browser):
    with running_server(tiny_llama, engine_options={"max_num_seqs": SEATS, "num_kv_blocks": 256},
                        api_key=KEY) as s:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(s.url + f"/dashboard#key={KEY}")
        page.wait_for_function("() => window.dashboard.renders > 0", timeout=30_000)
        assert "key=" not in page.url  # the key left the address bar
        assert text(page, "count-free") == "256" and text(page, "running-count") == "0"
        idle_grid = page.eval_on_selector("#grid", "c => c.toDataURL()")

        sender = threading.Thread(target=send_traffic, args=(s.url,))
        sender.start()
        try:
            page.wait_for_function(
                f"() => document.querySelectorAll('#running tbody tr').length === {SEATS}"
                " && document.querySelectorAll('#waiting tbody tr').length > 0"
                " && document.getElementById('count-shared').textContent !== '0'", timeout=60_000)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            busy, busy_summary = page.evaluate(
                "[window.dashboard.state, document.getElementById('pool-summary').textContent]")
            busy_grid = page.eval_on_selector("#grid", "c => c.toDataURL()")
        finally:
            sender.join(300)
        page.wait_for_function("() => { const s = window.dashboard.state; return s.num_running === 0"
                               f" && s.num_waiting === 0 && s.last_minute.requests_finished === {REQUESTS}; }}",
                               timeout=60_000)
        idle = page.evaluate("window.dashboard.state")
        done_grid = page.eval_on_selector("#grid", "c => c.toDataURL()")
        page.close()

    assert busy["num_running"] == SEATS and busy["num_waiting"] == len(busy["waiting"]) > 0
    assert busy["pool"]["owned"] > 0 and busy["pool"]["shared"] == 2
    in_use = (busy["pool"]["owned"] + busy["pool"]["shared"]) / 256 * 100  # (JS rounds halves up, Python to even)
    assert busy_summary.startswith("256 blocks of 16 tokens · ") and busy_summary.endswith(" % in use")
    assert abs(int(busy_summary.split(" · ")[1].split()[0]) - in_use) <= 0.5
    assert idle["pool"]["owned"] == idle["pool"]["shared"] == 0 and idle["pool"]["cached"] > 0
    assert len({idle_grid, busy_grid, done_grid}) == 3  # free -> in use -> cached: the grid was redrawn
    assert sum(idle["last_minute"]["generated_per_second"]) == REQUESTS * TOKENS
    assert errors == []
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_without_a_key_the_page_asks_for_it_and_draws_once_it_is_given(tiny_llama, browser):
    with running_server(tiny_llama, api_key=KEY) as s:
        page = browser.new_page()
        page.goto(s.url + "/dashboard")
        page.wait_for_selector("#key-form", state="visible", timeout=30_000)
        assert text(page, "status") == "API key needed"
        page.fill("#key-input", KEY)
        page.click("#key-form button")
        page.wait_for_function("() => window.dashboard.renders > 0", timeout=30_000)
        assert page.is_hidden("#key-form") and text(page, "status").startswith("step ")
        page.close()


def test_on_a_390_px_phone_the_page_is_one_column_says_idle_and_greys_out_when_the_state_is_gone(
        tiny_llama, browser):
    with running_server(tiny_llama) as s:
        page = browser.new_page(viewport={"width": 390, "height": 900})
        page.goto(s.url + "/dashboard")
        page.wait_for_function("() => window.dashboard.renders > 0", timeout=30_000)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        columns = page.evaluate("getComputedStyle(document.querySelector('main')).gridTemplateColumns")
        assert len(columns.split()) == 1, columns
        assert text(page, "step-mean") == "idle"
        assert text(page, "pool-summary").endswith(" tokens · 0 % in use")
        # a step of one decode against a budget of 512 tokens is still a visible bar (2 px, the decode colour)
        bottom = page.evaluate("""() => { drawSteps({prefill: [0], decode: [1], preemptions: [0], ms: [1]}, 512);
            const c = document.getElementById('steps');
            return Array.from(c.getContext('2d').getImageData(0, c.height - 2, 1, 2).data); }""")
        assert bottom == [76, 120, 168, 255] * 2
        assert page.evaluate("document.querySelector('main').className") == ""
        page.route("**/dashboard/state", lambda route: route.abort())  # the server gone: the figures grey out
        page.wait_for_selector("main.stale", timeout=30_000)
        assert text(page, "status").startswith("no state: ")
        page.close()
