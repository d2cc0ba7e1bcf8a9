"""POST /v1/embeddings over real HTTP on 127.0.0.1 with a tiny model and the official openai
client: float and base64 vectors, every input form, usage, and the 400s (dimensions the model
cannot give, empty input, input past the context)."""

from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from test_server import metric, openai_client, running_server

WIDTH = 96  # the tiny model's hidden size


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, engine_options={"max_model_len": 128}) as s:
        yield s


@pytest.fixture
def client(server):
    return openai_client(server.url)


def test_float_base64_and_the_sdks_default_give_the_same_vectors(client):
    texts = ["w5 w6 w7", "w8", "w9 w5 w6 w7 w8"]
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    encoded = client.embeddings.create(model="tiny", input=texts, encoding_format="base64")
    default = client.embeddings.create(model="tiny", input=texts)  # the SDK asks for base64 and decodes it
    assert floats.object == "list" and floats.model == "tiny"
    assert [d.index for d in floats.data] == [0, 1, 2] and all(d.object == "embedding" for d in floats.data)
    vectors = np.array([d.embedding for d in floats.data], dtype=np.float32)
    assert vectors.shape == (3, WIDTH)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-6)
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in encoded.data])
    assert np.array_equal(decoded, vectors)
    assert np.array_equal(np.array([d.embedding for d in default.data], dtype=np.float32), vectors)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == 3 + 1 + 5


def test_token_ids_and_lists_of_them_give_the_vectors_of_their_text(client, server):
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in ("w5 w6 w7", "w8")]
    by_text = client.embeddings.create(model="tiny", input=["w5 w6 w7", "w8"], encoding_format="float")
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    one = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float", user="someone")
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in by_text.data]
    assert one.data[0].embedding == by_text.data[0].embedding and len(one.data) == 1


def test_mean_pooling_is_asked_for_by_name_and_differs_from_the_last_token(client):
    last = client.embeddings.create(model="tiny", input="w5 w6 w7", encoding_format="float")
    mean = client.embeddings.create(model="tiny", input="w5 w6 w7", encoding_format="float",
                                    extra_body={"pooling": "mean"})
    assert len(mean.data[0].embedding) == WIDTH and mean.data[0].embedding != last.data[0].embedding


def test_dimensions_other_than_the_models_width_is_a_400_saying_this_model_does_not_shorten(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny", input="w5", dimensions=32)
    error = err.value.response.json()["error"]
    assert error["param"] == "dimensions" and "does not support" in error["message"]
    assert len(client.embeddings.create(model="tiny", input="w5", dimensions=WIDTH).data[0].embedding) == WIDTH


@pytest.mark.parametrize("value", ["", [], [""], [[]], ["w5", ""], [[5], []]])
def test_empty_input_is_a_400_naming_input(server, value):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "tiny", "input": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_an_input_filling_the_context_is_embedded_and_one_past_it_is_a_400(client, server):
    assert len(client.embeddings.create(model="tiny", input=[5] * 128).data[0].embedding) == WIDTH
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "tiny", "input": [[5], [5] * 129]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "input" and "context length is 128" in error["message"]


def test_truncate_prompt_tokens_embeds_an_inputs_first_tokens(client, server):
    def vectors(inputs, truncate=None) -> tuple[torch.Tensor, int]:
        out = client.embeddings.create(model="tiny", input=inputs, encoding_format="float",
                                       extra_body={} if truncate is None else {"truncate_prompt_tokens": truncate})
        return torch.tensor([d.embedding for d in out.data]), out.usage.prompt_tokens

    def same(got: tuple[torch.Tensor, int], expected: tuple[torch.Tensor, int]) -> bool:
        """Equal counts and vectors; the vectors to float32 rounding, as a prompt's hidden states
        depend on what else its step carried (the two inputs may arrive a step apart)."""
        return got[1] == expected[1] and torch.allclose(got[0], expected[0], rtol=1e-4, atol=1e-6)
    assert same(vectors(["w5 w6 w7 w8", "w9"], 2), (vectors(["w5 w6", "w9"])[0], 3))
    assert same(vectors([[5, 6, 7, 8], [9]], 2), (vectors([[5, 6], [9]])[0], 3))
    assert same(vectors([[5] * 200, [6] * 3], -1), (vectors([[5] * 128, [6] * 3])[0], 131))  # the context: 128
    for truncate in (0, -2, 129):
        r = httpx.post(server.url + "/v1/embeddings", json={"model": "tiny", "input": "w5",
                                                             "truncate_prompt_tokens": truncate})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


@pytest.mark.parametrize("body, param", [
    ({"input": [384]}, "input"),                            # a token id past the vocabulary
    ({"input": "w5", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "w5", "pooling": "max"}, "pooling"),
])
def test_other_bad_fields_are_400s_naming_them_and_the_server_goes_on(client, server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "tiny", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert len(client.embeddings.create(model="tiny", input="w5").data) == 1


def test_embedded_prompt_tokens_and_queue_times_are_counted_in_the_metrics(client, server):
    before = metric(server.url, "tokenmill_prompt_tokens_total")
    queued = metric(server.url, "tokenmill_request_queue_time_seconds_count")
    usage = client.embeddings.create(model="tiny", input=["w5 w6", "w7 w8 w9"]).usage
    assert usage.prompt_tokens == 5
    deadline = time.monotonic() + 5  # (counted on the engine thread, just after the answer went out)
    while (counted := metric(server.url, "tokenmill_prompt_tokens_total") - before) != 5:
        assert time.monotonic() < deadline, counted
        time.sleep(0.05)
    assert metric(server.url, "tokenmill_request_queue_time_seconds_count") - queued == 2
