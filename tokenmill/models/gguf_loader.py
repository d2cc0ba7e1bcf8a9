"""GGUF files as llama.cpp writes them: the model config from the metadata (with llama.cpp's own
defaults and derivations where the file is silent, as for Gemma's sliding layers and score scale;
for phi3 files and gpt-oss's rope, what the model's Hugging Face directory gives, as _gguf_phi3 and
_gguf_gpt_oss say), the tensors under Hugging Face's names (dequantized through the `gguf` package,
q and k un-permuted from llama.cpp's rotary layout, or put in partial rotary's order (Phi-4-mini),
merged expert tensors split into one matrix per expert (with their biases, gpt-oss's), MXFP4
(gpt-oss's experts) decoded by gpt_oss.py, Phi-3's fused attn_qkv and ffn_up into q/k/v and gate/up;
Gemma's norms as the converter wrote them, 1 + w, which is how the model holds them), and on the CPU
the projections kept in their quantized blocks for the panel kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q3_K, Q4_K, Q5_K, Q6_K; Q5 and K-quants re-laid out in blocks of 32 rows where the kernel needs), a
fused projection's parts and a tensor-parallel rank's part of each cut from the file's blocks on
block boundaries. loader.py opens a file and picks these or the Hugging Face path.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from tokenmill.config import ModelConfig, MoEConfig, UnsupportedModel
from tokenmill.host_memory import read_only_tensor
from tokenmill.models.gemma import GEMMA_ARCHITECTURES
from tokenmill.models.gpt_oss import (
    check_mxfp4_scales,
    dequantize_ggml_mxfp4,
    gpt_oss_config,
    gpt_oss_fields,
    gpt_oss_moe,
)
from tokenmill.models.llama import partial_rotary_order, rope_attention_factor
from tokenmill.models.moe import MOE_ARCHITECTURES
from tokenmill.models.packed_linear import BLOCK_FORMATS, GGUFMatrix
from tokenmill.models.parallel import TPShard, holds, tensor_cut

logger = logging.getLogger(__name__)

GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
              "qwen3moe": "qwen3_moe", "olmoe": "olmoe", "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3",
              "gpt-oss": "gpt_oss"}
# whether llama.cpp renormalises each MoE architecture's top-k weights, where a file does not say
# (expert_weights_norm): as the transformers models do for Mixtral and for Qwen3-MoE's released configs
# (gpt-oss's softmax over the top k needs none)
_GGUF_NORM_TOPK = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False, "gpt_oss": False}

_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    # merged experts (E, rows, cols): one matrix per expert, {} its index
    "ffn_gate_exps": "mlp.experts.{}.gate_proj", "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the norm before the MLP, as for Llama, which
# Gemma's Hugging Face names call pre_feedforward_layernorm (its post_attention_layernorm is the norm
# of the attention's output, llama.cpp's post_attention_norm)
_GEMMA_GGUF_NAMES = {**_GGUF_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's fused projections, as its Hugging Face checkpoints have them: q, k and v rows in one
# attn_qkv (or three tensors, which llama.cpp also reads), gate then up rows in one ffn_up
_PHI3_GGUF_NAMES = {**_GGUF_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# gpt-oss's norm before its experts is llama.cpp's post_attention_norm; its router and each merged
# expert tensor have a bias (blk.L.ffn_gate_exps.bias (E, I): one row per expert); its sinks
# (blk.L.attn_sinks.weight) are the parameter self_attn.sinks (_gguf_name)
_GPT_OSS_GGUF_NAMES = {**_GGUF_NAMES, "post_attention_norm": "post_attention_layernorm"}
# what the end of a turn is spelled as in a vocabulary, found by its text as llama.cpp finds it
# (the converter writes only <eos> as Gemma's end of generation; Phi-3's file names <|endoftext|>, and
# its turns end with <|end|>, as its generation_config.json has it)
# gpt-oss's harmony format ends generation with <|return|> (the final answer) or <|call|> (a tool
# call), and <|endoftext|>, as its generation_config.json and llama.cpp have it; its <|end|> ends a
# message, not the output, and llama.cpp takes it out of the end tokens where the file names it
_END_OF_TURN = {"gemma2": ("<end_of_turn>",), "gemma3_text": ("<end_of_turn>",), "phi3": ("<|end|>", "<|endoftext|>"),
                "gpt_oss": ("<|return|>", "<|call|>", "<|endoftext|>")}
_NOT_END_OF_TURN = {"gpt_oss": b"<|end|>"}
# tensor name prefixes of what a text model has no use for: a vision tower and its projector, audio
_MULTIMODAL_PREFIXES = ("v.", "mm.", "a.")


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_rope_scaling(meta) -> dict | None:
    """The rope scaling llama.cpp would apply, in transformers' terms: linear, YaRN (converted Qwen
    long-context models) or, for any other type, one the model refuses by name rather than runs
    without."""
    kind = meta("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": meta("rope.scaling.factor")}
    if kind == "yarn":
        scaling.update(original_max_position_embeddings=meta("rope.scaling.original_context_length"),
                       beta_fast=meta("rope.scaling.yarn_beta_fast"), beta_slow=meta("rope.scaling.yarn_beta_slow"))
    return scaling


def _gguf_phi3(meta, reader, layers: int, rotary_dim: int) -> dict:
    """The ModelConfig fields of a phi3 file (Phi-3, Phi-3.5, Phi-4, Phi-4-mini) that its Hugging
    Face config.json would give (hf_model_config), so that the file runs as transformers runs the
    model, the same as its directory does here:

        LongRoPE    where the file has rope_factors_long and rope_factors_short (rotary_dim / 2
                    each): transformers' longrope with those factors, original_context_length,
                    factor context_length / original_context_length (what transformers derives),
                    and attention_factor only where rope.scaling.attn_factor is not the one
                    transformers derives from them. Each position takes the short or the long
                    factors by itself (llama.Rotary); llama.cpp instead picks one set for all
                    positions, by the context size the server is started with.
        window      attention.sliding_window on every layer, as transformers applies Phi-3's
                    sliding_window (Phi-3-mini: 2047; 0, no window, for Phi-4; none in files
                    converted before the key was written); llama.cpp turns Phi-3's window off
                    and attends to the whole context.
        rotary_dim  rope.dimension_count (Phi-4-mini: 96 of 128 dims rotate).
    """
    if meta("expert_count"):
        raise UnsupportedModel(f"unsupported GGUF phi3 variant: expert_count {meta('expert_count')} (supported: dense)")
    window = meta("attention.sliding_window", 0)
    fields = dict(layer_windows=(window,) * layers if window else ())
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if not factors:
        return fields
    if set(factors) != {"rope_factors_long.weight", "rope_factors_short.weight"}:
        raise UnsupportedModel(f"unsupported GGUF phi3 variant: rope factors {', '.join(sorted(factors))} (supported: "
                               "rope_factors_long.weight with rope_factors_short.weight)")
    long, short = (np.asarray(factors[f"rope_factors_{k}.weight"].data, np.float64).reshape(-1).tolist()
                   for k in ("long", "short"))
    if len(long) != rotary_dim // 2 or len(short) != rotary_dim // 2:
        raise ValueError(f"GGUF phi3 rope factors: {len(long)} long and {len(short)} short for {rotary_dim // 2} "
                         "rotary frequencies")
    old_len = meta("rope.scaling.original_context_length")
    if not old_len:
        raise ValueError("GGUF phi3 rope factors without rope.scaling.original_context_length")
    scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
               "original_max_position_embeddings": old_len, "factor": meta("context_length", old_len) / old_len}
    attn_factor = meta("rope.scaling.attn_factor")
    if attn_factor is not None and not math.isclose(attn_factor, rope_attention_factor(scaling), rel_tol=1e-6):
        scaling["attention_factor"] = float(attn_factor)  # the file's own, where not transformers' derivation
    return fields | dict(rope_scaling=scaling)


def _gguf_moe(meta, arch: str, reader) -> MoEConfig:
    """The experts of a GGUF file, as llama.cpp runs them: softmax over the router's logits, the
    top expert_used_count, renormalised per expert_weights_norm (or the architecture's rule); a
    layer without ffn_gate_inp is dense. The experts' widths are read from their tensors' shapes
    ((hidden, width, experts)), whatever metadata the file has. Other gating functions and weight
    scales are refused."""
    gating, scale = meta("expert_gating_func"), meta("expert_weights_scale")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise UnsupportedModel(f"unsupported GGUF expert_gating_func {gating} (supported: 1, softmax)")
    if scale not in (None, 0.0, 1.0):
        raise UnsupportedModel(f"unsupported GGUF expert_weights_scale {scale} (supported: 1)")
    widths = {}  # ffn_gate_exps / ffn_gate_shexp -> width; older Mixtral files: blk.L.ffn_gate.E.weight per expert
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[-1] == "weight" and (
                parts[2] in ("ffn_gate_exps", "ffn_gate_shexp") or parts[2:4] == ["ffn_gate", "0"]):
            widths["ffn_gate_exps" if parts[2] == "ffn_gate" else parts[2]] = int(t.shape[1])
    routers = {t.name for t in reader.tensors if t.name.endswith(".ffn_gate_inp.weight")}
    dense = tuple(i for i in range(meta("block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in routers)
    return MoEConfig(meta("expert_count"), meta("expert_used_count"), widths.get("ffn_gate_exps", 0),
                     bool(meta("expert_weights_norm", _GGUF_NORM_TOPK[arch])), float32_weights=arch == "mixtral",
                     shared_expert_intermediate_size=widths.get("ffn_gate_shexp", 0), dense_layers=dense)


def _layer_windows(meta, layers: int, window: int, period: int) -> tuple[int | None, ...]:
    """Each layer's window as llama.cpp's load_swa_pattern sets it: `window` on the layers that
    attention.sliding_window_pattern names (a flag per layer), or else on all but the last of each
    run of its period (`period` where the file has none; 0: every layer); () when none slides."""
    pattern = meta("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"GGUF attention.sliding_window_pattern names {len(pattern)} layers, "
                             f"block_count is {layers}")
        slides = [bool(flag) for flag in pattern]
    else:
        slides = [pattern == 0 or (i + 1) % pattern != 0 for i in range(layers)]
    windows = tuple(window if slide else None for slide in slides) if window else ()
    return windows if any(w is not None for w in windows) else ()


# Gemma's 27B models, which llama.cpp knows by their layer count: their scores are scaled by
# (hidden / heads) ** -0.5 rather than head_dim ** -0.5 (query_pre_attn_scalar is not in the file)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def _gguf_gemma(meta, arch: str, hidden: int, heads: int, head_dim: int, layers: int) -> dict:
    """The ModelConfig fields of a Gemma 2 or Gemma 3 GGUF file beyond the Llama family's, as
    llama.cpp reads them (llama-model.cpp, load_hparams):

        sliding layers  all but every 2nd (Gemma 2) or every 6th (Gemma 3) from the first, or as the
                        file's attention.sliding_window_pattern says (a period, or a flag per layer);
                        the window attention.sliding_window (Gemma 2: 4096 where absent; Gemma 3:
                        no sliding layers where absent)
        score scale     head_dim ** -0.5, but (hidden / heads) ** -0.5 for the 27B models
        soft caps       Gemma 2: attn_logit_softcapping and final_logit_softcapping (50 and 30
                        where absent); Gemma 3: no cap on scores, on the logits only where the file
                        has final_logit_softcapping
        rope            Gemma 3's sliding layers rotate with rope.freq_base_swa (10000 where
                        absent), unscaled; the global ones with rope.freq_base and its scaling
    """
    windows = _layer_windows(meta, layers, meta("attention.sliding_window", 4096 if arch == "gemma2" else 0),
                             2 if arch == "gemma2" else 6)
    gemma2 = arch == "gemma2"
    return dict(
        layer_windows=windows,
        query_pre_attn_scalar=hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim,
        attn_softcap=meta("attn_logit_softcapping", 50.0) if gemma2 else None,
        final_softcap=meta("final_logit_softcapping", 30.0 if gemma2 else None),
        local_rope_theta=meta("rope.freq_base_swa", 10000.0) if not gemma2 and windows else None)


def _gguf_gpt_oss(meta, reader, moe: MoEConfig, layers: int, scaling: dict | None) -> dict:
    """The ModelConfig fields of a gpt-oss file beyond the Llama family's, as llama.cpp reads them
    (llama_model_openai_moe) and transformers runs the model (gpt_oss.py's fields):

        experts     _gguf_moe's count, top k and width, with gpt-oss's router (a bias, a softmax
                    over the k largest logits) and clamped SwiGLU, whose limit (7) and alpha
                    (1.702) llama.cpp holds as constants, not in the file: transformers' defaults
        attention   biases on q, k, v and o, a sink logit per head; attention.sliding_window on
                    every second layer from the first (llama.cpp's period 2, or the file's
                    attention.sliding_window_pattern), as transformers' default layer_types
        rope        YaRN as transformers and gpt-oss's config.json have it (truncate False: the
                    ramp's ends not rounded to whole dimensions, which llama.cpp rounds); sliding
                    layers with a rope base of their own (rope.freq_base_swa) refused by name
    """
    base, swa_base = meta("rope.freq_base"), meta("rope.freq_base_swa")
    if swa_base is not None and swa_base != base:
        raise UnsupportedModel(f"unsupported GGUF gpt-oss variant: rope.freq_base_swa {swa_base} beside rope.freq_base "
                               f"{base} (supported: one base for every layer)")
    if not meta("attention.sliding_window"):  # llama.cpp requires it too
        raise ValueError("GGUF gpt-oss file without attention.sliding_window (its sliding layers need one)")
    names = {t.name for t in reader.tensors}
    cfg = gpt_oss_config({"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                          "intermediate_size": moe.expert_intermediate_size,
                          "attention_bias": "blk.0.attn_q.bias" in names})
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling = {**scaling, "truncate": False}
    windows = _layer_windows(meta, layers, meta("attention.sliding_window"), 2)
    return gpt_oss_fields(cfg) | dict(moe=gpt_oss_moe(cfg), rope_scaling=scaling, layer_windows=windows)


def _token_text(reader, token: int) -> bytes:
    """Token `token`'s bytes in the file's vocabulary (b"" where it has none or no such token)."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None or not 0 <= token < len(field.data):
        return b""
    return field.parts[field.data[token]].tobytes()


def _token_ids(reader, texts: tuple[str, ...]) -> list[int]:
    """The ids of the tokens spelled as one of `texts` in the file's vocabulary, in one pass over it."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return []
    spelled = {text.encode() for text in texts}
    lengths = {len(text) for text in spelled}
    pieces = (field.parts[part] for part in field.data)  # each token's bytes; the lengths compared first
    return [i for i, piece in enumerate(pieces) if len(piece) in lengths and piece.tobytes() in spelled]


def gguf_model_config(reader) -> ModelConfig:
    name = _gguf_field(reader, "general.architecture")
    if name not in GGUF_ARCHS:
        hint = " (a multimodal projector, mmproj, file: give the language model's file)" if name == "clip" else ""
        raise UnsupportedModel(f"unsupported GGUF architecture {name!r}{hint} (supported: {', '.join(GGUF_ARCHS)})")
    if towers := sorted({t.name.split(".")[0] for t in reader.tensors if t.name.startswith(_MULTIMODAL_PREFIXES)}):
        raise UnsupportedModel(f"unsupported GGUF {name} variant: vision or audio tensors "
                               f"({', '.join(f'{p}.*' for p in towers)}) beside the language model (text only)")

    def meta(key, default=None):
        return _gguf_field(reader, f"{name}.{key}", default)

    def need(key):  # (llama.cpp refuses a file without it too)
        if (value := meta(key)) is None:
            raise UnsupportedModel(f"missing required key {name}.{key}")
        return value
    arch = "mixtral" if name == "llama" and meta("expert_count") else GGUF_ARCHS[name]
    layers = need("block_count")  # (before the experts, which are read per layer)
    scaling = _gguf_rope_scaling(meta)
    tensor_names = {t.name for t in reader.tensors}
    moe = _gguf_moe(meta, arch, reader) if arch in MOE_ARCHITECTURES else None
    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = meta("attention.key_length") or hidden // heads
    rotary_dim = meta("rope.dimension_count") or head_dim
    if rotary_dim != head_dim and arch != "phi3":
        raise UnsupportedModel(f"unsupported GGUF {name} variant: rope.dimension_count {rotary_dim} of head_dim "
                               f"{head_dim} (partial rotary is read for phi3 files)")
    if "rope_freqs.weight" in tensor_names:  # Llama 3.1+: llama.cpp keeps its rope scaling as a divisor per frequency
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = {"rope_type": "freq_factors",
                   "factors": np.asarray(factors.data, dtype=np.float64).reshape(-1).tolist()}
    if not meta("vocab_size") and "tokenizer.ggml.tokens" not in reader.fields:
        raise UnsupportedModel("missing required key tokenizer.ggml.tokens (the vocabulary)")
    vocab = meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    # end of generation, as llama.cpp has it: <|eot_id|> and <|eom_id|> end a Llama 3 turn even
    # where the file's eos is <|end_of_text|>
    ends = [_gguf_field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    if arch in _END_OF_TURN:  # Gemma's <end_of_turn>, Phi-3's <|end|>, gpt-oss's, which the file does not name
        ends += _token_ids(reader, _END_OF_TURN[arch])
    if arch in _NOT_END_OF_TURN:  # gpt-oss's <|end|>, even where the file names it
        ends = [t for t in ends if t is None or _token_text(reader, int(t)) != _NOT_END_OF_TURN[arch]]
    eos_ids = tuple(dict.fromkeys(int(t) for t in ends if t is not None))
    gemma = _gguf_gemma(meta, arch, hidden, heads, head_dim, layers) if arch in GEMMA_ARCHITECTURES else {}
    phi3 = _gguf_phi3(meta, reader, layers, rotary_dim) if arch == "phi3" else {}
    gpt_oss = _gguf_gpt_oss(meta, reader, moe, layers, scaling) if arch == "gpt_oss" else {}
    return ModelConfig(**dict(
        architecture=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=moe.expert_intermediate_size if moe and not meta("feed_forward_length")
        else need("feed_forward_length"),
        num_layers=layers,
        num_heads=heads, num_kv_heads=meta("attention.head_count_kv") or heads, head_dim=head_dim,
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta("rope.freq_base", 10000.0), rope_scaling=scaling,
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names, o_proj_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm=arch != "olmoe" and "blk.0.attn_q_norm.weight" in tensor_names, qk_norm_whole=arch == "olmoe",
        moe=moe, bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids) | gemma | phi3 | gpt_oss)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (interleaved rotary pairs -> half-split)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(gguf_name: str, cfg: ModelConfig) -> tuple[str | None, int]:
    """(Hugging Face name or None to skip, heads to un-permute the rows by or 0)."""
    parts = gguf_name.split(".")
    if parts[0] != "blk":  # None for e.g. rope_freqs: read into the config's rope scaling instead
        return {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}.get(gguf_name), 0
    layer, kind, suffix = parts[1], parts[2], parts[-1]
    if kind == "attn_sinks":  # gpt-oss: a parameter, not a layer's weight
        return f"model.layers.{layer}.self_attn.sinks", 0
    if len(parts) == 5:  # one expert's own tensor, as older Mixtral files have them: blk.0.ffn_gate.3.weight
        return f"model.layers.{layer}.mlp.experts.{parts[3]}.{_GGUF_NAMES[kind].removeprefix('mlp.')}.{suffix}", 0
    heads = 0
    if cfg.architecture in ("llama", "mistral", "mixtral") and kind in ("attn_q", "attn_k"):  # biases too, as permuted
        heads = cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads
    names = (_GEMMA_GGUF_NAMES if cfg.architecture in GEMMA_ARCHITECTURES else
             _PHI3_GGUF_NAMES if cfg.architecture == "phi3" else
             _GPT_OSS_GGUF_NAMES if cfg.architecture == "gpt_oss" else _GGUF_NAMES)
    if kind not in names:  # such as llama.cpp's optionally fused attn_qkv or ffn_gate_up_exps
        raise UnsupportedModel(f"unsupported GGUF tensor {gguf_name} in a {cfg.architecture} file")
    return f"model.layers.{layer}.{names[kind]}.{suffix}", heads


def _fused_parts(name: str, cfg: ModelConfig) -> list[tuple[str, int, int | None]]:
    """(Hugging Face name, first row, row count or None for all) of each matrix a tensor holds:
    Phi-3's fused qkv_proj as q, k and v, its gate_up_proj as gate and up; any other, itself whole.
    The cuts fall between whole rows, so a quantized tensor's parts keep their blocks."""
    q, kv, ff = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    if ".qkv_proj." in name:
        return [(name.replace("qkv_proj", p), start, n) for p, start, n in
                (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv))]
    if ".gate_up_proj." in name:
        return [(name.replace("gate_up_proj", "gate_proj"), 0, ff), (name.replace("gate_up_proj", "up_proj"), ff, ff)]
    return [(name, 0, None)]


