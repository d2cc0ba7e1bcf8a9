"""The engine thread behind the server (async_engine.py): shutdown ends every stream."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.async_engine import AsyncLLMEngine
from tokenmill.config import EngineConfig
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


@pytest.mark.parametrize("mode", ["sync", "async_output", "async_scheduling"])
def test_abort_all_then_stop_gives_every_stream_its_end(tiny_llama, mode):
    """The server's shutdown: abort_all() and at once stop(). Whatever the engine thread was doing,
    each open stream gets a final output: an abort, or the end it reached (async_output: also an
    end that was still to be reported; async_scheduling: with a step still in flight)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_seqs=4, async_output=mode == "async_output",
                                    async_scheduling=mode == "async_scheduling"))

    async def main() -> dict:
        front = AsyncLLMEngine(engine)
        front.start()
        finals = {}

        async def consume(request_id: str, max_tokens: int) -> None:
            request = front.make_request(request_id, [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            async for out in front.generate(request):
                finals[request_id] = out
        tasks = [asyncio.create_task(consume(f"r{i}", n)) for i, n in enumerate((1, 300, 300))]
        while len(engine.scheduler.requests) < 2:
            await asyncio.sleep(0.01)
        front.abort_all()
        front.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        return finals

    finals = asyncio.run(main())
    assert all(out.finished for out in finals.values()) and set(finals) == {"r0", "r1", "r2"}
    r0 = finals["r0"].outputs[0]
    if mode == "async_scheduling":  # r0's one token may still have been in flight: the abort came first
        assert (r0.finish_reason, len(r0.token_ids)) in {("length", 1), ("abort", 0)}
    else:
        assert r0.finish_reason == "length"
    assert {finals[r].outputs[0].finish_reason for r in ("r1", "r2")} == {"abort"}


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async_scheduling"])
def test_stop_alone_ends_every_stream(tiny_llama, ahead):
    """stop() without abort_all (or an add that comes after it): the engine thread ends what is
    still open with an abort before it exits, so no client waits forever."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_seqs=4, async_scheduling=ahead))

    async def main() -> dict:
        front = AsyncLLMEngine(engine)
        front.start()
        finals = {}

        async def consume(request_id: str) -> None:
            request = front.make_request(request_id, [5, 6, 7], SamplingParams(max_tokens=300, ignore_eos=True))
            async for out in front.generate(request):
                finals[request_id] = out
        tasks = [asyncio.create_task(consume(f"r{i}")) for i in range(2)]
        while len(engine.scheduler.requests) < 2:
            await asyncio.sleep(0.01)
        front.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        return finals

    finals = asyncio.run(main())
    assert {out.outputs[0].finish_reason for out in finals.values()} == {"abort"} and len(finals) == 2


def test_a_request_added_after_abort_all_ends_at_once(tiny_llama):
    """Shutdown: a request still being tokenized when abort_all came (SIGTERM) is added after it.
    It ends at once with an abort, as the open ones did; it used to run in full, past uvicorn's
    graceful timeout, which then cut its connection (a stream without its end, a whole one a 500)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_seqs=4))

    async def main():
        front = AsyncLLMEngine(engine)
        front.start()
        front.abort_all()
        request = front.make_request("late", [5, 6, 7], SamplingParams(max_tokens=300, ignore_eos=True))
        outputs = [out async for out in front.generate(request)]
        front.stop()
        return outputs

    outputs = asyncio.run(asyncio.wait_for(main(), timeout=30))
    final = outputs[-1].outputs[0]
    assert outputs[-1].finished and final.finish_reason == "abort" and final.token_ids == []
