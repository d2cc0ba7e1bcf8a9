"""server/streaming.py: merge_streams holds one item per stream for a consumer that lags."""

from __future__ import annotations

import asyncio

from tokenmill.server.streaming import merge_streams


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
