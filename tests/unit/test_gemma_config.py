"""Gemma 2 and Gemma 3 text config.json files read as transformers reads them (its config classes
are the oracle): defaults for what a file leaves out, sliding layers, Gemma 3's two rope bases in
transformers 4's layout and 5's, and the variants tokenmill does not run refused by name."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from tokenmill.config import ModelConfig
from tokenmill.models.loader import hf_layer_windows, hf_model_config

SHAPE = dict(vocab_size=384, hidden_size=96, intermediate_size=192, num_hidden_layers=6, num_attention_heads=6,
             num_key_value_heads=2)


def config_dir(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, **cfg}))
    return tmp_path


@pytest.mark.parametrize("cfg,windows", [
    ({"model_type": "gemma2", "sliding_window": 8}, (8, None, 8, None, 8, None)),        # every second, from 0
    ({"model_type": "gemma3_text", "sliding_window": 8}, (8, 8, 8, 8, 8, None)),         # 5 of 6
    ({"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 3}, (8, 8, None, 8, 8, None)),
    ({"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 3,
      "layer_types": ["full_attention"] * 5 + ["sliding_attention"]}, (None,) * 5 + (8,)),
])
def test_gemma_sliding_layers_are_the_ones_transformers_slides(tmp_path, cfg, windows):
    assert hf_layer_windows({**SHAPE, **cfg}) == windows
    hf = AutoConfig.for_model(**{**SHAPE, **cfg})
    assert tuple(8 if t == "sliding_attention" else None for t in hf.layer_types) == windows


def test_a_gemma2_config_without_its_optional_keys_takes_transformers_defaults(tmp_path):
    """Soft caps 50 and 30, head_dim and query_pre_attn_scalar 256, a 4096-token window, tied head."""
    cfg = hf_model_config(config_dir(tmp_path, model_type="gemma2"))
    hf = AutoConfig.from_pretrained(str(tmp_path))
    assert (cfg.attn_softcap, cfg.final_softcap) == (hf.attn_logit_softcapping, hf.final_logit_softcapping) == (50, 30)
    assert cfg.head_dim == hf.head_dim == 256 and cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar == 256
    assert cfg.attention_scale == 256 ** -0.5
    assert cfg.layer_windows == (4096, None) * 3 and cfg.tie_word_embeddings and hf.tie_word_embeddings
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 10000 and cfg.local_rope_theta is None
    assert cfg.max_position_embeddings == hf.max_position_embeddings == 8192


@pytest.mark.parametrize("layout,factor", [
    (dict(rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}), 8.0),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), 8.0),
    (dict(), None),  # transformers' defaults: 1e6 global, 10000 local, unscaled
])
def test_gemma3_rope_bases_are_read_from_either_layout(tmp_path, layout, factor):
    """transformers 4 wrote rope_theta, rope_local_base_freq and rope_scaling (the global layers');
    5 writes rope_parameters per layer type. No attention soft-capping (transformers' Gemma 3 passes
    none to its attention); q/k norms on."""
    cfg = hf_model_config(config_dir(tmp_path, model_type="gemma3_text", attn_logit_softcapping=50.0, **layout))
    hf = AutoConfig.from_pretrained(str(tmp_path)).rope_parameters
    assert cfg.rope_theta == hf["full_attention"]["rope_theta"] == 1e6
    assert cfg.local_rope_theta == hf["sliding_attention"]["rope_theta"] == 10000.0
    assert (cfg.rope_scaling or {}).get("factor") == hf["full_attention"].get("factor") == factor
    assert cfg.attn_softcap is None and cfg.final_softcap is None and cfg.qk_norm
    assert cfg.max_position_embeddings == AutoConfig.from_pretrained(str(tmp_path)).max_position_embeddings == 131072


@pytest.mark.parametrize("changes,match", [
    (dict(hidden_activation="gelu"), "unsupported hidden_activation 'gelu'"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(sliding_window=None), "without a sliding_window"),
])
def test_gemma_variants_tokenmill_does_not_run_are_refused_by_name(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        hf_model_config(config_dir(tmp_path, model_type="gemma3_text", **changes))


def test_a_soft_cap_must_be_positive():
    with pytest.raises(ValueError, match="attn_softcap must be positive"):
        ModelConfig("gemma2", 8, 8, 8, 1, 1, 1, 8, attn_softcap=0.0)
