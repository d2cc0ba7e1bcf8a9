"""The `bench serve` client's request body, for servers with and without vLLM's extensions."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest

from tokenmill.bench.serve import Prompt, send

THREE_TOKENS = [*({"choices": [{"text": t}]} for t in ("a", "b", "c")),
                {"choices": [], "usage": {"completion_tokens": 3}}]


def _fake_server(seen: list[dict], chunks: list[dict], done: bool) -> httpx.MockTransport:
    """Streams `chunks` (then [DONE] if done), recording each request body."""
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ("data: [DONE]\n\n" if done else "")
        return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handle)


def _send(prompt, ignore_eos: bool, chunks: list[dict] = THREE_TOKENS, done: bool = True) -> tuple[dict, object]:
    seen: list[dict] = []

    async def go():
        async with httpx.AsyncClient(transport=_fake_server(seen, chunks, done)) as client:
            return await send(client, "http://test", "m", Prompt(prompt, 8), ignore_eos)
    result = asyncio.run(go())
    return seen[0], result


def test_token_id_prompt_with_ignore_eos_by_default():
    body, result = _send([5, 6, 7], ignore_eos=True)
    assert body["prompt"] == [5, 6, 7] and body["ignore_eos"] is True and body["max_tokens"] == 8
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert result.ok and result.output_tokens == 3 and len(result.itl) == 2


def test_text_prompt_without_ignore_eos_for_strict_servers():
    body, result = _send("hello there", ignore_eos=False)
    assert body["prompt"] == "hello there" and "ignore_eos" not in body
    assert result.ok and result.output_tokens == 3


def test_each_request_rate_gets_prompts_of_its_own():
    """A prefix-caching server would serve a rate's prompts from its cache if an earlier rate had
    sent them: each rate draws its own, the same ones from run to run."""
    from argparse import Namespace

    from tokenmill.bench.serve import rate_prompts
    args = Namespace(num_prompts=8, prompt_len=(32, 64), output_len=(4, 8), dataset_seed=3)
    first, second = rate_prompts(args, 0), rate_prompts(args, 1)
    assert rate_prompts(args, 1) == second and len(first) == len(second) == 8
    assert all(len(p.prompt) >= 32 and 4 <= p.max_tokens <= 8 for p in first + second)
    # not even one block of 16 tokens in common between the two rates' prompts
    assert not {tuple(p.prompt[:16]) for p in first} & {tuple(p.prompt[:16]) for p in second}


def test_a_stream_that_ends_at_once_on_eos_is_a_success_and_a_cut_one_is_not():
    """An EOS first decodes to no text: the request still succeeded (one token, per usage), and
    its first chunk is its first token; a stream that stops without [DONE] or a finish_reason failed."""
    eos_first = [{"choices": [{"text": "", "finish_reason": "stop"}]},
                 {"choices": [], "usage": {"completion_tokens": 1}}]
    _, result = _send([5], ignore_eos=False, chunks=eos_first)
    assert result.ok and result.output_tokens == 1 and result.ttft > 0 and result.itl == []
    _, cut = _send([5], ignore_eos=True, chunks=THREE_TOKENS[:2], done=False)
    assert not cut.ok and "unfinished" in cut.error


def test_time_per_output_token_leaves_out_one_token_requests():
    from tokenmill.bench.serve import RequestResult, summarize
    results = [RequestResult(True, 1, 0.1, 0.1), RequestResult(True, 11, 0.1, 1.1), RequestResult(True, 11, 0.1, 2.1)]
    row = summarize(results, wall=3.0, rate=1.0, slo={"tpot": 150.0})
    assert abs(row["tpot"]["mean"] - 0.15) < 1e-9 and row["completed"] == 3
    assert abs(row["goodput_req_s"] - 2 / 3.0) < 1e-9  # the one-token request meets any TPOT SLO


def test_arrivals_keep_their_schedule_while_the_loop_is_busy():
    """Each request goes out at its drawn time from the start, so the event loop's time on open
    streams (here 2 ms blocked, 4 ms into each request) delays an arrival but does not push back
    every later one."""
    import random

    from tokenmill.bench import serve
    sent: list[float] = []

    async def busy_send(client, url, model, req, ignore_eos=True):
        sent.append(time.perf_counter())
        await asyncio.sleep(0.004)
        time.sleep(0.002)
        return serve.RequestResult(True, 1, 0.0, 0.0)
    original, serve.send = serve.send, busy_send
    try:
        asyncio.run(serve.run_rate("http://test", "m", [Prompt([5], 1)] * 60, 200.0, 1.0, None, 60.0, 0,
                                   progress=False))
    finally:
        serve.send = original
    schedule = serve.arrival_times(60, 200.0, 1.0, random.Random(0))
    assert len(sent) == 60 and abs(schedule[1:].mean() / np.arange(1, 60).mean() - 1 / 200) < 2e-3
    lateness = [t - sent[0] - at for t, at in zip(sent, schedule)]  # from the first, which goes at 0
    assert max(lateness) < 0.025, f"the last arrivals ran {max(lateness) * 1e3:.0f} ms late"


def test_waiting_for_a_server_fails_fast_on_a_bad_url_and_ends():
    """A --base-url that cannot be used fails at once, not after minutes of silence; a server that
    never answers fails at the timeout, with an error the CLI prints as one line."""
    import time

    from tokenmill.bench.serve import wait_healthy
    start = time.monotonic()
    with pytest.raises(ValueError, match="base-url"):
        wait_healthy("not-a-url", None, timeout=30)
    with pytest.raises(ConnectionError, match="no healthy server"):
        wait_healthy("http://127.0.0.1:1", None, timeout=1)
    assert time.monotonic() - start < 10