def _our_rows(rows: np.ndarray, name: str, heads: int, cfg: ModelConfig) -> np.ndarray:
    """Tensor `name`'s rows (floats, or a quantized matrix's rows of blocks) in the order the model
    rotates q and k by: llama.cpp's permutation of llama-arch q/k rows undone (`heads`); with partial
    rotary (Phi-4-mini), each q/k head's rows put in partial_rotary_order, as hf_unfused does."""
    if heads:
        rows = _unpermute(rows, heads)
    if cfg.rotary_dim and (".q_proj." in name or ".k_proj." in name):
        order = partial_rotary_order(cfg.head_dim, cfg.rotary_dim).numpy()
        rows = rows.reshape(-1, cfg.head_dim, *rows.shape[1:])[:, order].reshape(rows.shape)
    return rows


def _expert_names(name: str, tensor) -> list[str]:
    """The Hugging Face names a GGUF tensor holds: one per expert for merged experts (E, rows, cols),
    or their biases (E, rows)."""
    return [name.format(e) for e in range(int(tensor.shape[-1]))] if "{}" in name else [name]


def gguf_weights(reader, cfg: ModelConfig, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor but those named in `skip`, dequantized to float32 under its Hugging Face name;
    merged experts as one matrix per expert (MXFP4 ones decoded an expert at a time), fused
    projections (Phi-3) as their parts."""

    for tensor in reader.tensors:
        name, heads = _gguf_name(tensor.name, cfg)
        if name is None:
            continue
        wanted = [(i, n) for i, n in enumerate(_expert_names(name, tensor))
                  if any(part not in skip for part, _, _ in _fused_parts(n, cfg))]
        if not wanted:
            continue
        data, decode = _values(tensor)
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp keeps its one row as a vector
            data = data.reshape(1, -1)
        for index, expert in wanted:
            values = decode(data[index] if "{}" in name else data)        # (rows, cols) of expert `index`
            for part, start, count in _fused_parts(expert, cfg):
                if part not in skip:
                    rows = _our_rows(values if count is None else values[start:start + count], part, heads, cfg)
                    yield part, torch.from_numpy(np.require(rows, requirements=["C", "W"]))


def _values(tensor) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
    """A GGUF tensor as (data, decode): decode(data) is its float32 values, (..., rows, cols) in
    numpy's order of its shape, and decode(data[e]) expert e's (rows, cols) of merged experts.
    MXFP4 is decoded one part at a time (gpt_oss.py's decoder); any other type by the gguf package,
    whole, decode then handing its part back. A type neither decodes is refused naming the tensor."""
    shape = [int(d) for d in reversed(tensor.shape)]
    if tensor.tensor_type.name == "MXFP4":
        rows = np.asarray(tensor.data).reshape(*shape[:-1], -1)        # (..., rows, cols / 32 * 17) bytes
        return rows, lambda part: dequantize_ggml_mxfp4(torch.from_numpy(np.array(part))).numpy()  # a copy
    from gguf.quants import dequantize
    try:
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    except NotImplementedError:
        raise UnsupportedModel(f"unsupported GGUF tensor type {tensor.tensor_type.name} of {tensor.name}") from None
    return data.reshape(shape), lambda part: part


def _bit_fields(packed: np.ndarray, groups: int, shifts: list[int], mask: int) -> np.ndarray:
    """(n, bytes) -> (n, groups * len(shifts) * width) codes: each of `groups` runs of bytes read
    once per shift, shifted and masked, in gguf's order of the K-quants' values."""
    fields = packed.reshape(packed.shape[0], groups, 1, -1) >> np.array(shifts, np.uint8).reshape(1, 1, -1, 1)
    return (fields & np.uint8(mask)).reshape(packed.shape[0], -1)


def k_quant_rows(rows: np.ndarray, kind: str) -> np.ndarray:
    """Q4_K, Q5_K or Q6_K rows (N, K / 256 * super-block bytes) -> the rows the CPU kernel packs
    (gemm_cpu.cpp, Format), codes unpacked as gguf's dequantization reads them. Per super-block of
    256 weights, Q4_K and Q5_K: the fp16 d and dmin, the 8 scales, the 8 mins, then per 32 weights
    Q4_1's 16 bytes of nibbles (Q4_K) or a byte per code (Q5_K); Q6_K: the fp16 d, the 16 int8
    scales, a signed byte per code (q - 32). The kernel makes a block's d * sc and -(dmin * m)
    from them, exactly gguf's products, so that its values are gguf's bit for bit."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import Q4_K
    blocks = rows.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1])
    if kind == "Q6_K":  # ql (128), qh (64), 16 int8 scales, d
        low = _bit_fields(blocks[:, :128], 2, [0, 4], 0x0F)
        high = _bit_fields(blocks[:, 128:192], 2, [0, 2, 4, 6], 0x03)
        codes = ((low | (high << 4)).view(np.int8) - np.int8(32)).view(np.uint8)
        return np.concatenate([blocks[:, 208:210], blocks[:, 192:208], codes], axis=1).reshape(rows.shape[0], -1)
    # d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth bits,) nibbles
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    codes = _bit_fields(blocks[:, -128:], 4, [0, 4], 0x0F).reshape(-1, 8, 32)
    if kind == "Q5_K":
        codes = codes | (_bit_fields(blocks[:, 16:48], 1, list(range(8)), 0x01).reshape(-1, 8, 32) << 4)
    else:  # Q4_1's nibble order: byte i = weight i | weight i + 16 << 4
        codes = codes[..., :16] | (codes[..., 16:] << 4)
    parts = [blocks[:, 0:4], sc.reshape(-1, 8).astype(np.uint8), m.reshape(-1, 8).astype(np.uint8),
             codes.reshape(blocks.shape[0], -1)]
    return np.concatenate(parts, axis=1).reshape(rows.shape[0], -1)


