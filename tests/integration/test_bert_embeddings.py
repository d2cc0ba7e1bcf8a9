"""Embeddings from a BERT sentence-transformers directory (tiny, random weights, built here with
all-MiniLM-L6-v2's layout: BertModel weights with their unused pooler, a WordPiece tokenizer,
modules.json, 1_Pooling/config.json, 2_Normalize) against sentence-transformers itself on the same
directory: each pooling mode, a ragged batch against each input alone, prompts that wait for a
step with room for all of them, the 400s of an encoder, and the real server on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_server import openai_client, running_server

from tokenmill import LLM, SamplingParams
from tokenmill.pooling_params import PoolingParams

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "##s", "##ing"] + [f"w{i}" for i in range(40)]
WIDTH, POSITIONS = 32, 64
TOL = 1e-5  # float32 through different kernels
TEXTS = ["the cat sat on the mat", "a dog", "w1 w2 w3 cats running", "the", "dogs ran on w7 w8 w9 w10 the mat"]


def save_wordpiece_tokenizer(path: Path) -> None:
    """BERT's tokenizer over a small vocabulary: lower-cased words split into word pieces, each text
    wrapped as [CLS] ... [SEP]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tok.decoder = decoders.WordPiece()
    BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                      cls_token="[CLS]", mask_token="[MASK]").save_pretrained(str(path))


def build_tiny_bert(path: Path, pooling: str = "mean", normalize: bool = True, hidden_act: str = "gelu") -> Path:
    """A random tiny BertModel saved as a sentence-transformers directory pooling by `pooling`
    (cls, mean, lasttoken, in 1_Pooling's older boolean keys, as all-MiniLM-L6-v2 has them) and
    normalising if `normalize`."""
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=len(SPECIALS + WORDS), hidden_size=WIDTH, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=POSITIONS,
                        hidden_act=hidden_act, initializer_range=0.2)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(str(path), safe_serialization=True)  # (with BertModel's pooler, unused)
    save_wordpiece_tokenizer(path)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling")] + ([("2_Normalize", "Normalize")] if normalize else [])
    (path / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": where, "type": f"sentence_transformers.models.{kind}"}
        for i, (where, kind) in enumerate(modules)]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": WIDTH, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": pooling == "lasttoken"}))
    if normalize:
        (path / "2_Normalize").mkdir()
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": POSITIONS, "do_lower_case": False}))
    return path


def sentence_transformers_vectors(path: Path, texts: list[str], max_seq_length: int | None = None) -> np.ndarray:
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(path), device="cpu")
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length
    return model.encode(texts, convert_to_numpy=True)


def rel_err(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> Path:
    """Mean pooling, normalised: all-MiniLM-L6-v2's modules."""
    return build_tiny_bert(tmp_path_factory.mktemp("bert") / "minilm")


@pytest.mark.parametrize("pooling, normalize, hidden_act", [("mean", True, "gelu"), ("cls", False, "gelu_new"),
                                                            ("lasttoken", True, "gelu")])
def test_vectors_equal_sentence_transformers_on_the_same_directory(tmp_path, pooling, normalize, hidden_act):
    path = build_tiny_bert(tmp_path / "st", pooling, normalize, hidden_act)
    llm = LLM(str(path), num_kv_blocks=64)
    ours = llm.embed(TEXTS, use_tqdm=False)
    theirs = sentence_transformers_vectors(path, TEXTS)
    assert np.asarray(ours).shape == theirs.shape == (len(TEXTS), WIDTH)
    for text, a, b in zip(TEXTS, ours, theirs):
        assert rel_err(a, b) < TOL, text
    norms = np.linalg.norm(np.asarray(ours), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-6) if normalize else not np.allclose(norms, 1.0, atol=1e-3)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_batch_equals_each_input_alone_and_each_prompt_runs_whole_in_one_step(minilm, ahead):
    """A 24-token budget: prompts of up to 24 tokens, each granted whole or left waiting for a step
    with room for it, never cut into chunks; no row attends to another prompt's rows. With async
    scheduling too (ahead)."""
    rng = random.Random(3)
    prompts = [[2] + [rng.randrange(5, 5 + len(WORDS)) for _ in range(n)] + [3] for n in (22, 1, 9, 15, 4, 17, 0, 12)]
    llm = LLM(str(minilm), max_num_batched_tokens=24, num_kv_blocks=64, block_size=4, async_scheduling=ahead)
    assert llm.engine.max_model_len == 24  # held to a step's budget
    make = llm.engine.input_processor.make_embedding_request
    requests = [make(f"r{i}", {"prompt_token_ids": p}) for i, p in enumerate(prompts)]
    for r in requests:
        llm.engine.add(r)
    outs, steps = {}, 0
    while llm.engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.engine.step() if o.finished)
        steps += 1
    assert steps >= sum(map(len, prompts)) / 24 and llm.engine.scheduler.stats().kv_blocks_used == 0
    for i, prompt in enumerate(prompts):
        chunks = [e for e in outs[f"r{i}"].timeline.events if e.kind == "chunk"]
        assert [e.data["tokens"] for e in chunks] == ([len(prompt)] if len(prompt) > 1 else []), i
        alone = llm.embed([{"prompt_token_ids": prompt}], use_tqdm=False)[0]
        assert rel_err(outs[f"r{i}"].embedding, alone) < TOL, i


