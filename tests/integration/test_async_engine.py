"""The engine thread behind the server (async_engine.py): shutdown ends every stream, and a
stream nobody reads holds one merged output."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from tokenmill.async_engine import AsyncLLMEngine, EngineDrainingError
from tokenmill.config import EngineConfig
from tokenmill.engine import LLMEngine
from tokenmill.outputs import RequestOutput
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


def test_a_draining_engine_finishes_what_it_has_and_refuses_new_requests(tiny_llama):
    """serve --shutdown-timeout: after drain() the request in flight runs to its end, and one that
    arrived before it may still be made; a later one is refused (a 503 over HTTP)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_seqs=4))

    async def main():
        front = AsyncLLMEngine(engine)
        front.start()
        request = front.make_request("in-flight", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        stream = front.generate(request)
        first = await anext(stream)
        arrived = time.monotonic()  # (a request whose body came before the signal, still being tokenized)
        front.drain()
        with pytest.raises(EngineDrainingError, match="takes no new requests"):
            front.make_request("late", [5, 6], SamplingParams(max_tokens=5), arrival_time=time.monotonic())
        assert front.make_request("early", [5, 6], SamplingParams(max_tokens=5), arrival_time=arrived)
        outputs = [first] + [out async for out in stream]
        front.stop()
        return outputs, front.draining

    outputs, draining = asyncio.run(asyncio.wait_for(main(), timeout=60))
    final = outputs[-1].outputs[0]
    assert draining and final.finish_reason == "length" and len(final.token_ids) == 50


def test_a_stream_nobody_reads_holds_one_output_that_adds_up_to_what_a_reader_got(tiny_llama):
    """A consumer that takes its first output and then nothing while its request runs 200 steps:
    the engine holds one output for it, not one per step, and that one's new text, token ids and
    logprobs are exactly the rest of what a reader got (whose own outputs, taken as they came,
    add up to the whole)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_seqs=4))
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0, logprobs=3)

    async def main():
        front = AsyncLLMEngine(engine)
        front.start()
        read = [out async for out in front.generate(front.make_request("read", [5, 6, 7], params))]
        lagging = front.generate(front.make_request("lag", [5, 6, 7], params))
        first = await anext(lagging)
        while engine.has_unfinished_requests():  # every step runs while nobody reads
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # (the last step's outputs reach the loop)
        held = [o for o in gc.get_objects() if type(o) is RequestOutput and o.request_id == "lag" and o is not first]
        rest = [out async for out in lagging]
        front.stop()
        return read, first, held, rest

    read, first, held, rest = asyncio.run(asyncio.wait_for(main(), timeout=60))
    whole = read[-1].outputs[0]
    assert whole.finish_reason == "length" and len(whole.token_ids) == 200 and len(whole.logprobs) == 200
    assert "".join(out.new_text for out in read) == whole.text
    assert [t for out in read for t in out.new_token_ids] == whole.token_ids
    assert len(held) == 1 and len(rest) == 1 and rest[0].finished
    merged = rest[0]
    # the first read takes what was there when it came: one step's token, or a few merged on a busy host
    assert len(first.new_token_ids) >= 1 and len(first.new_token_ids) + len(merged.new_token_ids) == 200
    assert first.new_text + merged.new_text == whole.text == merged.outputs[0].text
    assert first.new_token_ids + merged.new_token_ids == whole.token_ids == merged.outputs[0].token_ids
    assert merged.outputs[0].logprobs == whole.logprobs and merged.outputs[0].finish_reason == "length"


def test_call_between_steps_runs_on_the_engine_thread_idle_or_busy_and_passes_its_error_back(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_seqs=4))

    def where() -> tuple[str, int]:
        return threading.current_thread().name, len(engine.scheduler.running)

    def fails() -> None:
        raise KeyError("nope")

    async def main() -> tuple:
        front = AsyncLLMEngine(engine)
        front.start()
        idle = await asyncio.wait_for(front.call_between_steps(where), timeout=5)
        request = front.make_request("r", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        stream = front.generate(request)
        await stream.__anext__()  # running now
        busy = await asyncio.wait_for(front.call_between_steps(where), timeout=5)
        with pytest.raises(KeyError, match="nope"):
            await front.call_between_steps(fails)
        async for out in stream:  # the engine goes on after the failed call
            last = out
        front.stop()
        return idle, busy, last

    idle, busy, last = asyncio.run(main())
    assert idle == ("tokenmill-engine", 0) and busy == ("tokenmill-engine", 1)
    assert last.finished and len(last.outputs[0].token_ids) == 200