def q5_as_blocks_of_32(rows: np.ndarray, kind: str) -> np.ndarray:
    """Q5_0 or Q5_1 rows (N, K / 32 * 22 or 24 bytes) -> the kernel's Q5F rows: float32 scale d and
    offset, then a byte per 5-bit code (the low nibble, and bit i of qh as the fifth bit of weight
    i). Q5_1's offset is its m; Q5_0's is -16 d, so that the kernel's d * q + offset is gguf's
    (q - 16) * d exactly (d * q and 16 d are exact in float32, and so is their difference), but
    for the sign of a zero weight (gguf's -0 where d < 0), which no sum starting from +0 shows."""
    size = 22 if kind == "Q5_0" else 24
    blocks = rows.reshape(-1, size)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    offset = -16 * d if kind == "Q5_0" else blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    codes = _bit_fields(blocks[:, size - 16:], 1, [0, 4], 0x0F)              # weights 0-15, 16-31
    codes |= _bit_fields(blocks[:, size - 20:size - 16], 4, list(range(8)), 0x01) << 4  # qh: bit i, weight i
    return np.concatenate([d.view(np.uint8), offset.view(np.uint8), codes], axis=1).reshape(rows.shape[0], -1)


def q3_k_rows(rows: np.ndarray) -> np.ndarray:
    """Q3_K rows (N, K / 256 * 110 bytes) -> the kernel's Q6F rows: per super-block of 256 weights
    its fp16 d, an int8 scale per 16 weights (sc - 32), then a signed byte per code (q - 4, from -4
    to 3), decoded as gguf does it, so that the kernel's (d * scale) * code is gguf's dl * q bit for bit."""
    blocks = rows.reshape(-1, 110)
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    sc = _bit_fields(packed[:, :8], 1, [0, 4], 0x0F) | (_bit_fields(packed[:, 8:], 1, [0, 2, 4, 6], 0x03) << 4)
    scales = (sc.astype(np.int8) - np.int8(32)).view(np.uint8)
    ql = _bit_fields(qs, 2, [0, 2, 4, 6], 0x03)
    qh = _bit_fields(hmask, 1, list(range(8)), 0x01) ^ 1                         # a set bit: no -4
    codes = (ql.astype(np.int8) - (qh << 2).astype(np.int8)).view(np.uint8)
    return np.concatenate([blocks[:, 108:110], scales, codes], axis=1).reshape(rows.shape[0], -1)