def test_a_truncated_text_is_embedded_as_sentence_transformers_embeds_it_at_that_length(minilm):
    """Its first tokens, [CLS] and [SEP] kept around them: sentence-transformers' max_seq_length."""
    llm = LLM(str(minilm), num_kv_blocks=64)
    ours = llm.embed(TEXTS, PoolingParams("mean", truncate_prompt_tokens=5), use_tqdm=False)
    theirs = sentence_transformers_vectors(minilm, TEXTS, max_seq_length=5)
    for text, a, b in zip(TEXTS, ours, theirs):
        assert rel_err(a, b) < TOL, text
    whole = sentence_transformers_vectors(minilm, TEXTS)
    assert rel_err(ours[0], whole[0]) > 1e-2 and rel_err(ours[1], whole[1]) < TOL  # "a dog": 4 tokens, whole
    # a dict prompt truncates alike (one text alone on both sides: CUDA's products differ by the batch's rows)
    truncated = PoolingParams("mean", truncate_prompt_tokens=5)
    as_dict = llm.embed([{"prompt": TEXTS[0]}], truncated, use_tqdm=False)
    assert as_dict == llm.embed(TEXTS[:1], truncated, use_tqdm=False)
    # fewer than its two special tokens: the tokenizer would cut nothing; the first token alone, [CLS]
    one = llm.embed(TEXTS[:1], PoolingParams("mean", truncate_prompt_tokens=1), use_tqdm=False)[0]
    assert one == llm.embed([{"prompt_token_ids": [2]}], PoolingParams("mean"), use_tqdm=False)[0]
    # the tokenizer's own truncation, state its threads share, was never set: a prompt another
    # server thread encodes meanwhile is not cut to 5 tokens
    assert llm.engine.input_processor.tokenizer.backend_tokenizer.truncation is None


def test_the_requests_pooling_overrides_the_checkpoints(minilm):
    from sentence_transformers import SentenceTransformer
    llm = LLM(str(minilm), num_kv_blocks=64)
    tokens = SentenceTransformer(str(minilm), device="cpu").encode(TEXTS[:2], output_value="token_embeddings")
    cls = llm.embed(TEXTS[:2], PoolingParams("cls", normalize=False), use_tqdm=False)
    last = llm.embed(TEXTS[:2], PoolingParams("last"), use_tqdm=False)
    for t, c, v in zip(tokens, cls, last):
        t = t.numpy()
        assert rel_err(c, t[0]) < TOL and rel_err(v, t[-1] / np.linalg.norm(t[-1])) < TOL


