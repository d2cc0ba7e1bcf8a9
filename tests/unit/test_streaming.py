"""server/streaming.py: merge_streams holds one item per stream for a consumer that lags; a request's id
comes back on every answer, an unhandled error's 500 included."""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import FastAPI

from tokenmill.server.streaming import RequestIdMiddleware, merge_streams


async def _numbers(start: int, count: int, produced: list[int]):
    for k in range(start, start + count):
        produced.append(k)
        yield [k]
        await asyncio.sleep(0)


def test_a_consumer_that_lags_gets_one_merged_item_per_stream_in_the_order_they_filled():
    """Three streams of 50, 50 and 1 items (lists, merged by concatenation): a consumer that takes
    one item and then waits until every stream has ended gets each stream's remaining items as one,
    nothing lost or reordered, the streams in the order their slots filled."""
    async def main():
        produced: list[int] = []
        merged = merge_streams([_numbers(0, 50, produced), _numbers(100, 50, produced), _numbers(200, 1, produced)],
                               lambda a, b: a + b)
        first = await anext(merged)
        while len(produced) < 101:  # the pumps read on while nobody takes anything
            await asyncio.sleep(0)
        return first, [item async for item in merged]

    first, rest = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert first == (0, [0])
    assert rest == [(1, list(range(100, 150))), (2, [200]), (0, list(range(1, 50)))]


def test_an_error_in_one_stream_reaches_the_consumer_and_closes_the_others():
    """A stream that raises: the consumer gets its error (before the items still waiting, which
    the error makes moot), and every other stream is closed."""
    closed = []

    async def endless():
        try:
            while True:
                yield [1]
                await asyncio.sleep(0)
        finally:
            closed.append(True)

    async def failing():
        yield [2]
        raise ValueError("boom")

    async def main():
        try:
            async for _ in merge_streams([endless(), failing()], lambda a, b: a + b):
                pass
        except ValueError as exc:
            return str(exc)

    assert asyncio.run(asyncio.wait_for(main(), timeout=10)) == "boom" and closed == [True]


def _run(app, headers: list[tuple[bytes, bytes]]) -> tuple[list[dict], BaseException | None]:
    """The messages an ASGI app sends for one GET with these headers, and what it raised."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "headers": headers}
    try:
        asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    except Exception as exc:  # noqa: BLE001 (the tests look at it)
        return sent, exc
    return sent, None


async def _failing(scope, receive, send):
    raise RuntimeError("a bug")


async def _failing_mid_answer(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"stale")]})
    raise RuntimeError("a bug")


def test_an_unhandled_error_before_the_answer_is_a_json_500_with_the_first_request_id_and_is_raised_on():
    sent, error = _run(RequestIdMiddleware(_failing), [(b"x-request-id", b"one"), (b"x-request-id", b"two")])
    assert str(error) == "a bug"  # raised on, for the server's log
    start, body = sent
    assert start["status"] == 500 and [v for k, v in start["headers"] if k == b"x-request-id"] == [b"one"]
    assert json.loads(body["body"]) == {"error": {"message": "internal server error", "type": "server_error",
                                                  "param": None, "code": None}}


def test_an_error_after_the_answer_began_sends_nothing_more_and_the_answer_carries_the_id_once():
    sent, error = _run(RequestIdMiddleware(_failing_mid_answer), [(b"x-request-id", b"one")])
    assert str(error) == "a bug"
    assert [(m["status"], m["headers"]) for m in sent] == [(200, [(b"x-request-id", b"one")])]


def test_through_a_fastapi_app_an_unhandled_error_is_one_json_500_closing_the_connection_with_or_without_an_id():
    """Starlette's own error layer sits outside the app's middleware: it must send nothing more."""
    app = FastAPI()

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")
    app.add_middleware(RequestIdMiddleware)

    async def get(headers: dict) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/boom", headers=headers)

    for headers, echoed in (({"X-Request-Id": "r-1"}, ["r-1"]), ({}, [])):
        r = asyncio.run(asyncio.wait_for(get(headers), timeout=10))
        assert (r.status_code, r.headers["content-type"], r.headers["connection"]) == (500, "application/json", "close")
        assert r.json()["error"]["type"] == "server_error" and r.headers.get_list("x-request-id") == echoed
