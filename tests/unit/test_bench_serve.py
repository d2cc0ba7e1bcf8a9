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
    assert summarize(results, wall=3.0, rate=1.0, slo={})["goodput_req_s"] is None  # no SLO: no goodput


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


def _answer(response: httpx.Response) -> object:
    """send() against a server that answers every request with `response`."""
    async def go():
        transport = httpx.MockTransport(lambda request: response)
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, "http://test", "m", Prompt([5], 8))
    return asyncio.run(go())


def test_a_json_error_body_is_reported_by_its_message():
    """OpenAI's, FastAPI's and plain {"error": "..."} bodies, with an error status or in place of
    a stream (before: the body's bytes, or "no tokens received")."""
    result = _answer(httpx.Response(404, json={"detail": "Not Found"}))
    assert not result.ok and result.error == "HTTP 404: Not Found"
    result = _answer(httpx.Response(400, json={"error": {"message": "model 'm' does not exist", "code": 400}}))
    assert result.error == "HTTP 400: model 'm' does not exist"
    result = _answer(httpx.Response(200, json={"error": "prompt must be a string"}))
    assert not result.ok and result.error == "no event stream; the server answered: prompt must be a string"
    result = _answer(httpx.Response(500, text="Internal Server Error"))
    assert result.error == "HTTP 500: Internal Server Error"


def test_a_server_without_an_openai_model_list_is_one_error(monkeypatch):
    from tokenmill.bench import serve
    monkeypatch.setattr(httpx, "get", lambda url, timeout: httpx.Response(404, json={"detail": "Not Found"}))
    with pytest.raises(ValueError, match=r"/v1/models named no model \(HTTP 404: Not Found\); give --served-model"):
        serve.first_model("http://test")


@pytest.mark.parametrize("argv, message", [
    (["--slo", "ttft=2000,tpot=abc"], "ttft=MS,tpot=MS"), (["--slo", "ttfb=200"], "ttft=MS,tpot=MS"),
    (["--slo", "ttft=-5"], "ttft=MS,tpot=MS"), (["--slo", "ttft"], "ttft=MS,tpot=MS"),
    (["--prompt-len", "300", "200"], "MIN (300) is above MAX (200)"),
    (["--output-len", "0", "8"], "must be at least 1"),
])
def test_bad_slo_and_length_ranges_are_usage_errors_before_the_run(argv, message, capsys):
    """--slo was read after the run it judges; MIN > MAX failed in randint once the server was up."""
    from tokenmill.cli import build_parser
    for bench in ("serve", "throughput") if argv[0] != "--slo" else ("serve",):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["bench", bench, *argv])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and argv[0] in err and message in err
    args = build_parser().parse_args(["bench", "serve", "--slo", "ttft=2000,tpot=50.5", "--prompt-len", "8", "8"])
    assert args.slo == {"ttft": 2000.0, "tpot": 50.5} and args.prompt_len == [8, 8]


def test_percentiles_of_no_samples_are_shown_as_missing_not_zero():
    from tokenmill.bench.serve import RequestResult, format_rows, summarize
    row = summarize([RequestResult(False, error="HTTP 500: boom")], wall=1.0, rate=1.0, slo={})
    assert row["ttft"] == {"mean": None, "p50": None, "p90": None, "p99": None} and row["failed"] == 1
    latencies = format_rows([row]).splitlines()[-1].split()[-16:]
    assert latencies == ["-"] * 16


def test_a_run_where_every_request_failed_exits_nonzero(monkeypatch, capsys):
    from tokenmill.bench import serve
    from tokenmill.cli import main

    async def failing(client, url, model, req, ignore_eos=True):
        return serve.RequestResult(False, error="HTTP 500: boom")
    monkeypatch.setattr(serve, "wait_healthy", lambda url, proc, timeout: None)
    monkeypatch.setattr(serve, "send", failing)
    assert main(["bench", "serve", "--base-url", "http://test", "--served-model", "m", "--num-prompts", "2"]) == 1
    out = capsys.readouterr()
    assert "every request failed" in out.err and "HTTP 500: boom" in out.out
