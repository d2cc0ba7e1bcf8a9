"""The OpenAI-compatible server, driven over real HTTP on 127.0.0.1 with a tiny model:
the official openai client (sync, async, streaming), equality with LLM.generate, many
concurrent streams, cancellation, faults, and every bad input answered."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import MAX_JSON_DEPTH
from tokenmill.server.api import create_app

ENGINE_OPTIONS = dict(max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=512, block_size=16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model_dir, send_buffer: int | None = None, engine_options: dict | None = None, **app_options):
    """The real app on a real socket, uvicorn in a background thread. send_buffer: the kernel send
    buffer of its connections, in bytes (they take the listening socket's); None: the system's,
    which grows to MBs. engine_options: changes to ENGINE_OPTIONS."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), **{**ENGINE_OPTIONS, **(engine_options or {})}))
    app = create_app(engine, "tiny", **app_options)
    sock = socket.socket()
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield type("Running", (), {"url": f"http://127.0.0.1:{port}", "engine": engine, "app": app})
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def openai_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    """The openai client a test talks to a running server's /v1 with; no retries, so that a refusal
    or a failure shows as it is."""
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, max_body_bytes=64 * 1024) as s:
        yield s


@pytest.fixture
def client(server):
    return openai_client(server.url)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def assert_still_serving(client) -> None:
    out = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


# ---- the openai client -----------------------------------------------------------------------