def test_an_encoder_keeps_no_kv_generates_nothing_and_refuses_a_prompt_past_its_positions_by_name(minilm):
    llm = LLM(str(minilm), max_num_seqs=8)
    assert llm.engine.runner.worker.kv_cache.numel() == 0 and llm.engine.runner.worker.kv_caches == []
    assert llm.engine.scheduler.kv.pool.num_blocks == 8 * POSITIONS // 16  # every seat's full prompt, counted
    with pytest.raises(ValueError, match="encoder \\(bert\\): it serves embeddings only"):
        llm.generate(["the cat"], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="serves embeddings only"):
        llm.chat([{"role": "user", "content": "the cat"}], use_tqdm=False)
    assert len(llm.embed([{"prompt_token_ids": [5] * POSITIONS}], use_tqdm=False)[0]) == WIDTH
    too_long = f"has {POSITIONS + 1} tokens, more than the model's context length \\({POSITIONS}\\)$"
    with pytest.raises(ValueError, match=too_long):
        llm.embed([{"prompt_token_ids": [5] * (POSITIONS + 1)}], use_tqdm=False)


def test_options_that_hand_over_or_shard_kv_are_refused_for_an_encoder_by_name(minilm, tmp_path):
    with pytest.raises(ValueError, match="kv_role: an encoder \\(bert\\) keeps no K/V to hand over"):
        LLM(str(minilm), kv_role="prefill", kv_storage_path=str(tmp_path))
    with pytest.raises(ValueError, match="tensor_parallel_size 2: bert is an encoder, which runs on one rank"):
        LLM(str(minilm), tensor_parallel_size=2)


@pytest.fixture(scope="module")
def server(minilm):
    with running_server(minilm, engine_options={"max_num_batched_tokens": 128}) as s:
        yield s


def test_the_server_serves_float_and_base64_vectors_equal_to_sentence_transformers(server, minilm):
    client = openai_client(server.url)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    encoded = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="base64")
    vectors = np.array([d.embedding for d in floats.data], dtype=np.float32)
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in encoded.data])
    assert np.array_equal(decoded, vectors) and vectors.shape == (len(TEXTS), WIDTH)
    assert rel_err(vectors, sentence_transformers_vectors(minilm, TEXTS)) < TOL
    assert len(client.embeddings.create(model="tiny", input="a dog", dimensions=WIDTH).data[0].embedding) == WIDTH
    cls = client.embeddings.create(model="tiny", input="a dog", encoding_format="float",
                                   extra_body={"pooling": "cls", "normalize": False})
    assert rel_err(cls.data[0].embedding, vectors[1]) > 0.01  # the request's pooling, not the checkpoint's


@pytest.mark.parametrize("endpoint, body", [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}]}),
    ("/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 4}),
    ("/v1/responses", {"model": "tiny", "input": "the cat"}),
])
def test_a_generating_request_to_the_encoder_is_a_400_saying_it_serves_embeddings_only(server, endpoint, body):
    r = httpx.post(server.url + endpoint, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "model" and error["type"] == "invalid_request_error"
    assert error["message"] == ("tiny is an embedding model (a bert encoder): it serves POST /v1/embeddings only, "
                                "not text generation")
    assert httpx.get(server.url + "/health").status_code == 200


def test_an_input_past_the_positions_is_a_400_naming_the_limit(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "tiny", "input": [[5] * POSITIONS, [5] * 65]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "input"
    assert error["message"] == (f"This model's maximum context length is {POSITIONS} tokens. However, your input "
                                f"resulted in {POSITIONS + 1} tokens. Please reduce the length of the input.")


@pytest.mark.parametrize("command", [["generate", "the cat"], ["chat"]])
def test_the_cli_says_an_encoder_serves_embeddings_only_before_any_prompt(minilm, capsys, command):
    from tokenmill.cli import main
    assert main([command[0], "--model", str(minilm), *command[1:]]) == 1
    assert capsys.readouterr().err.strip() == ("tokenmill: this model is an encoder (bert): it serves embeddings only "
                                               "(LLM.embed, POST /v1/embeddings), not text generation")
