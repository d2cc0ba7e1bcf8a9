"""`tokenmill serve` against clients that hold connections: slowloris heads, idle connections and
more connections than the cap, on a real server process with small timeouts (bounded: a few
hundred sockets for a few seconds)."""

from __future__ import annotations

import json
import resource
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest
from test_serve_cli import wait_until_up
from test_server import free_port

KEEP_ALIVE_S, HEADERS_S, BODY_S, MAX_CONNECTIONS = 1.0, 2.0, 2.0, 300


@pytest.fixture(scope="module")
def guarded(tiny_llama):
    """A serve process started with a soft open-file limit under its hard one (serve raises it)."""
    port = free_port()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, hard, 1024) // 2

    def lower_soft_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    # WARNING: a line per request would fill the pipe, which nothing reads while the server is up
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", str(tiny_llama),
                             "--port", str(port),
                             "--num-kv-blocks", "64", "--timeout-keep-alive", str(KEEP_ALIVE_S),
                             "--timeout-request-headers", str(HEADERS_S), "--timeout-request-body", str(BODY_S),
                             "--max-connections", str(MAX_CONNECTIONS)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=lower_soft_limit)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url)
        yield type("Guarded", (), {"url": url, "port": port, "proc": proc, "hard_limit": hard})
    finally:
        proc.terminate()
        proc.wait(30)


def connect(port: int, first_bytes: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


def seconds_until_closed(socks: list[socket.socket], start: float, limit_s: float,
                         received: dict | None = None) -> list[float]:
    """How long after `start` the server closed each socket (inf: still open after `limit_s`);
    what it sent before goes to `received` (socket -> bytes), when given."""
    closed_at = {s: float("inf") for s in socks}
    open_ = set(socks)
    while open_ and time.monotonic() - start < limit_s:
        readable, _, _ = select.select(list(open_), [], [], 0.1)
        for sock in readable:
            try:
                if data := sock.recv(65536):
                    if received is not None:
                        received[sock] = received.get(sock, b"") + data
                    continue
            except ConnectionResetError:
                pass
            closed_at[sock] = time.monotonic() - start
            open_.discard(sock)
    for sock in socks:
        sock.close()
    return [closed_at[s] for s in socks]


def test_serve_raises_its_soft_open_file_limit_to_the_hard_one(guarded):
    limits = open(f"/proc/{guarded.proc.pid}/limits").read()
    soft, hard = next(line for line in limits.splitlines() if line.startswith("Max open files")).split()[3:5]
    assert soft == hard == str(guarded.hard_limit)


def test_slowloris_heads_are_closed_after_the_header_timeout_while_health_answers(guarded):
    start = time.monotonic()
    slow = [connect(guarded.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ") for _ in range(250)]
    for _ in range(3):  # a byte more on each, which does not put the deadline off, and /health answers
        for sock in slow:
            sock.sendall(b"a")
        assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200
        time.sleep(0.3)
    received: dict = {}
    closed = seconds_until_closed(slow, start, HEADERS_S + 8, received)
    assert min(closed) >= HEADERS_S and max(closed) < HEADERS_S + 8
    answers = [received.get(sock, b"") for sock in slow]  # each told why before the close
    assert all(a.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and b'"code": "request_timeout"' in a
               for a in answers), answers[0]
    assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200


def test_a_body_that_stops_coming_is_closed_and_one_that_keeps_coming_is_served(guarded):
    """50 requests whose bodies stop after 10 of 100 bytes are closed once BODY_S passes without a
    byte; a body sent a byte every half second, for longer than BODY_S in all, is answered."""
    body = json.dumps({"prompt": "w5", "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    start = time.monotonic()
    stalled = [connect(guarded.port, head + body[:10]) for _ in range(50)]
    trickled = connect(guarded.port, head)
    for i in range(0, len(body), len(body) // 6 + 1):
        time.sleep(0.5)
        trickled.sendall(body[i:i + len(body) // 6 + 1])
    assert time.monotonic() - start > BODY_S
    trickled.settimeout(10)
    assert trickled.recv(65536).startswith(b"HTTP/1.1 200")
    trickled.close()
    received: dict = {}
    closed = seconds_until_closed(stalled, start, BODY_S + 8, received)
    assert min(closed) >= BODY_S and max(closed) < BODY_S + 8
    assert all(received.get(sock, b"").startswith(b"HTTP/1.1 408 ") for sock in stalled)
    assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200


def test_idle_connections_are_closed_after_the_keep_alive_timeout(guarded):
    start = time.monotonic()
    fresh = [connect(guarded.port) for _ in range(50)]  # never send a byte
    used = connect(guarded.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert used.recv(65536).startswith(b"HTTP/1.1 200")
    closed = seconds_until_closed([*fresh, used], start, KEEP_ALIVE_S + 8)
    assert min(closed) >= KEEP_ALIVE_S and max(closed) < KEEP_ALIVE_S + 8


def test_past_the_connection_cap_a_request_gets_503_and_served_again_once_they_close(guarded):
    start = time.monotonic()
    held = [connect(guarded.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n") for _ in range(MAX_CONNECTIONS)]
    r = httpx.get(guarded.url + "/health", timeout=5)
    assert r.status_code == 503 and r.headers["connection"] == "close"
    assert json.loads(r.content)["error"]["code"] == "too_many_connections"
    assert max(seconds_until_closed(held, start, HEADERS_S + 8)) < HEADERS_S + 8
    assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200
