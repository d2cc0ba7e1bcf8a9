"""GET /dashboard and /dashboard/state over real HTTP (the page in a browser: test_dashboard_browser.py):
the key guards the state and not the page, the state follows requests as they come and go, and
neither route is in the OpenAPI schema."""

from __future__ import annotations

import base64
import threading
import time

import httpx
from test_server import ENGINE_OPTIONS, running_server

from tokenmill.kv_cache import BLOCK_CACHED, BLOCK_FREE, BLOCK_OWNED, BLOCK_SHARED

NUM_BLOCKS = ENGINE_OPTIONS["num_kv_blocks"]


def fresh_state(url: str, headers: dict | None = None) -> dict:
    time.sleep(0.25)  # past the handler's FRESH_SECONDS: a new read
    r = httpx.get(url + "/dashboard/state", headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_page_needs_no_key_the_state_needs_it_and_neither_is_in_the_openapi_schema(tiny_llama):
    key = {"authorization": "Bearer s3cret"}
    with running_server(tiny_llama, api_key="s3cret") as s:
        page = httpx.get(s.url + "/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert '<canvas id="grid"' in page.text and "Authorization" in page.text
        slash = httpx.get(s.url + "/dashboard/")  # (as a browser may be given it): to the page, not a 401
        assert slash.status_code == 307 and slash.headers["location"].endswith("/dashboard")
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = httpx.get(s.url + "/dashboard/state", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        state = fresh_state(s.url, key)
        pool = state["pool"]
        assert base64.b64decode(pool["states"]) == bytes(NUM_BLOCKS)  # an idle, untouched pool: all free
        assert (pool["num_blocks"], pool["free"], pool["block_size"]) == (NUM_BLOCKS, NUM_BLOCKS, 16)
        assert state["running"] == [] and state["num_waiting"] == 0 and state["max_num_batched_tokens"] == 256
        paths = httpx.get(s.url + "/openapi.json").json()["paths"]
        assert not [p for p in paths if p.startswith("/dashboard")]


def test_the_state_shows_8_requests_running_with_their_blocks_then_8_finished_and_6400_tokens(tiny_llama):
    prompts = [list(range(5, 21)) + [30 + i] for i in range(8)]  # 17 token ids: a 16-token block in common
    with running_server(tiny_llama) as s:
        # one HTTP request of 8 prompts: 8 engine requests added together, admitted in one step; 800
        # tokens each, so that they run for several of the polls below (200 ended between two on a Zen 4)
        sender = threading.Thread(target=httpx.post, args=(s.url + "/v1/completions",), kwargs=dict(
            timeout=120, json={"prompt": prompts, "max_tokens": 800, "ignore_eos": True}))
        sender.start()
        deadline = time.monotonic() + 60
        busy = fresh_state(s.url)
        while busy["num_running"] < 8 and time.monotonic() < deadline:
            busy = fresh_state(s.url)
        sender.join(120)
        idle = fresh_state(s.url)

    assert busy["num_running"] == 8
    states = base64.b64decode(busy["pool"]["states"])
    # the first 16 tokens are one block all 8 share; each owns the rest
    assert states.count(BLOCK_SHARED) == 1 == busy["pool"]["shared"]
    assert states.count(BLOCK_OWNED) == sum(r["blocks"] for r in busy["running"]) - 8 == busy["pool"]["owned"]
    assert all(r["prompt"] == 17 and r["computed"] >= 17 and r["max_tokens"] == 800 for r in busy["running"])
    assert {r["cached"] for r in busy["running"][1:]} == {16}

    states = base64.b64decode(idle["pool"]["states"])
    assert idle["num_running"] == 0 and idle["running"] == [] and idle["waiting"] == []
    assert BLOCK_OWNED not in states and BLOCK_SHARED not in states and BLOCK_CACHED in states
    assert states.count(BLOCK_FREE) + states.count(BLOCK_CACHED) == NUM_BLOCKS
    minute = idle["last_minute"]
    assert minute["requests_finished"] == 8 and sum(minute["generated_per_second"]) == 6400
    assert minute["ttft"]["count"] == 8 and minute["e2e"]["p95"] >= minute["e2e"]["p50"] > 0
    # the bar chart's last 120 steps: the 8 decoding together, the prompts' step long gone
    assert idle["steps"]["decode"] == [8] * 120 and idle["steps"]["prefill"] == [0] * 120
    assert round(minute["prompt_tokens_per_s"] * 60) == 8 * 17 - 7 * 16  # 7 of them found the shared block cached