def test_completion_matches_llm_generate(client, tiny_llama):
    from tokenmill import LLM, SamplingParams
    prompt = "w5 w9 w13 w200"
    http = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    local = LLM(str(tiny_llama), **ENGINE_OPTIONS).generate(
        prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert http.choices[0].text == local.outputs[0].text
    assert http.usage.completion_tokens == 12 and http.usage.prompt_tokens == len(local.prompt_token_ids)


def test_streaming_completion_adds_up_and_reports_usage(client):
    whole = client.completions.create(model="tiny", prompt="w7 w8", max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny", prompt="w7 w8", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_chat_completion_stream_and_whole(client):
    messages = [{"role": "user", "content": "w11 w12"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6,
                                           temperature=0)
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == whole.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_echo_and_logprobs(client, server):
    out = client.completions.create(model="tiny", prompt=["w5", "w6 w7"], n=2, max_tokens=4, temperature=1.0,
                                    seed=3, logprobs=2, echo=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[2].text.startswith("w6 w7")
    lp = out.choices[0].logprobs
    prompt_len = out.usage.prompt_tokens - len(server.engine.tokenizer.encode("w6 w7"))  # of "w5"
    # with echo the prompt's tokens come first (the first without a logprob), then the 4 generated
    assert len(lp.tokens) == prompt_len + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    # offsets count from the start of the text returned: the echoed prompt comes first
    assert lp.text_offset[0] == 0 and lp.text_offset[prompt_len] == len("w5")
    stream = client.completions.create(model="tiny", prompt="w5", max_tokens=4, temperature=1.0, seed=3,
                                       logprobs=2, echo=True, stream=True)
    offsets = [o for chunk in stream if chunk.choices and chunk.choices[0].logprobs
               for o in chunk.choices[0].logprobs.text_offset]
    assert offsets[0] == 0 and offsets[prompt_len] == len("w5") and offsets == sorted(offsets)
    # text held back for a stop string that never comes: offsets still those of the whole text
    kwargs = dict(model="tiny", prompt="w5", max_tokens=8, temperature=0, logprobs=0, stop=["zzzz"],
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].logprobs.text_offset
    streamed = [o for chunk in client.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for o in chunk.choices[0].logprobs.text_offset]
    assert streamed == whole and whole[1] > 0
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w9"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2
    assert content[0].logprob == max(t.logprob for t in content[0].top_logprobs)


def test_echo_with_max_tokens_0_scores_the_prompt(client, server, tiny_llama):
    """echo with max_tokens 0 (how clients such as lm-evaluation-harness score a text): the
    prompt alone, every token's logprob given those before it (the first: none) as the offline
    API's prompt_logprobs computes them, no completion tokens; streamed the same. max_tokens 0
    without echo asks for nothing: a 400."""
    from tokenmill import LLM, SamplingParams
    prompt = "w5 w9 w13 w200 w7"
    ids = server.engine.tokenizer.encode(prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    local = LLM(str(tiny_llama), **ENGINE_OPTIONS).generate(
        prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0].prompt_logprobs
    assert lp.tokens == [server.engine.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([local[j][t] for j, t in enumerate(ids) if j], abs=1e-5)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    chunks = [c for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                                   logprobs=1, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == prompt and chunks[-1].choices[0].finish_reason == "length"
    assert [t for c in chunks for t in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(0\)"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, extra_body={"min_tokens": 2})


def test_async_client_64_concurrent_streams(server):
    async def one(client, i):
        n = 4 + i % 9
        stream = await client.completions.create(model="tiny", prompt=f"w{5 + i}", max_tokens=n, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return n, usage.completion_tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(64)))
    results = asyncio.run(main())
    assert all(want == got for want, got in results)


def test_models_tokenize_detokenize_version(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "w5 w6"}).json()
    assert tokens["tokens"] == [5, 6] and tokens["count"] == 2
    assert httpx.post(server.url + "/detokenize", json={"tokens": [5, 6]}).json()["prompt"] == "w5 w6"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "w7"}]}).json()
    assert chat["tokens"] == [2, 7, 3, 4] and "token_strs" not in chat
    from tokenmill.cpu_kernels import load_cpu_kernels, this_cpu
    version = httpx.get(server.url + "/version").json()
    device = os.environ.get("TOKENMILL_TEST_DEVICE", "cpu")  # (the suite run on a GPU machine)
    assert version["cpu"] == this_cpu().as_dict() and version["device"].split(":")[0] == device and version["version"]
    # a Hugging Face directory: no 8-bit x; where the CPU has AVX512-BF16, bfloat16 weights in the
    # products and a bfloat16 pool, else float32's
    bf16 = device == "cpu" and this_cpu().has("avx512_bf16")
    amx_rows = load_cpu_kernels(required=True).amx_min_rows if bf16 else 0
    assert version["arithmetic"] == {"dtype": "float32", "kv_dtype": "bfloat16" if bf16 else "float32",
                                     "bf16_weights": bf16, "amx_min_rows": amx_rows, "gguf_int8_rows": 0}
    assert httpx.get(server.url + "/health").status_code == 200


def test_tokenize_renders_messages_as_chat_does_and_returns_token_strings(server):
    tokenizer = server.engine.tokenizer
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "w5 w6", "return_token_strs": True}).json()
    assert tokens["tokens"] == [5, 6] and tokens["token_strs"] == tokenizer.convert_ids_to_tokens([5, 6]) == [
        "w5", "w6"]
    messages = [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8"}]
    for options in ({}, {"add_generation_prompt": False}, {"add_generation_prompt": False,
                                                           "continue_final_message": True}):
        ids = httpx.post(server.url + "/tokenize", json={"messages": messages, **options}).json()["tokens"]
        chat = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": 1, **options}).json()
        assert len(ids) == chat["usage"]["prompt_tokens"], options
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def check_prompt_logprobs(server, entries: list, prompt_ids: list[int], n: int) -> None:
    """vLLM's shape: None, then per token its own entry first and the top-n, ranks consistent."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token, entry in zip(prompt_ids[1:], entries[1:]):
        (own, first), *alternatives = entry.items()
        assert own == str(token) and first["decoded_token"] == server.engine.tokenizer.decode([token])
        ranks = [a["rank"] for _, a in alternatives]
        assert ranks == [r for r in range(1, n + 1) if r != first["rank"]]
        by_rank = sorted(entry.values(), key=lambda a: a["rank"])
        assert [a["logprob"] for a in by_rank] == sorted((a["logprob"] for a in by_rank), reverse=True)


def test_prompt_logprobs_come_in_each_completion_choice_and_once_in_chat(server):
    url = server.url
    body = {"model": "tiny", "prompt": "w5 w6 w7 w8", "max_tokens": 1, "prompt_logprobs": 2}
    scored = httpx.post(url + "/v1/completions", json={**body, "echo": True, "logprobs": 2}).json()["choices"][0]
    entries = scored["prompt_logprobs"]
    check_prompt_logprobs(server, entries, [5, 6, 7, 8], 2)
    assert [e and e["%d" % t]["logprob"] for e, t in zip(entries, [5, 6, 7, 8])] == scored["logprobs"][
        "token_logprobs"][:4]  # the legacy echo's scores of the same tokens
    two = httpx.post(url + "/v1/completions", json={**body, "n": 2, "prompt": ["w5 w6 w7 w8", "w9"]}).json()
    assert [c["prompt_logprobs"] for c in two["choices"]] == [entries, entries, [None], [None]]
    assert "prompt_logprobs" not in httpx.post(url + "/v1/completions", json={**body, "prompt_logprobs": None}).json()[
        "choices"][0]
    chat = httpx.post(url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "w7"}], "max_tokens": 1, "n": 2,
        "prompt_logprobs": 0}).json()
    check_prompt_logprobs(server, chat["prompt_logprobs"], [2, 7, 3, 4], 0)
    assert all("prompt_logprobs" not in c for c in chat["choices"])
    echo = {**body, "echo": True, "logprobs": 1, "prompt_logprobs": None, "temperature": 0}
    both = httpx.post(url + "/v1/completions", json={**echo, "prompt_logprobs": 2}).json()["choices"][0]
    alone = httpx.post(url + "/v1/completions", json=echo).json()["choices"][0]
    assert both["prompt_logprobs"] == entries and both["logprobs"] == alone["logprobs"]  # each view its own n
    for extra in ({"stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                  {"prompt_logprobs": -3, "echo": True, "logprobs": 2}):
        r = httpx.post(url + "/v1/completions", json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", (extra, r.text)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w7"}], "max_tokens": 1, "prompt_logprobs": -1}
    r = httpx.post(url + "/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt_logprobs must be >= 0, got -1", r.text


def streamed_chunks(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completions_return_token_ids_and_the_stop_reason_as_vllm_does(server):
    url, decode = server.url, server.engine.tokenizer.decode
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]
    ids = whole["token_ids"]
    assert whole["prompt_token_ids"] == [5, 6] and len(ids) == 8 and decode([5, 6, *ids]) == "w5 w6" + whole["text"]
    assert (whole["finish_reason"], whole["stop_reason"]) == ("length", None)
    choices = [c["choices"][0] for c in streamed_chunks(url, "/v1/completions", body)]
    assert [c["prompt_token_ids"] for c in choices if "prompt_token_ids" in c] == [[5, 6]]
    assert [t for c in choices for t in c["token_ids"]] == ids and choices[-1]["stop_reason"] is None
    by_id = httpx.post(url + "/v1/completions", json={**body, "stop_token_ids": [ids[2]]}).json()["choices"][0]
    assert (by_id["finish_reason"], by_id["stop_reason"], by_id["token_ids"]) == ("stop", ids[2], ids[:3])
    word = decode([ids[3]]).strip()
    by_text = httpx.post(url + "/v1/completions", json={**body, "stop": [word]}).json()["choices"][0]
    assert (by_text["finish_reason"], by_text["stop_reason"]) == ("stop", word)
    plain = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain and plain["stop_reason"] is None
    named = httpx.post(url + "/v1/completions", json={**body, "logprobs": 1, "echo": True, "max_tokens": 2,
                                                      "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in [5, 6, *ids[:2]]]
    assert all(key.startswith("token_id:") for top in named["logprobs"]["top_logprobs"][1:] for key in top)
    assert named["logprobs"]["text_offset"] == [0, 2, 5, 5 + len(decode([ids[0]]))]  # the text's, as without


def test_chat_returns_token_ids_once_for_the_prompt_and_each_choices_own(server):
    url = server.url
    messages = [{"role": "user", "content": "w7"}]
    prompt = httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "n": 2}
    whole = httpx.post(url + "/v1/chat/completions", json=body).json()
    assert whole["prompt_token_ids"] == prompt and [len(c["token_ids"]) for c in whole["choices"]] == [5, 5]
    assert whole["choices"][0]["stop_reason"] is None
    chunks = streamed_chunks(url, "/v1/chat/completions", body)
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [prompt, prompt]  # each choice's first
    for k in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == k]
        assert [t for c in mine for t in c.get("token_ids", [])] == whole["choices"][k]["token_ids"]
    named = httpx.post(url + "/v1/chat/completions", json={**body, "n": 1, "logprobs": True, "top_logprobs": 2,
                                                           "return_tokens_as_token_ids": True}).json()["choices"][0]
    content = named["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in named["token_ids"]]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])


def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(server):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries the
    usage of its choice so far; the last chunk (no choices) the whole request's, as without it."""
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = streamed_chunks(server.url, "/v1/completions", body)
    emitted = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        choice = chunk["choices"][0]
        emitted[choice["index"]] += len(choice["token_ids"])
        assert chunk["usage"]["prompt_tokens"] == 2 and chunk["usage"]["completion_tokens"] == emitted[choice["index"]]
    assert emitted == {0: 6, 1: 6} and chunks[-1]["usage"]["completion_tokens"] == 12
    plain = streamed_chunks(server.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"] == chunks[-1]["usage"]


def test_continuous_usage_of_a_chat_stream_counts_no_tokens_in_the_role_delta(server):
    """As in vLLM, the delta that opens a chat choice (its role) reports 0 completion tokens, though
    it goes out together with the choice's first token; every later chunk counts its tokens so far."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w7"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = streamed_chunks(server.url, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    emitted = list(itertools.accumulate(len(c["choices"][0].get("token_ids", [])) for c in chunks[:-1]))
    assert counts == emitted and counts[0] == 0 and counts[-1] == 4 == chunks[-1]["usage"]["completion_tokens"]


def test_a_requests_deadline_reaches_the_edf_scheduler_from_every_endpoint(tiny_llama):
    """A deadline of a microsecond is missed, one of an hour is not: each endpoint's `deadline`
    reaches the scheduler, which counts the late ones."""
    with running_server(tiny_llama, engine_options={"scheduling_policy": "edf"}) as s:
        late, early = {"max_tokens": 2, "deadline": 1e-6}, {"max_tokens": 2, "deadline": 3600}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}]}
        for path, body in [("/v1/completions", {"model": "tiny", "prompt": "w5", **late}),
                           ("/v1/chat/completions", {**chat, **early}), ("/v1/chat/completions", {**chat, **late}),
                           ("/v1/responses", {"input": "w5", "max_output_tokens": 2, "deadline": 1e-6})]:
            assert httpx.post(s.url + path, json=body).status_code == 200, path
        assert metric(s.url, "tokenmill_requests_missed_deadline_total") == 3


def test_usage_counts_cached_prompt_tokens_and_a_cache_salt_shares_them_only_within_itself(server):
    """OpenAI's usage.prompt_tokens_details.cached_tokens; vLLM's cache_salt. A repeat reuses the
    prompt's full blocks of 16 tokens but the one holding its last token (always computed)."""
    prompt = " ".join(f"w{7 + (i * 37) % 300}" for i in range(64))  # a prompt no other test sends
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    length = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["count"]
    full = (length - 1) // 16 * 16

    def cached(path: str = "/v1/completions", **extra) -> int:
        r = httpx.post(server.url + path, json={**body, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert [cached(cache_salt="t1"), cached(cache_salt="t1"), cached(cache_salt="t2"), cached(),
            cached(cache_salt="t2"), cached()] == [0, full, 0, 0, full, full] and full >= 48
    streamed = streamed_chunks(server.url, "/v1/completions", {**body, "cache_salt": "t1",
                                                                "stream_options": {"include_usage": True}})
    assert streamed[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": full}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
            "stream_options": {"include_usage": True}}
    first, again = (streamed_chunks(server.url, "/v1/chat/completions", chat)[-1]["usage"] for _ in range(2))
    assert again["prompt_tokens_details"]["cached_tokens"] == (again["prompt_tokens"] - 1) // 16 * 16 > 0
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "w5"}], "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_a_request_id_header_names_the_answer_and_comes_back_with_it_as_vllms_does(server):
    """X-Request-Id (else the body's request_id) after the endpoint's prefix, whole and streamed,
    echoed as a header, and the key of the answer's request timelines; the same id twice at once
    is two answers (the engine's own ids stay unique); a header past 256 characters is a 400."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "w5", "max_tokens": 2},
                   headers={"X-Request-Id": "trace-41"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-trace-41" and r.headers["x-request-id"] == "trace-41"
    assert [t["request_id"].startswith("cmpl-trace-41-") for t in
            httpx.get(server.url + "/v1/requests/cmpl-trace-41").json()["requests"]] == [True]
    r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "request_id": "from-the-body"})
    assert r.json()["id"] == "chatcmpl-from-the-body" and "x-request-id" not in r.headers
    r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "request_id": "from-the-body"},
                   headers={"X-Request-Id": "from-the-header"})
    assert r.json()["id"] == "chatcmpl-from-the-header"
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**chat, "stream": True},
                      headers={"X-Request-Id": "s-1"}) as response:
        assert response.headers["x-request-id"] == "s-1"
        ids = {json.loads(line[6:])["id"] for line in response.iter_lines()
               if line.startswith("data: ") and line != "data: [DONE]"}
    assert ids == {"chatcmpl-s-1"}

    async def twice() -> list[httpx.Response]:
        async with httpx.AsyncClient() as client:
            body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 16, "ignore_eos": True}
            return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=body,
                                                      headers={"X-Request-Id": "same"}) for _ in range(2)))
    assert [(a.status_code, a.json()["id"]) for a in asyncio.run(twice())] == [(200, "cmpl-same")] * 2
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "w5"},
                   headers={"X-Request-Id": "x" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id" and r.headers["x-request-id"]


def test_embeddings_slashed_and_utf8_ids_and_a_repeated_header_each_name_the_answer_by_the_id_given(server):
    """Embeddings take the body's request_id, and the header over it, as the other endpoints do; an
    id with slashes, or with UTF-8 bytes, is found at /v1/requests/{id} (bytes that are not UTF-8 are
    a 400); with X-Request-Id sent twice, the answer's id and the echo are the first."""
    embed = {"model": "tiny", "input": "w5", "request_id": "e-1"}
    r = httpx.post(server.url + "/v1/embeddings", json=embed)
    assert r.status_code == 200 and r.json()["id"] == "embd-e-1"
    r = httpx.post(server.url + "/v1/embeddings", json=embed, headers={"X-Request-Id": "e-2"})
    assert (r.status_code, r.json()["id"], r.headers["x-request-id"]) == (200, "embd-e-2", "e-2")
    completion = {"model": "tiny", "prompt": "w5", "max_tokens": 2}
    for given, path in (("team/a/41", "team/a/41"), ("café".encode(), "caf%C3%A9")):
        r = httpx.post(server.url + "/v1/completions", json=completion, headers={"X-Request-Id": given})
        name = given if isinstance(given, str) else given.decode()
        assert (r.status_code, r.json()["id"]) == (200, f"cmpl-{name}")
        timeline = httpx.get(server.url + f"/v1/requests/cmpl-{path}")
        assert timeline.status_code == 200 and timeline.json()["id"] == f"cmpl-{name}"
    r = httpx.post(server.url + "/v1/completions", json=completion, headers={"X-Request-Id": b"\xff"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "X-Request-Id must be UTF-8"
    r = httpx.post(server.url + "/v1/completions", json=completion,
                   headers=[("X-Request-Id", "first"), ("X-Request-Id", "second")])
    assert (r.status_code, r.json()["id"], r.headers.get_list("x-request-id")) == (200, "cmpl-first", ["first"])


def test_access_log_has_a_line_per_request_once_it_is_done(server, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.server")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "tokenmill.server"]

    def wait_for(prefix: str) -> None:  # the server thread logs after its last send
        deadline = time.monotonic() + 5
        while not any(line.startswith(prefix) and line.endswith(" ms") for line in lines()):
            assert time.monotonic() < deadline, (prefix, lines())
            time.sleep(0.01)

    # the line of an earlier test's last request may come just after its answer: a request of our
    # own logged first, the records start afresh
    httpx.get(server.url + "/health")
    wait_for("GET /health 200 ")
    caplog.clear()
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        events = response.iter_lines()
        assert next(line for line in events if line.startswith("data:")) != "data: [DONE]"
        assert not any(line.startswith("POST /v1/completions") for line in lines())  # still streaming
        assert [line for line in events if line.startswith("data:")][-1] == "data: [DONE]"
    wait_for("POST /v1/completions 200 ")
    httpx.post(server.url + "/v1/completions", json={"model": "gpt-9", "prompt": "w5"})
    wait_for("POST /v1/completions 404 ")
    httpx.post(server.url + "/v1/completions", content=b"x" * (65 * 1024), headers={"content-type": "application/json"})
    wait_for("POST /v1/completions 413 ")


def test_a_top_k_of_the_whole_vocabulary_and_a_tiny_temperature_are_served(server, client):
    """A top_k of the whole vocabulary keeps every token; a temperature below 1e-5 samples greedily
    (logits divided by it would overflow float32)."""
    greedy = client.completions.create(model="tiny", prompt="w5 w9", max_tokens=6, temperature=0)
    for extra in ({"top_k": server.engine.model_config.vocab_size}, {"temperature": 1e-50}):
        body = {"model": "tiny", "prompt": "w5 w9", "max_tokens": 6, **extra}
        if "temperature" not in extra:
            body["temperature"] = 0
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy.choices[0].text


def test_add_special_tokens_false_leaves_out_the_bos_a_tokenizer_adds(tiny_llama, tmp_path):
    """A completion prompt gets its tokenizer's BOS, as vLLM gives it, unless the request says
    add_special_tokens: false (a text that holds its own BOS would get two)."""
    from conftest import copy_model
    from tokenizers import Tokenizer, processors
    model = copy_model(tiny_llama, tmp_path / "llama")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="w0 $A", special_tokens=[("w0", 0)])
    tokenizer.save(str(model / "tokenizer.json"))  # every text opens with w0, as Llama's open with <s>
    with running_server(model) as s:
        def prompt_ids(**extra) -> list[int]:
            body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 1, "return_token_ids": True, **extra}
            return httpx.post(s.url + "/v1/completions", json=body).json()["choices"][0]["prompt_token_ids"]
        assert prompt_ids() == prompt_ids(add_special_tokens=True) == [0, 5, 6]
        assert prompt_ids(add_special_tokens=False) == [5, 6]
        assert prompt_ids(prompt=[0, 5, 6], add_special_tokens=False) == [0, 5, 6]  # token ids stay as given


def test_chat_without_a_generation_prompt_continues_the_last_message(server):
    messages = [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8"}]
    with_prompt = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, "add_generation_prompt": False}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] < len(with_prompt)


def test_continue_final_message_leaves_the_last_message_open_and_needs_no_generation_prompt(server):
    messages = [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, "add_generation_prompt": False}
    closed = httpx.post(server.url + "/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "continue_final_message": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] < closed  # no end of the turn
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={**body, "continue_final_message": True, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


# ---- cancellation ----------------------------------------------------------------------------

def test_dropped_streams_are_aborted_and_free_their_blocks(server):
    async def open_and_drop():
        async with httpx.AsyncClient(timeout=30) as http:
            async def one(i):
                body = {"model": "tiny", "prompt": f"w{i + 3} w4", "max_tokens": 400, "stream": True,
                        "ignore_eos": True}
                async with http.stream("POST", server.url + "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            return  # leave after the first chunk: the connection closes
            await asyncio.gather(*(one(i) for i in range(32)))
    asyncio.run(open_and_drop())
    deadline = time.monotonic() + 10
    while metric(server.url, "tokenmill_num_requests_running") or metric(server.url, "tokenmill_kv_blocks_used"):
        assert time.monotonic() < deadline, "aborted requests still hold the pool"
        time.sleep(0.1)
    assert metric(server.url, "tokenmill_num_requests_waiting") == 0
    assert not server.engine.has_unfinished_requests()


# ---- bad input -------------------------------------------------------------------------------

def nested_schema(levels: int) -> dict:
    """An object schema `levels` objects deep (twice that in JSON: each schema and its properties)."""
    schema = {"type": "object"}
    for _ in range(levels - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BAD_REQUESTS = [
    ("malformed json", "/v1/completions", b'{"prompt": "w5", ', 400, None),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("wrong type", "/v1/completions", {"prompt": "w5", "max_tokens": "many"}, 400, "max_tokens"),
    ("temperature out of range", "/v1/completions", {"prompt": "w5", "temperature": -1}, 400, "temperature"),
    ("top_p out of range", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "w5"}], "top_p": 1.5}, 400, "top_p"),
    ("beyond context", "/v1/completions", {"prompt": [5] * 8000, "max_tokens": 500}, 400, None),
    ("max_tokens past the context", "/v1/completions", {"prompt": [5] * 10, "max_tokens": 100_000}, 400,
     "prompt"),  # OpenAI's param: the input to shorten
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w5"}]}, 400, None),
    ("bad token id", "/v1/completions", {"prompt": [99999]}, 400, None),
    ("booleans as token ids", "/v1/completions", {"prompt": [True, False]}, 400, "prompt"),
    ("booleans in a batch of token ids", "/v1/completions", {"prompt": [[5], [True]]}, 400, "prompt"),
    ("a boolean to detokenize", "/detokenize", {"tokens": [5, True]}, 400, "tokens"),
    ("a boolean stop token id", "/v1/completions", {"prompt": "w5", "stop_token_ids": [False]}, 400,
     "stop_token_ids"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "w5"}, 404, "model"),
    ("too large", "/v1/completions", {"prompt": "w5 " * 40000}, 413, None),
    ("seed past 64 bits", "/v1/completions", {"prompt": "w5", "seed": 2 ** 64}, 400, "seed"),
    ("n too large", "/v1/completions", {"prompt": "w5", "n": 100_000_000}, 400, "n"),
    ("too many completions", "/v1/completions", {"prompt": [[5]] * 600, "n": 2}, 400, "prompt"),
    ("best_of", "/v1/completions", {"prompt": "w5", "best_of": 3}, 400, "best_of"),
    ("beam search", "/v1/completions", {"prompt": "w5", "use_beam_search": True}, 400, "use_beam_search"),
    ("echo in chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "echo": True}, 400,
     "echo"),
    ("logit_bias key", "/v1/completions", {"prompt": "w5", "logit_bias": {"w5": 10}}, 400, "logit_bias"),
    ("logit_bias value", "/v1/completions", {"prompt": "w5", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ("logit_bias past the vocabulary", "/v1/completions", {"prompt": "w5", "logit_bias": {"99999": 1}}, 400,
     "logit_bias"),
    ("allowed_token_ids past the vocabulary", "/v1/completions", {"prompt": "w5", "allowed_token_ids": [99999]},
     400, "allowed_token_ids"),
    ("unknown response_format", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "w5"}], "response_format": {"type": "yaml"}}, 400,
     "response_format"),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("max_completion_tokens 0", "/v1/chat/completions",  # not "no limit"
     {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("empty stop string", "/v1/completions", {"prompt": "w5", "stop": ""}, 400, "stop"),
    ("priority under fcfs", "/v1/completions", {"prompt": "w5", "priority": 5}, 400, "priority"),
    ("deadline under fcfs", "/v1/completions", {"prompt": "w5", "deadline": 5}, 400, "deadline"),
    ("a boolean priority", "/v1/completions", {"prompt": "w5", "priority": True}, 400, "priority"),
    ("deadline of 0", "/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "deadline": 0}, 400,
     "deadline"),
    ("deadline not a number", "/v1/completions", {"prompt": "w5", "deadline": "soon"}, 400, "deadline"),
    # lone surrogates ("\ud800" in JSON) are no unicode: the tokenizer and the response's encoder refuse them
    ("lone surrogate in a prompt", "/v1/completions", b'{"prompt": "w5 \\ud800"}', 400, "prompt"),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages.0.content"),
    ("lone surrogate in a model name", "/v1/completions", b'{"prompt": "w5", "model": "\\ud800"}', 400, "model"),
    ("lone surrogate to tokenize", "/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),
    ("lone surrogate in bad_words", "/v1/completions", b'{"prompt": "w5", "bad_words": ["\\ud800"]}', 400,
     "bad_words"),
    ("infinite temperature", "/v1/completions", b'{"prompt": "w5", "temperature": Infinity}', 400, "temperature"),
    ("top_logprobs past 20", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "w5"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("a template from the request", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "w5"}], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400,
     "chat_template"),
    # values past any use: each is named, not served as if sane nor failing deep inside
    *((f"tool call arguments nested {depth} deep", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "w5"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "[" * depth + "]" * depth}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "w6"}]}, 400,
        "messages.1.tool_calls.0.function.arguments") for depth in (600, 5000)),  # past ours; past 3.11's decoder
    ("a temperature of 1e308", "/v1/completions", {"prompt": "w5", "temperature": 1e308}, 400, "temperature"),
    ("a temperature past OpenAI's 2", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "w5"}], "temperature": 2.5}, 400, "temperature"),
    ("a top_k of 1e11", "/v1/completions", {"prompt": "w5", "top_k": 1e11}, 400, "top_k"),
    ("a top_k past the vocabulary", "/v1/completions", {"prompt": "w5", "top_k": 2 ** 63}, 400, "top_k"),
    ("a truncate_prompt_tokens of 1e11", "/v1/completions", {"prompt": "w5", "truncate_prompt_tokens": 1e11}, 400,
     "truncate_prompt_tokens"),
    ("a tool schema nested 500 deep", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "w5"}], "tool_choice": "required", "tools": [
         {"type": "function", "function": {"name": "f", "parameters": nested_schema(250)}}]}, 400,
     "tools.0.function.parameters"),
    ("a response_format schema nested 500 deep", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "w5"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(250)}}}, 400,
     "response_format.json_schema.schema"),
    *((f"a body nested {depth} deep", "/v1/chat/completions",
       b'{"messages": [{"role": "user", "content": "w5"}], "metadata": ' + b"[" * depth + b"]" * depth + b"}", 400,
       None) for depth in (600, 5000)),
]


