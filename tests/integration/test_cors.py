"""Cross-origin calls (CORS) with --allowed-origins: a real headless browser on one origin calling
the API on another, which the server allows only for the origins it was given; and the preflight
and headers a browser reads, over plain HTTP. Chromium comes from test_dashboard_browser's fixtures."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from test_dashboard_browser import browser, chromium  # noqa: F401 (fixtures)
from test_server import running_server

KEY = "s3cret"
PAGE = "<!doctype html><title>a page on another origin</title>"


@pytest.fixture(scope="module")
def page_origins():
    """Two plain HTTP servers on 127.0.0.1 serving PAGE: the allowed origin and another one."""
    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Page) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.fixture(scope="module")
def server(tiny_llama, page_origins):
    with running_server(tiny_llama, api_key=KEY, allowed_origins=[page_origins[0]]) as s:
        yield s


FETCH = """async ([url, key]) => {
    try {
        const r = await fetch(url + "/v1/completions", {method: "POST", headers: {
            "content-type": "application/json", "authorization": "Bearer " + key},
            body: JSON.stringify({model: "tiny", prompt: "w5 w6", max_tokens: 3, temperature: 0})});
        return JSON.stringify({status: r.status, body: await r.json()});
    } catch (e) { return JSON.stringify({error: String(e)}); }
}"""


def test_a_page_on_an_allowed_origin_reads_the_answer_and_one_on_another_origin_cannot(browser, server,  # noqa: F811
                                                                                        page_origins):
    answers = []
    for origin in page_origins:
        page = browser.new_page()
        page.goto(origin + "/")
        answers.append(json.loads(page.evaluate(FETCH, [server.url, KEY])))
        page.close()
    allowed, other = answers
    assert allowed["status"] == 200 and len(allowed["body"]["choices"]) == 1, allowed
    assert other == {"error": "TypeError: Failed to fetch"}


def test_the_preflight_is_answered_before_the_key_and_only_for_the_allowed_origin(server, page_origins):
    ask = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
    ok = httpx.options(server.url + "/v1/chat/completions", headers={"origin": page_origins[0], **ask})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == page_origins[0]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    refused = httpx.options(server.url + "/v1/chat/completions", headers={"origin": page_origins[1], **ask})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    answered = httpx.get(server.url + "/v1/models", headers={"origin": page_origins[0],
                                                             "authorization": f"Bearer {KEY}"})
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == page_origins[0]
    unkeyed = httpx.get(server.url + "/v1/models", headers={"origin": page_origins[0]})
    assert unkeyed.status_code == 401  # CORS opens reading answers to a page, not the key


def test_without_allowed_origins_no_answer_is_marked_readable_by_other_origins(tiny_llama):
    with running_server(tiny_llama) as s:
        r = httpx.get(s.url + "/v1/models", headers={"origin": "http://127.0.0.1:9"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