def _cut_blocks(rows: np.ndarray, qtype, dim: int, start: int, length: int) -> np.ndarray:
    """A tensor-parallel rank's part of a GGUF matrix's rows (N, bytes), still in the file's blocks:
    rows [start, start + length) (dim 0), or those input columns (dim 1), which must fall on the
    type's block boundaries (32 weights, 256 for the K-quants)."""
    from gguf.constants import GGML_QUANT_SIZES
    if dim == 0:
        return rows[start:start + length]
    block, size = GGML_QUANT_SIZES[qtype]
    if start % block or length % block:
        raise ValueError(f"columns {start}..{start + length} cut {qtype.name}'s blocks of {block} weights")
    blocks = rows.reshape(rows.shape[0], -1, size)                     # (N, K / block, bytes a block)
    return blocks[:, start // block:(start + length) // block].reshape(rows.shape[0], -1)


def _block_rows(tensor, name: str, heads: int, cfg: ModelConfig, kernels, expert: int | None = None,
                part: tuple[int, int | None] = (0, None), cut: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The rows (N, bytes) of Hugging Face matrix `name` in a GGUF tensor, as the panel kernel reads
    them: of one expert's matrix, for merged experts; `part`'s rows (first, count; None: all) of a
    fused tensor; a tensor-parallel rank's part of them, `cut` as parallel.tensor_cut gives it.
    Put in our row order (_our_rows), cut, then K-quants re-cut by the kernels' recut_k_quant (the
    same bytes as k_quant_rows), Q5_0 and Q5_1 by q5_as_blocks_of_32, Q3_K by q3_k_rows (MXFP4's
    scales checked: check_mxfp4_scales), copied out
    of the file's read-only mapping. Each step works on whole rows of whole blocks, so cutting
    before the re-cut gives the rows the whole matrix would."""
    kind = tensor.tensor_type.name
    rows = np.asarray(tensor.data)
    rows = rows.reshape(int(tensor.shape[1]), -1) if expert is None else rows.reshape(
        int(tensor.shape[2]), int(tensor.shape[1]), -1)[expert]
    start, count = part
    rows = _our_rows(rows if count is None else rows[start:start + count], name, heads, cfg)
    if cut is not None:
        rows = np.ascontiguousarray(_cut_blocks(rows, tensor.tensor_type, *cut))
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        rows = kernels.recut_k_quant(read_only_tensor(np.ascontiguousarray(rows)), BLOCK_FORMATS[kind]).numpy()
    elif kind in ("Q5_0", "Q5_1"):
        rows = q5_as_blocks_of_32(rows, kind)
    elif kind == "Q3_K":
        rows = q3_k_rows(rows)
    elif kind == "MXFP4":
        check_mxfp4_scales(rows, name)
    return torch.from_numpy(np.require(rows, requirements=["C", "W"]))


def gguf_weight_blocks(reader, cfg: ModelConfig, kernels, shard: TPShard | None = None) -> dict[str, GGUFMatrix]:
    """Every matrix in a block type of BLOCK_FORMATS: Hugging Face name -> GGUFMatrix, whose
    rows (K-quants re-cut into blocks of 32 by `kernels`, the C++ module) are read when it is
    packed. The CPU panel kernel reads these instead of float32 copies (packed_linear.py); merged
    experts give one matrix per expert, so each expert keeps its blocks, and a fused projection
    (Phi-3's attn_qkv, ffn_up) one per part, cut between whole rows of blocks.

    With a tensor-parallel `shard`, each matrix is this rank's part (parallel.tensor_cut) cut from
    the file's blocks: output rows for any type; input columns only on the type's block boundaries.
    A matrix whose input columns would cut its blocks is left out, so that the loader dequantizes
    it to float32 and cuts that (shard_weights) on this rank, and a warning names it."""
    from gguf.constants import GGML_QUANT_SIZES
    out, dequantized = {}, []
    for tensor in reader.tensors:
        name, heads = _gguf_name(tensor.name, cfg)
        merged = name is not None and "{}" in name
        if name is None or tensor.tensor_type.name not in BLOCK_FORMATS or len(tensor.shape) != (3 if merged else 2):
            continue
        block = GGML_QUANT_SIZES[tensor.tensor_type][0]
        for index, expert in enumerate(_expert_names(name, tensor)):
            if shard is not None and not holds(expert, cfg, shard):  # another rank's expert
                continue
            for part, start, count in _fused_parts(expert, cfg):
                cut = None if shard is None or merged else tensor_cut(part, cfg, shard)
                if cut is not None and cut[0] == 1 and (cut[1] % block or cut[2] % block):
                    dequantized.append(f"{tensor.name} ({tensor.tensor_type.name}, blocks of {block} weights, "
                                       f"{cut[2]} columns a rank)")
                    continue
                rows = cut[2] if cut is not None and cut[0] == 0 else count or int(tensor.shape[1])
                cols = cut[2] if cut is not None and cut[0] == 1 else int(tensor.shape[0])
                read = functools.partial(_block_rows, tensor, part, heads, cfg, kernels, index if merged else None,
                                         (start, count), cut)
                out[part] = GGUFMatrix(tensor.tensor_type.name, rows, read, cols)
    if dequantized:
        logger.warning("tensor_parallel_size %d, rank %d: %d GGUF %s dequantized to float32 (input-column "
                       "shards that would cut quantized blocks): %s", shard.size, shard.rank, len(dequantized),
                       "matrix" if len(dequantized) == 1 else "matrices",
                       ", ".join(dequantized[:4]) + (", ..." if len(dequantized) > 4 else ""))
    return out


def gguf_metadata(path: Path, *keys: str) -> tuple:
    """The values of `keys` in the GGUF file at `path` (None for one it lacks; its metadata read)."""
    reader = open_gguf(path)
    return tuple(_gguf_field(reader, key) for key in keys)


def open_gguf(path: Path):
    """gguf's GGUFReader, its slices of the file taken through a plain ndarray view of its memory
    map: np.memmap's __getitem__ is Python code, and the reader slices the map three times per
    string of metadata (a vocabulary of tens of thousands of tokens and merges), so this reads a
    file's metadata in a fraction of the time (BENCHMARKS.md), the same fields and tensors (tested).
    Only when the reader's private `_get` has the signature this was written against; otherwise the
    reader as it is."""
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    expected = ["self", "offset", "dtype", "count", "override_order"]
    fits = list(inspect.signature(getattr(GGUFReader, "_get", lambda: None)).parameters) == expected
    try:
        return (PlainViewReader if fits else GGUFReader)(str(path))
    except ValueError as exc:  # "np.uint32(42) is not a valid GGMLQuantizationType": a type newer than gguf's
        unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
        if unknown is None:
            raise
        raise UnsupportedModel(f"{path}: a tensor of GGML type {unknown[1]}, which this install's gguf package "
                               f"({importlib.metadata.version('gguf')}) does not know: a quantization newer than "
                               "tokenmill reads") from exc
