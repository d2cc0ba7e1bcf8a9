"""Gemma 2 and Gemma 3 text config.json files read as transformers reads them (its config classes
are the oracle): defaults for what a file leaves out, sliding layers, Gemma 3's two rope bases in
transformers 4's layout and 5's, and the variants tokenmill does not run refused by name. GGUF
files' metadata read as llama.cpp reads it (llama-model.cpp's load_hparams): its defaults, sliding
patterns and score scale, and the variants refused by name."""

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


def gguf_file(tmp_path, arch: str, layers: int = 6, meta: dict | None = None, tensors: tuple[str, ...] = ()):
    """A GGUF file of Gemma's metadata as llama.cpp's converter writes it (hidden 96, 6 heads of 32, a
    vocabulary with <eos> at 1 and <end_of_turn> at 5) and `meta`, more of the architecture's keys
    (ints as uint32, floats as float32, lists as arrays); `tensors`: small float32 tensors so named."""
    import numpy as np
    from gguf import GGUFWriter
    path = tmp_path / f"{arch}.gguf"
    w = GGUFWriter(str(path), arch)
    for add, value in ((w.add_embedding_length, 96), (w.add_block_count, layers), (w.add_feed_forward_length, 192),
                       (w.add_head_count, 6), (w.add_head_count_kv, 2), (w.add_key_length, 32),
                       (w.add_value_length, 32), (w.add_layer_norm_rms_eps, 1e-6)):
        add(value)
    for key, value in (meta or {}).items():
        add = {int: w.add_uint32, float: w.add_float32, list: w.add_array}[type(value)]
        add(f"{arch}.{key}", value)
    w.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "a", "b"])
    w.add_eos_token_id(1)
    for name in tensors:
        w.add_tensor(name, np.ones(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_config(*args, **kwargs) -> ModelConfig:
    from tokenmill.models.gguf_loader import gguf_model_config, open_gguf
    return gguf_model_config(open_gguf(gguf_file(*args, **kwargs)))


def test_a_gemma2_gguf_without_its_optional_keys_takes_llama_cpps_defaults(tmp_path):
    """A 4096-token window on every second layer from the first, soft caps 50 and 30, scores scaled
    by head_dim ** -0.5, rope base 10000; <end_of_turn>, found by its text, ends a turn beside <eos>."""
    cfg = gguf_config(tmp_path, "gemma2")
    assert (cfg.architecture, cfg.layer_windows) == ("gemma2", (4096, None) * 3)
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.query_pre_attn_scalar) == (50.0, 30.0, 32)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.qk_norm) == (10000.0, None, False)
    assert cfg.eos_token_ids == (1, 5) and cfg.vocab_size == 8 and cfg.tie_word_embeddings


@pytest.mark.parametrize("arch, layers, scalar", [("gemma2", 46, 16), ("gemma2", 42, 32), ("gemma3", 62, 16),
                                                  ("gemma3", 26, 32)])
def test_a_gguf_scales_scores_by_head_dim_but_by_hidden_over_heads_for_the_27b_layer_counts(tmp_path, arch, layers,
                                                                                              scalar):
    """The file has no query_pre_attn_scalar: llama.cpp takes head_dim, and hidden / heads for the
    27B models (query_pre_attn_scalar 144 and 168 in their config.json), known by their layer counts."""
    assert gguf_config(tmp_path, arch, layers, {"attention.sliding_window": 8}).query_pre_attn_scalar == scalar


@pytest.mark.parametrize("meta, windows, local", [
    ({"attention.sliding_window": 8}, (8, 8, 8, 8, 8, None), 10000.0),               # llama.cpp's 5 in 6
    ({"attention.sliding_window": 8, "rope.freq_base_swa": 100.0}, (8, 8, 8, 8, 8, None), 100.0),
    ({"attention.sliding_window": 8, "attention.sliding_window_pattern": 3}, (8, 8, None, 8, 8, None), 10000.0),
    ({"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False] * 3}, (8, None) * 3, 10000.0),
    ({}, (), None),                                                                     # no window: every layer global
])
def test_gemma3_gguf_sliding_layers_and_their_rope_base_are_read_as_llama_cpp_reads_them(tmp_path, meta, windows,
                                                                                          local):
    cfg = gguf_config(tmp_path, "gemma3", meta={"rope.freq_base": 1e6, **meta})
    assert (cfg.architecture, cfg.layer_windows, cfg.local_rope_theta, cfg.rope_theta) == ("gemma3_text", windows,
                                                                                            local, 1e6)
    assert cfg.attn_softcap is None and cfg.final_softcap is None


@pytest.mark.parametrize("arch, meta, tensors, match", [
    ("gemma3n", {}, (), "unsupported GGUF architecture 'gemma3n'"),
    ("clip", {}, (), r"'clip' \(a multimodal projector, mmproj, file"),
    ("gemma3", {"attention.sliding_window": 8}, ("v.patch_embd.weight", "mm.input_projection.weight"),
     r"vision or audio tensors \(mm\.\*, v\.\*\)"),
    ("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False]}, (),
     "sliding_window_pattern names 2 layers, block_count is 6"),
])
def test_gemma_gguf_variants_tokenmill_does_not_run_are_refused_by_name(tmp_path, arch, meta, tensors, match):
    from tokenmill.models.loader import open_checkpoint
    with pytest.raises(ValueError, match=match):
        open_checkpoint(gguf_file(tmp_path, arch, meta=meta, tensors=tensors))