@pytest.mark.parametrize("name, path, body, status, param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(server, client, name, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert param in (error["param"] or "") or param in error["message"]
    assert_still_serving(client)


def test_a_token_id_past_the_vocabulary_is_a_400_naming_its_field(server):
    cases = [("/v1/completions", {"prompt": [99999]}, "prompt"),
             ("/v1/completions", {"prompt": "w5", "stop_token_ids": [99999]}, "stop_token_ids"),
             ("/v1/completions", {"prompt": "w5", "logit_bias": {"99999": 1}}, "logit_bias"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}],
                                       "allowed_token_ids": [99999]}, "allowed_token_ids"),
             ("/v1/embeddings", {"input": [[99999]]}, "input")]
    for path, body, param in cases:
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (path, response.text)


def test_a_request_with_no_body_is_a_400_saying_so(server):
    response = httpx.post(server.url + "/v1/completions", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "request body is missing: a JSON object is expected"


def test_a_body_nested_as_deep_as_the_limit_is_served_and_one_level_more_is_a_400(server):
    """The same on every Python: 3.11's decoder stops near 1,000 levels, 3.12's near 8,000."""
    def post(depth: int) -> httpx.Response:  # the body's own object is its first level
        inner = depth - 1
        return httpx.post(server.url + "/v1/chat/completions", headers={"content-type": "application/json"},
                          content=b'{"messages": [{"role": "user", "content": "w5"}], "max_tokens": 1, "metadata": '
                          + b"[" * inner + b"]" * inner + b"}")
    assert post(MAX_JSON_DEPTH).status_code == 200
    refused = post(MAX_JSON_DEPTH + 1)
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert message == f"the body nests objects and arrays deeper than {MAX_JSON_DEPTH} levels"


def test_a_wrong_method_gets_405_with_an_allow_header_and_an_openai_error_body(server):
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/health")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def test_max_tokens_past_the_context_and_an_unknown_model_answer_with_openais_error_fields(server):
    """max_tokens past the context is OpenAI's context_length_exceeded, its param the input to
    shorten; an unknown model is OpenAI's 404 with type invalid_request_error and code
    model_not_found (OpenAI's param there is null: vLLM's, "model", is kept)."""
    messages = [{"role": "user", "content": "w5"}]
    templated = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["count"]
    for path, body, prompt, name in (("/v1/completions", {"prompt": [5] * 10}, 10, "prompt"),
                                     ("/v1/chat/completions", {"messages": messages}, templated, "messages")):
        r = httpx.post(server.url + path, json={**body, "max_tokens": 100_000})
        assert r.status_code == 400 and r.json() == {"error": {
            "message": f"This model's maximum context length is {server.engine.max_model_len} tokens. However, you "
                       f"requested {prompt + 100_000} tokens ({prompt} in the {name}, 100000 in the completion): the "
                       f"prompt is too long for that completion. Please reduce the length of the {name} or the "
                       "completion's maximum tokens.",
            "type": "invalid_request_error", "param": name, "code": "context_length_exceeded"}}
    unknown = {"error": {"message": "the model 'gpt-9' does not exist (this server serves 'tiny')",
                         "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    for method, path, body in (("POST", "/v1/completions", {"prompt": "w5"}),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]}),
                               ("POST", "/tokenize", {"prompt": "w5"}), ("GET", "/v1/models/gpt-9", None)):
        r = httpx.request(method, server.url + path, json=None if body is None else {**body, "model": "gpt-9"})
        assert (r.status_code, r.json()) == (404, unknown), path


def test_inputs_at_the_edges_of_their_ranges_are_served(server, client):
    """A top_p just above 0 (0 in the sampler's float32: its kernel used to fail the whole step,
    every request in it) samples the best token, beside a stream that is not disturbed; a seed of
    2^63 - 1 with n = 2 (seeds seed + j wrap); a wrong type names the field, not the union member;
    a model looked up by id."""
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 30, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as stream:
        tiny = client.completions.create(model="tiny", prompt="w7 w8", max_tokens=6, top_p=1e-300,
                                         extra_body={"ignore_eos": True})
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    greedy = client.completions.create(model="tiny", prompt="w7 w8", max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert tiny.choices[0].text == greedy.choices[0].text
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    out = client.completions.create(model="tiny", prompt="w5", n=2, max_tokens=2, seed=2 ** 63 - 1)
    assert len(out.choices) == 2
    r = httpx.post(server.url + "/v1/completions", json={"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(server.url + "/v1/models/gpt-9").status_code == 404


def test_logit_bias_forces_a_token_in_both_endpoints(client):
    out = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=3, temperature=0, logit_bias={"7": 100},
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text.split() == ["w7"] * 3
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=2,
                                          temperature=1.0, logit_bias={"9": 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content.split() == ["w9"] * 2
    truncated = client.completions.create(model="tiny", prompt="w5 w6 w7 w8 w9", max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 2})
    assert truncated.usage.prompt_tokens == 2
    labels = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=4, temperature=1.0,
                                       extra_body={"ignore_eos": True, "allowed_token_ids": [11, 12]})
    assert set(labels.choices[0].text.split()) <= {"w11", "w12"} and len(labels.choices[0].text.split()) == 4


def test_vllm_output_fields_reach_the_detokenizer(client):
    """include_stop_str_in_output and skip_special_tokens, vLLM's extensions, are honoured."""
    def text(max_tokens=8, logit_bias=None, **extra):
        out = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=max_tokens, temperature=0,
                                        logit_bias=logit_bias, extra_body={"ignore_eos": True, **extra})
        return out.choices[0].text
    full = text()
    stop = full.split()[2]
    assert text(stop=[stop]) == full[:full.index(stop)]
    assert text(stop=[stop], include_stop_str_in_output=True) == full[:full.index(stop) + len(stop)]
    eos = {"logit_bias": {"1": 100}, "max_tokens": 2}  # w1, the tiny tokenizer's EOS (ignored here)
    assert text(**eos) == "" and text(skip_special_tokens=False, **eos).split() == ["w1", "w1"]


def test_a_chunked_body_over_the_limit_gets_413(server, client):
    """A body without a length header (chunked) is counted as it arrives: 413, not the 400 that
    FastAPI's body parsing made of the middleware's error."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"w5 " * 1000
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert_still_serving(client)


def test_the_body_limit_answers_once():
    """Over the limit in a chunked body: the middleware answers 413 and drops the app's own answer;
    an app that began answering before it read too much keeps its answer (no second start)."""
    from tokenmill.server.streaming import BodyLimitMiddleware

    async def run(answer_first: bool) -> list:
        sent, chunks = [], [{"type": "http.request", "body": b"x" * 60, "more_body": True}] * 3

        async def receive():
            return chunks.pop(0) if chunks else {"type": "http.disconnect"}

        async def send(message):
            sent.append((message["type"], message.get("status")))

        async def app(scope, receive, send):
            if answer_first:
                await send({"type": "http.response.start", "status": 200, "headers": []})
            while (await receive())["type"] == "http.request":
                pass
            if not answer_first:
                await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        await BodyLimitMiddleware(app, max_bytes=100)({"type": "http", "headers": []}, receive, send)
        return sent
    assert asyncio.run(run(False)) == [("http.response.start", 413), ("http.response.body", None)]
    assert asyncio.run(run(True)) == [("http.response.start", 200), ("http.response.body", None)]


def test_prompts_are_tokenized_off_the_event_loop(server, client, monkeypatch):
    """Tokenizing a body of a few MB takes seconds: done on the event loop, it stalled every open
    stream meanwhile. Completion and chat prompts are tokenized on worker threads."""
    threads = []

    def watched(fn):
        def call(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                threads.append("event loop")
            except RuntimeError:  # no loop runs on this thread
                threads.append("worker")
            return fn(*args, **kwargs)
        return call
    processor = server.engine.input_processor
    monkeypatch.setattr(processor, "tokenize_prompt", watched(processor.tokenize_prompt))
    monkeypatch.setattr(server.engine.tokenizer, "encode", watched(server.engine.tokenizer.encode))
    client.completions.create(model="tiny", prompt="w5 w6", max_tokens=2)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=2)
    assert threads and set(threads) == {"worker"}


def test_top_logprobs_of_tokens_with_the_same_text_keep_the_first():
    from tokenmill.server.logprobs import _by_text
    text = {5: "a", 7: "\ufffd", 9: "\ufffd"}.get
    assert _by_text({7: -1.5, 5: -0.5, 9: -3.0}, text) == {"\ufffd": -1.5, "a": -0.5}


def test_api_key_is_enforced(tiny_llama):
    with running_server(tiny_llama, api_key="s3cret") as s:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "w5"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # before the body is read: malformed JSON without a key is a 401, not a 400
        r = httpx.post(s.url + "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
        assert r.status_code == 401
        assert httpx.post(s.url + "/tokenize", json={"prompt": "w5"}).status_code == 401
        assert httpx.post(s.url + "/detokenize", json={"tokens": [5]}).status_code == 401
        assert httpx.get(s.url + "/v1/models/tiny").status_code == 401
        assert httpx.get(s.url + "/metrics").status_code == 200 and httpx.get(s.url + "/version").status_code == 200

        async def mounted() -> int:  # the app under a prefix: the check strips it
            transport = httpx.ASGITransport(app=s.app, root_path="/api")
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                return (await http.get("/api/v1/models")).status_code
        assert asyncio.run(mounted()) == 401
        ok = openai_client(s.url, "s3cret")
        assert_still_serving(ok)
        with pytest.raises(openai.AuthenticationError):
            openai_client(s.url, "nope").models.list()
        assert httpx.get(s.url + "/health").status_code == 200  # health needs no key


def test_the_api_key_also_guards_metrics_and_docs_when_asked(tiny_llama):
    key = {"authorization": "Bearer s3cret"}
    with running_server(tiny_llama, api_key="s3cret", protect_metrics_and_docs=True) as s:
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models"):
            r = httpx.get(s.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.get(s.url + path, headers=key).status_code == 200, path
        assert httpx.get(s.url + "/health").status_code == 200 and httpx.get(s.url + "/version").status_code == 200
        paths = httpx.get(s.url + "/openapi.json", headers=key).json()["paths"]
        assert "401" in paths["/metrics"]["get"]["responses"] and "401" in paths["/tokenize"]["post"]["responses"]
        assert "401" not in paths["/health"]["get"]["responses"]
    with pytest.raises(ValueError, match="needs an api_key"):
        create_app(None, "tiny", protect_metrics_and_docs=True)


def test_a_host_header_off_the_allow_list_gets_400_and_listed_names_pass_with_any_port(tiny_llama):
    """Against DNS rebinding: a page whose name now points at 127.0.0.1 still sends its own name."""
    with running_server(tiny_llama, allowed_hosts=["localhost", "127.0.0.1", "::1"]) as s:
        assert httpx.get(s.url + "/health").status_code == 200  # Host: 127.0.0.1:PORT
        for host in ("localhost", "LOCALHOST:1234", "[::1]:8000", "127.0.0.1:80"):
            assert httpx.get(s.url + "/health", headers={"host": host}).status_code == 200, host
        for host in ("attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example", "[::2]:80"):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 1}, headers={"host": host})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host


def test_the_openapi_schema_documents_the_statuses_and_content_types_the_server_sends(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    assert '"422"' not in json.dumps(schema)
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    operations = {(path, method): op["responses"]
                  for path, ops in schema["paths"].items() for method, op in ops.items()}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = operations[(path, "post")]
        assert {"400", "404", "413"} <= set(responses) and "401" not in responses  # no key: no 401
        assert responses["400"]["content"]["application/json"]["schema"] == error
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert set(operations[(path, "post")]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert {"500", "503"} <= set(operations[(path, "post")])
    assert set(operations[("/metrics", "get")]["200"]["content"]) == {"text/plain"}
    assert set(operations[("/v1/models/{model_id}", "get")]) == {"200", "404"}
    assert set(operations[("/health", "get")]) == {"200", "503"}
    assert set(schema["components"]["schemas"]["ErrorResponse"]["properties"]) == {"error"}


# ---- faults ----------------------------------------------------------------------------------

def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(server, client):
    runner = server.engine.runner
    original = runner.launch
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("injected fault")
        return original(sched)
    runner.launch = flaky
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 5})
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        lines = []
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={"prompt": "w6", "max_tokens": 5, "stream": True}) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data:")]
        assert "injected fault" in lines[0] and lines[1:] == ["data: [DONE]"]  # (as vLLM ends a failed stream)
    finally:
        runner.launch = original
    assert_still_serving(client)
    assert httpx.get(server.url + "/health").status_code == 200


def test_health_and_vllms_ping_report_a_dead_engine_loop(tiny_llama):
    with running_server(tiny_llama) as s:
        assert [httpx.get(s.url + "/ping").status_code, httpx.post(s.url + "/ping").status_code] == [200, 200]

        def broken():
            raise SystemError("scheduler exploded")
        s.engine.scheduler.schedule = broken
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 5}, timeout=10)
        assert r.status_code == 503 and "scheduler exploded" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 503
        assert [httpx.get(s.url + "/ping").status_code, httpx.post(s.url + "/ping").status_code] == [503, 503]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 5}, timeout=10)
        assert r.status_code == 503


def test_e2e_latency_metric_ends_at_the_engines_finish_time(server):
    """As the TTFT takes the engine's first-token time, the end-to-end latency takes its finish
    time from the request's timeline, not the moment the output is reported."""
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.timeline import Timeline
    metrics = server.app.state.metrics
    total = next(s.value for s in metrics.e2e.collect()[0].samples if s.name.endswith("_sum"))
    timeline = Timeline()
    timeline.add(100.0, "arrival", prompt_tokens=1)
    timeline.add(102.0, "finished", finish_reason="length")
    out = RequestOutput("x", None, [5], [CompletionOutput(0, "", [6], finish_reason="length")], finished=True,
                        timeline=timeline)
    metrics.on_finished(out)
    after = next(s.value for s in metrics.e2e.collect()[0].samples if s.name.endswith("_sum"))
    assert after - total == pytest.approx(2.0)


# ---- clients that stop reading -----------------------------------------------------------

def stalled_stream(url: str, path: str, body: dict) -> socket.socket:
    """A streamed request whose client sends it and then reads nothing: its small receive buffer
    makes the server's sends wait after a few kB, as behind a stuck reader."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    data = json.dumps({"model": "tiny", **body, "stream": True}).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    return sock


def read_events(sock: socket.socket) -> tuple[list[dict], bool]:
    """What the server sends on `sock` until it closes it: the SSE events' payloads (one per HTTP
    chunk), and whether [DONE] came."""
    sock.settimeout(60)
    data = b"".join(iter(lambda: sock.recv(1 << 16), b""))
    sock.close()
    return [json.loads(part[6:]) for part in data.split(b"\r\n") if part.startswith(b"data: {")], b"[DONE]" in data


def live_outputs() -> tuple[int, int]:
    """The RequestOutputs alive in this process (the server's, wherever they are held) and the
    bytes of their payload: a character of text or new text, 8 per token id, new token id and
    logprobs entry."""
    from tokenmill.outputs import RequestOutput
    outs = [o for o in gc.get_objects() if type(o) is RequestOutput]
    return len(outs), sum(len(o.new_text) + 8 * len(o.new_token_ids) + len(c.text)
                          + 8 * (len(c.token_ids) + len(c.logprobs or [])) for o in outs for c in o.outputs)


@pytest.fixture(scope="module")
def small_buffers(tiny_llama):
    """A server whose connections have 16 kB kernel send buffers: a client that stops reading
    makes its sends wait within a few dozen chunks (with the system's, only after MBs)."""
    with running_server(tiny_llama, send_buffer=8192) as s:
        yield s


def test_a_client_that_pauses_reading_gets_every_delta_merged_into_fewer_chunks(small_buffers):
    """A client that reads nothing for 1 s and then all: the outputs that piled up meanwhile come
    merged, in fewer chunks than tokens, and the text, logprobs, offsets, finish reasons and usage
    they add up to are those of the same request answered whole (n 2, 300 tokens, 3 logprobs)."""
    body = {"prompt": "w5 w6", "n": 2, "max_tokens": 300, "logprobs": 3, "temperature": 1.0, "seed": 11,
            "ignore_eos": True}
    sock = stalled_stream(small_buffers.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    time.sleep(1)
    events, done = read_events(sock)
    whole = httpx.post(small_buffers.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60).json()
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert done and len(chunks) < 600 and events[-1]["usage"] == whole["usage"]
    for i, want in enumerate(whole["choices"]):
        mine = [c for c in chunks if c["index"] == i]
        assert "".join(c["text"] for c in mine) == want["text"]
        assert [c["finish_reason"] for c in mine][-2:] == [None, "length"]
        for key in ("tokens", "text_offset"):
            assert [v for c in mine if c["logprobs"] for v in c["logprobs"][key]] == want["logprobs"][key]
        got = [v for c in mine if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        assert got == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)


def test_a_chat_client_that_pauses_reading_gets_the_same_content_and_logprobs(small_buffers):
    """The same for a chat stream (n 1: no merged stream, the engine's slot alone): content and
    logprobs after a 1 s pause add up to the whole answer's."""
    body = {"messages": [{"role": "user", "content": "w9 w10"}], "max_tokens": 300, "logprobs": True,
            "top_logprobs": 2, "temperature": 0, "ignore_eos": True}
    sock = stalled_stream(small_buffers.url, "/v1/chat/completions", body)
    time.sleep(1)
    events, done = read_events(sock)
    whole = httpx.post(small_buffers.url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=60).json()
    chunks = [e["choices"][0] for e in events]
    want = whole["choices"][0]
    assert done and len(chunks) < 300 and chunks[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["delta"].get("content", "") for c in chunks) == want["message"]["content"]
    got = [entry["token"] for c in chunks if c["logprobs"] for entry in c["logprobs"]["content"]]
    assert got == [entry["token"] for entry in want["logprobs"]["content"]] and len(got) == 300
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["delta"] == {}


def test_clients_that_stop_reading_hold_one_output_per_request_and_are_aborted_after_the_write_timeout(tiny_llama):
    """Two clients send streams (completions with n 8, and chat; 900 tokens, 5 logprobs) and read
    nothing. While their requests run, the server holds a few outputs per request (the one merged
    for it, the engine's last, the one a send waits with, a step's on their way to the event loop),
    not one per step; after the write timeout (0.5 s) their requests are aborted, every KV block is free and
    the connections are closed without [DONE]; meanwhile another client is served in full."""
    aborted = 'tokenmill_requests_finished_total{finish_reason="abort"}'
    with running_server(tiny_llama, send_buffer=8192, stream_write_timeout=0.5) as s:
        stalled = [stalled_stream(s.url, "/v1/completions", {"prompt": "w5 w6", "n": 8, "max_tokens": 900,
                                                              "logprobs": 5, "ignore_eos": True}),
                   stalled_stream(s.url, "/v1/chat/completions", {
                       "messages": [{"role": "user", "content": "w7"}], "max_tokens": 900, "logprobs": True,
                       "top_logprobs": 5, "ignore_eos": True})]
        most, most_bytes = live_outputs()
        client = openai_client(s.url)
        served = list(client.completions.create(model="tiny", prompt="w8", max_tokens=50, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        deadline = time.monotonic() + 60
        while s.engine.has_unfinished_requests() or metric(s.url, "tokenmill_kv_blocks_used"):
            assert time.monotonic() < deadline, "the stalled requests still run"
            count, size = live_outputs()
            most, most_bytes = max(most, count), max(most_bytes, size)
            time.sleep(0.05)
        assert metric(s.url, aborted) == 9, httpx.get(s.url + "/metrics").text
        received = [read_events(sock) for sock in stalled]
    assert served[-2].choices[0].finish_reason == "length" and served[-1].usage.completion_tokens == 50
    # 9 stalled requests and the served one; a whole output of 900 tokens: about 5 characters of
    # text and 3 entries of 8 bytes per token (one step queued per output: thousands)
    assert most <= 4 * 10 and most_bytes <= 4 * 10 * 900 * (5 + 3 * 8), (most, most_bytes)
    for events, done in received:
        assert not done and 0 < len(events) < 900


def test_a_response_id_gives_its_requests_timelines_until_the_ring_drops_it(tiny_llama):
    """GET /v1/requests/{id}: the timelines of the response's engine requests (one per choice),
    in their events' order, after it ended; the ring keeps the last two (live ones: test_request_log)."""
    with running_server(tiny_llama, request_log_size=2) as s:
        body = {"prompt": "w1 w2 w3", "max_tokens": 6, "n": 2, "ignore_eos": True, "temperature": 1.0}
        done = httpx.post(s.url + "/v1/completions", json=body, timeout=30).json()
        t = httpx.get(s.url + f"/v1/requests/{done['id']}", timeout=10).json()
        assert t["id"] == done["id"] and [r["request_id"] for r in t["requests"]] == [
            done["id"] + "-0-0", done["id"] + "-0-1"]
        for r in t["requests"]:
            kinds = [e["event"] for e in r["events"]]
            assert kinds[:3] == ["arrival", "tokenized", "admitted"] and kinds[-2:] == ["first_token", "finished"]
            assert r["events"][-1]["finish_reason"] == "length" and len(r["token_times"]) == 6
            assert 0 < r["latency"]["ttft"] <= r["latency"]["e2e"]
        for _ in range(2):  # two more ended responses push the first out of the ring of two
            httpx.post(s.url + "/v1/completions", json={**body, "n": 1}, timeout=30)
        gone = httpx.get(s.url + f"/v1/requests/{done['id']}", timeout=10)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "request_not_found"


class OTLPCollector:
    """An OTLP/HTTP trace collector on 127.0.0.1 that keeps the spans it is sent."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        spans = self.spans = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                export = ExportTraceServiceRequest.FromString(body)
                spans.extend(s for rs in export.resource_spans for ss in rs.scope_spans for s in ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_each_request_is_an_otlp_span_with_its_events_under_the_callers_trace(tiny_llama):
    """--otlp-traces-endpoint: one span per engine request, sent over OTLP/HTTP to a collector;
    a traceparent header makes it the caller's child; its timeline's events are span events."""
    from tokenmill.server.otel import RequestSpans, otlp_exporter
    collector = OTLPCollector()
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    try:
        with running_server(tiny_llama, spans=RequestSpans(otlp_exporter(collector.url))) as s:
            body = {"prompt": "w1 w2", "max_tokens": 4, "n": 2, "ignore_eos": True, "temperature": 1.0}
            done = httpx.post(s.url + "/v1/completions", json=body, timeout=30,
                              headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}).json()
            httpx.post(s.url + "/v1/completions", json={**body, "n": 1}, timeout=30)  # no traceparent
            s.app.state.spans.provider.force_flush()
    finally:
        collector.server.shutdown()
    spans = {next(a.value.string_value for a in sp.attributes if a.key == "gen_ai.request.id"): sp
             for sp in collector.spans}
    assert len(spans) == 3
    for j in range(2):
        sp = spans[f"{done['id']}-0-{j}"]
        assert sp.name == "llm_request" and sp.trace_id.hex() == trace_id and sp.parent_span_id.hex() == parent_id
        assert [e.name for e in sp.events][:2] == ["tokenized", "admitted"]
        assert [e.name for e in sp.events][-2:] == ["first_token", "finished"]
        attrs = {a.key: a.value for a in sp.attributes}
        assert attrs["gen_ai.usage.completion_tokens"].int_value == 4
        assert 0 < attrs["gen_ai.latency.time_to_first_token"].double_value <= attrs["gen_ai.latency.e2e"].double_value
        assert sp.start_time_unix_nano < sp.events[0].time_unix_nano <= sp.end_time_unix_nano
    other = next(sp for rid, sp in spans.items() if not rid.startswith(done["id"]))
    assert other.trace_id.hex() != trace_id and not other.parent_span_id  # a root span of its own
