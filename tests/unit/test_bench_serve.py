"""The `bench serve` client's request body, for servers with and without vLLM's extensions."""

from __future__ import annotations

import asyncio
import json

import httpx

from tokenmill.bench.serve import Prompt, send


def _fake_server(seen: list[dict]) -> httpx.MockTransport:
    """Streams three text chunks, a usage chunk and [DONE], recording each request body."""
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        chunks = [{"choices": [{"text": t}]} for t in ("a", "b", "c")]
        chunks.append({"choices": [], "usage": {"completion_tokens": 3}})
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handle)


def _send(prompt, ignore_eos: bool) -> tuple[dict, object]:
    seen: list[dict] = []

    async def go():
        async with httpx.AsyncClient(transport=_fake_server(seen)) as client:
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
