"""models/bert.py without a checkpoint: attention over each prompt's own rows against the softmax
written out, the sentence-transformers pooling read from both forms of 1_Pooling/config.json,
checkpoint names, and the variants refused by name."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from tokenmill.models.bert import (
    bert_model_config,
    bidirectional_attention,
    group_prompts,
    our_name,
    st_pooling_mode,
)

CPU = torch.device("cpu")
BERT = {"model_type": "bert", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 64, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
        "type_vocab_size": 2}


@pytest.mark.parametrize("lengths", [[4, 1, 4], [3], [1] * 6 + [12, 2], [3, 5, 4, 2]])  # the last: one padded group
def test_each_prompts_rows_attend_to_all_of_that_prompt_and_nothing_else(lengths):
    torch.manual_seed(0)
    spans = [0, *itertools.accumulate(lengths)]
    qkv = torch.randn(spans[-1], 3, 2, 4)
    q, k, v = qkv.unbind(1)
    out = bidirectional_attention(qkv, group_prompts(spans, CPU, torch.float32))
    assert out.shape == (spans[-1], 8)
    for start, end in zip(spans[:-1], spans[1:]):
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) / 2.0  # (H, n, n), 1/sqrt(4)
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[start:end]).reshape(end - start, 8)
        torch.testing.assert_close(out[start:end], expected)
    first = spans[1]
    changed = qkv.clone()
    changed[first:, 1:] = 100.0  # the other prompts' keys and values change: the first prompt's rows do not
    again = bidirectional_attention(changed, group_prompts(spans, CPU, torch.float32))
    torch.testing.assert_close(again[:first], out[:first], rtol=0, atol=0)


def test_prompts_are_grouped_by_length_within_one_and_a_half_slots_per_token():
    """Sorted by length; a group closes before a prompt that would pad it past 1.5 slots per token:
    two 1-token prompts and a 2-token one pad to 2 (6 slots, 4 tokens); the next 1-token prompts and
    the 12-token one each start a group; padding keys get a bias of -inf."""
    groups = group_prompts([0, 1, 2, 3, 15, 17], CPU, torch.float32)  # lengths 1, 1, 1, 12, 2
    assert [g.rows.tolist() for g in groups] == [[[0], [1], [2]], [[15, 16]], [list(range(3, 15))]]
    assert [g.bias is None for g in groups] == [True, True, True]
    groups = group_prompts([0, 1, 2, 4, 16], CPU, torch.float32)      # lengths 1, 1, 2, 12
    assert [g.rows.tolist() for g in groups] == [[[0, 0], [1, 1], [2, 3]], [list(range(4, 16))]]
    assert groups[0].slots.tolist() == [0, 2, 4, 5] and groups[0].targets.tolist() == [0, 1, 2, 3]
    assert groups[0].bias[:, 0, 0].tolist() == [[0.0, float("-inf")], [0.0, float("-inf")], [0.0, 0.0]]


@pytest.mark.parametrize("config, mode", [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"word_embedding_dimension": 32}, "mean"),  # no mode set: sentence-transformers' default
    ({"pooling_mode": "lasttoken", "include_prompt": True}, "last"),
    ({"pooling_mode": ["cls"]}, "cls"),
])
def test_the_pooling_mode_is_read_from_either_form_of_the_pooling_config(config, mode):
    assert st_pooling_mode(config) == mode


@pytest.mark.parametrize("config", [{"pooling_mode": "max"}, {"pooling_mode_weightedmean_tokens": True},
                                    {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}])
def test_a_pooling_tokenmill_does_not_run_is_refused_by_name(config):
    with pytest.raises(ValueError, match="unsupported sentence-transformers pooling .* one of cls, mean, lasttoken"):
        st_pooling_mode(config)


def write_st_dir(path: Path, modules: list[str], pooling: dict | None = None) -> Path:
    path.mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": "" if kind == "Transformer" else f"{i}_{kind}",
         "type": f"sentence_transformers.models.{kind}"} for i, kind in enumerate(modules)]))
    if "Pooling" in modules:
        (path / f"{modules.index('Pooling')}_Pooling").mkdir()
        (path / f"{modules.index('Pooling')}_Pooling" / "config.json").write_text(json.dumps(pooling or {}))
    return path


def test_the_config_reads_the_encoder_and_its_pooling_from_the_sentence_transformers_modules(tmp_path):
    plain = bert_model_config(tmp_path, {**BERT, "hidden_act": "gelu_new"})
    assert (plain.architecture, plain.num_heads, plain.num_kv_heads, plain.head_dim) == ("bert", 4, 4, 8)
    enc = plain.encoder
    assert (enc.pooling, enc.normalize, enc.gelu_approximate, enc.layer_norm_eps) == ("cls", True, "tanh", 1e-12)
    st = write_st_dir(tmp_path / "st", ["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True})
    assert (bert_model_config(st, BERT).encoder.pooling, bert_model_config(st, BERT).encoder.normalize) == (
        "mean", False)
    normalized = write_st_dir(tmp_path / "n", ["Transformer", "Pooling", "Normalize"], {"pooling_mode": "cls"})
    assert bert_model_config(normalized, BERT).encoder.normalize is True


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "relu"}, "unsupported hidden_act 'relu' for bert"),
    ({"position_embedding_type": "relative_key"}, "unsupported position_embedding_type 'relative_key'"),
    ({"is_decoder": True}, "is_decoder"),
    ({"hidden_size": 30}, "not a multiple of num_attention_heads"),
])
def test_a_bert_variant_the_encoder_does_not_run_is_refused_by_name(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        bert_model_config(tmp_path, {**BERT, **change})


def test_modules_past_pooling_and_normalize_are_refused_by_name(tmp_path):
    dense = write_st_dir(tmp_path / "d", ["Transformer", "Pooling", "Dense", "Normalize"], {"pooling_mode": "mean"})
    with pytest.raises(ValueError, match="unsupported sentence-transformers modules \\['Dense'\\]"):
        bert_model_config(dense, BERT)
    with pytest.raises(ValueError, match="lists no Pooling module"):
        bert_model_config(write_st_dir(tmp_path / "p", ["Transformer"]), BERT)


@pytest.mark.parametrize("name, ours", [
    ("encoder.layer.1.attention.self.key.bias", ("layers.1.qkv_proj.bias", 1)),
    ("bert.encoder.layer.0.attention.output.LayerNorm.gamma", ("layers.0.attention_norm.weight", None)),
    ("encoder.layer.0.output.dense.weight", ("layers.0.down_proj.weight", None)),
    ("embeddings.token_type_embeddings.weight", ("token_type_embeddings.weight", None)),
    ("pooler.dense.weight", None), ("cls.predictions.bias", None), ("embeddings.position_ids", None),
])
def test_checkpoint_names_map_to_the_encoders_parameters_or_are_skipped(name, ours):
    assert our_name(name) == ours


def test_an_unknown_weight_name_is_an_error_naming_it():
    with pytest.raises(ValueError, match="unexpected weight 'encoder.layer.0.crossattention.self.query.weight'"):
        our_name("encoder.layer.0.crossattention.self.query.weight")
