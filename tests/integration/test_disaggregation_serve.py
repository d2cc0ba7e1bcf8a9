"""Disaggregated serving with real processes on 127.0.0.1: a `--kv-role prefill` server, a
`--kv-role decode` server, and `tokenmill router --prefill` in front; each test once with the
K/V handed over as files in one storage directory, once read over NIXL (when nixl-cu12 imports).
Bounded: a handful of short completions on the tiny llama."""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import time

import httpx
import pytest
from test_router import healthy_replicas, logged, serve, stop, wait_for
from test_server import free_port

from tokenmill import LLM, SamplingParams


def counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}/metrics")


NIXL = pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None,
                          reason="the NIXL connector needs nixl-cu12 (pip install nixl-cu12)")


@pytest.fixture(scope="module", params=["shared_storage", pytest.param("nixl", marks=NIXL)])
def pd(request, tiny_llama, tmp_path_factory):
    """(router URL, prefill URL, decode URL, processes), for each connector."""
    logs, storage = tmp_path_factory.mktemp("pd"), tmp_path_factory.mktemp("kv")
    ports = [free_port(), free_port(), free_port()]
    shared = (("--kv-storage-path", str(storage)) if request.param == "shared_storage"
              else ("--kv-connector", "nixl"))
    procs = [serve(tiny_llama, ports[0], logs / "prefill.log", "--kv-role", "prefill", *shared),
             serve(tiny_llama, ports[1], logs / "decode.log", "--kv-role", "decode", *shared)]
    procs.append(logged(["router", "--prefill", f"http://127.0.0.1:{ports[0]}",
                         "--replica", f"http://127.0.0.1:{ports[1]}", "--port", str(ports[2]),
                         "--min-uncached-chars", "200"], logs / "router.log"))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        wait_for(lambda: healthy_replicas(urls[2]) == set(urls[:2]), procs, "healthy prefill and decode instances")
        yield urls[2], urls[0], urls[1], procs
    finally:
        stop(procs)


def prompt(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(5, 380)}" for _ in range(n))


def expected(tiny_llama, prompts: list[str], max_tokens: int) -> list[str]:
    llm = LLM(str(tiny_llama), num_kv_blocks=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [out.outputs[0].text for out in outs]


def complete(url: str, text: str, **options) -> httpx.Response:
    body = {"model": "tiny", "prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **options}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_a_long_prompt_is_computed_on_the_prefill_instance_and_answered_as_one_server_would(pd, tiny_llama):
    router, prefill_url, decode_url, _ = pd
    prompts = [prompt(1, 120), prompt(2, 150)]
    before = counter(decode_url, "tokenmill_kv_transfer_tokens_received_total")
    answers = [complete(router, p) for p in prompts]
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.json()["choices"][0]["text"] for a in answers] == expected(tiny_llama, prompts, 8)
    assert counter(decode_url, "tokenmill_kv_transfer_tokens_received_total") > before
    assert counter(router, 'tokenmill_router_prefill_legs_total{outcome="transferred"}') >= 2
    assert "kv_transfer_params" not in answers[0].json()  # the decode leg's answer reports none
    length, cached = (answers[1].json()["usage"][k] for k in ("prompt_tokens", "prompt_tokens_details"))
    assert length - 16 < cached["cached_tokens"] < length  # brought in by the connector, as vLLM counts them


def test_a_streamed_answer_through_the_prefill_leg_equals_the_whole_one(pd, tiny_llama):
    router, _, _, _ = pd
    text = prompt(3, 130)
    body = {"model": "tiny", "prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    pieces = []
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(pieces) == expected(tiny_llama, [text], 8)[0]


def test_a_short_prompt_skips_the_prefill_leg(pd):
    router, _, _, _ = pd
    before = counter(router, 'tokenmill_router_prefill_legs_total{outcome="local"}')
    assert complete(router, "w5 w6 w7").status_code == 200
    assert counter(router, 'tokenmill_router_prefill_legs_total{outcome="local"}') == before + 1


def test_a_prompt_that_is_scored_skips_the_prefill_leg(pd):
    """Its logprobs need every prompt position computed where it is answered: a prefill leg would
    compute the prompt twice."""
    router, _, _, _ = pd
    before = counter(router, 'tokenmill_router_prefill_legs_total{outcome="local"}')
    for options in ({"prompt_logprobs": 0}, {"echo": True, "logprobs": 0}):
        answer = complete(router, prompt(5, 130), **options)
        assert answer.status_code == 200, answer.text
    assert counter(router, 'tokenmill_router_prefill_legs_total{outcome="local"}') == before + 2


def test_a_frozen_prefill_instance_leaves_the_decode_instance_to_compute_the_prompt_within_seconds(pd, tiny_llama):
    """SIGSTOP on the prefill instance, then a long prompt: its prefill leg hangs until the health
    poller (5 s timeout) takes the instance out of routing, then the decode instance computes the
    prompt: the answer in seconds (not the leg's 300 s bound), and equal to one server's."""
    router, prefill_url, _, procs = pd
    before = counter(router, 'tokenmill_router_prefill_legs_total{outcome="failed"}')
    procs[0].send_signal(signal.SIGSTOP)
    try:
        text, start = prompt(6, 140), time.monotonic()
        answer = complete(router, text)
        assert time.monotonic() - start < 30
    finally:
        procs[0].send_signal(signal.SIGCONT)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected(tiny_llama, [text], 8)[0]
    assert counter(router, 'tokenmill_router_prefill_legs_total{outcome="failed"}') == before + 1
    wait_for(lambda: prefill_url in healthy_replicas(router), procs, "the resumed prefill instance back in routing")


def test_a_dead_prefill_instance_leaves_the_decode_instance_to_compute_the_prompt(pd, tiny_llama):
    router, _, _, procs = pd
    procs[0].kill()
    procs[0].wait(30)
    text = prompt(4, 140)
    answer = complete(router, text)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected(tiny_llama, [text], 8)[0]
    assert counter(router, 'tokenmill_router_prefill_legs_total{outcome="failed"}') >= 1
