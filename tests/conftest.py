"""Shared fixtures: tiny random-weight models saved as Hugging Face directories.

Each tiny model gets a word-level tokenizer ("w0".."wN") so the engine loads it through
the same path as a real checkpoint, with no hub access.

TOKENMILL_TEST_DEVICE=cuda runs the suite's engines on that device (see `engine_device`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

VOCAB = 384

TINY_CONFIGS = {
    "llama": dict(model_type="llama", tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  rope_theta=500000.0),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=24, rope_theta=1000000.0),
    "phi3": dict(model_type="phi3", tie_word_embeddings=False, rope_theta=10000.0, pad_token_id=0,
                 sliding_window=None),
}
# Mixture-of-experts models: hidden 64, 8 experts, top-2; Qwen2-MoE with a dense first layer
# (mlp_only_layers) and its shared expert, Qwen3-MoE sparse every second layer (decoder_sparse_step)
_TINY_MOE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_experts_per_tok=2)
TINY_MOE_CONFIGS = {
    "mixtral": dict(model_type="mixtral", num_local_experts=8, intermediate_size=64, rope_theta=1000000.0),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=8, moe_intermediate_size=32,
                      shared_expert_intermediate_size=96, mlp_only_layers=[0], tie_word_embeddings=True),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=2, head_dim=24),
    "olmoe": dict(model_type="olmoe", num_experts=8, intermediate_size=32),
}

# Gemma 2 (alternating sliding and global layers, soft-capped scores and logits, caps low enough to
# bite at these weights) and Gemma 3 text (one global layer in three, its own rope base on the sliding
# layers, linear scaling on the global one); query_pre_attn_scalar unlike head_dim, and head_dim
# unlike hidden / heads, in both. Their norms, zero in transformers' init, are drawn at random, and
# their embeddings shrunk (build_tiny_model).
TINY_GEMMA_CONFIGS = {
    "gemma2": dict(model_type="gemma2", head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
                   attn_logit_softcapping=2.0, final_logit_softcapping=4.0),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=32, query_pre_attn_scalar=20, sliding_window=20,
                        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        rope_parameters={
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
}


def triton_usable() -> bool:
    """Triton runs on CUDA, or on the CPU under its interpreter (TRITON_INTERPRET=1)."""
    import importlib.util
    import os

    import torch
    return importlib.util.find_spec("triton") is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


needs_triton = pytest.mark.skipif(not triton_usable(), reason="needs triton (CUDA or TRITON_INTERPRET=1)")


def random_k_quant_rows(rng, kind: str, n: int, k: int):
    """(n, k / 256 * super-block bytes) uint8 rows of random Q3_K, Q4_K, Q5_K or Q6_K super-blocks
    with small scales (gguf cannot quantize to the K-quants)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    raw = rng.integers(0, 256, (n, k // 256, GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]), dtype=np.uint8)
    scales = (rng.random((n, k // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if kind in ("Q3_K", "Q6_K"):
        raw[..., -2:] = scales[..., :2]      # d, at the end
    else:
        raw[..., 0:4] = scales               # d and dmin, at the start
    return raw.reshape(n, -1)


def quantize_q4_k(data):
    """float32 (n, k) -> (n, k / 256 * 144) uint8 Q4_K rows, as gguf's dequantize reads them (gguf
    cannot quantize to the K-quants): each 32 weights' range from min(0, smallest) in 15 steps, the
    super-block's step sizes and offsets in 6 bits of its fp16 d and dmin."""
    import numpy as np
    x = data.reshape(-1, 8, 32).astype(np.float32)                         # (super-blocks, sub-blocks, 32)
    low = np.minimum(x.min(-1), 0.0)                                         # (S, 8)
    step = (x.max(-1) - low) / 15
    d, dmin = (step.max(-1) / 63).astype(np.float16), (-low.min(-1) / 63).astype(np.float16)  # (S,)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(step / np.where(d32 > 0, d32, 1)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.where(dmin32 > 0, dmin32, 1)), 0, 63).astype(np.uint8)
    scale, offset = (d32 * sc)[..., None], (dmin32 * m)[..., None]          # (S, 8, 1)
    q = np.clip(np.round((x + offset) / np.where(scale > 0, scale, 1)), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4 << 6), m[:, :4] | (m[:, 4:] >> 4 << 6),
                             (sc[:, 4:] & 15) | (m[:, 4:] << 4)], axis=1)    # (S, 12)
    pairs = q.reshape(-1, 4, 2, 32)                                          # sub-blocks 2g (low nibble), 2g + 1
    nibbles = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, nibbles],
                            axis=1)
    return blocks.reshape(data.shape[0], -1)


def quantize_mxfp4(data):
    """float32 (..., k) -> (MXFP4 rows (..., k / 32 * 17) uint8 in ggml's block layout, the float32
    values they hold): each 32 weights' E8M0 scale the power of two that brings their largest to at
    most 6, each weight the nearest FP4 E2M1 code; a block is its scale byte, then byte j holding
    weight j's code in its low nibble and weight j + 16's in its high one."""
    import numpy as np

    from tokenmill.models.gpt_oss import FP4_VALUES
    table = np.array(FP4_VALUES)
    x = data.reshape(*data.shape[:-1], -1, 32).astype(np.float64)          # (..., G, 32)
    exponent = np.clip(np.ceil(np.log2(np.maximum(np.abs(x).max(-1), 1e-30) / 6.0)), -127, 127)  # (..., G)
    scale = np.exp2(exponent)[..., None]
    codes = np.abs((x / scale)[..., None] - table).argmin(-1).astype(np.uint8)  # (..., G, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)                           # (..., G, 16)
    raw = np.concatenate([(exponent + 127).astype(np.uint8)[..., None], qs], axis=-1)
    values = (table[codes] * scale).astype(np.float32)
    return raw.reshape(*data.shape[:-1], -1), values.reshape(data.shape)


def _save_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1", unk_token="w0")
    fast.chat_template = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
                          "{% if add_generation_prompt %}w4{% endif %}")
    fast.save_pretrained(str(path))


def save_byte_tokenizer(path: Path, vocab_size: int = VOCAB, special: tuple[str, ...] = ()) -> None:
    """A byte-level BPE tokenizer (GPT-2's kind: every text has a tokenization, and tokens are
    pieces of text), trained here on a few lines of JSON and prose; "<s>" is 0 and "</s>" 1, and
    the `special` tokens (such as Mistral's "[TOOL_CALLS]") 2 on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": true, "none": null}',
              "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
              "yes no maybe red green blue 0123456789 [1, 2, 3] {} () <> -+*/=_:;,.!?'"] * 4
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", *special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=list(special))
    fast.chat_template = ("{% if greeting is defined %}{{ greeting }}{% endif %}"  # a template variable
                          "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
                          "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                          "{% for c in m.get('tool_calls', []) %}<call>{{ c['function'] | tojson }}</call>{% endfor %}"
                          "</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    fast.save_pretrained(str(path))


def build_tiny_model(path: Path, arch: str, seed: int = 0, vocab_size: int = VOCAB, noise: float = 0.0,
                     byte_tokenizer: bool = False, **overrides) -> Path:
    """Save a random tiny model of `arch` (and its tokenizer) to `path`. noise > 0: perturb every
    weight by that relative amount (a draft model that mostly agrees with the seed-`seed` one).
    byte_tokenizer: a byte-level BPE tokenizer instead of the word-level one (tokens that are
    pieces of text, for grammars over the output text)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = (dict(TINY_CONFIGS[arch]) if arch in TINY_CONFIGS else {**_TINY_MOE_SHAPE, **TINY_MOE_CONFIGS[arch]}
             if arch in TINY_MOE_CONFIGS else dict(TINY_GEMMA_CONFIGS[arch]) if arch in TINY_GEMMA_CONFIGS
             else {"model_type": arch})  # others: transformers defaults
    model_type = extra.pop("model_type")
    options = dict(vocab_size=vocab_size, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                   bos_token_id=0, eos_token_id=1, initializer_range=0.2)
    options.update(extra)
    options.update(overrides)
    config = AutoConfig.for_model(model_type, **options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch in TINY_GEMMA_CONFIGS:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):  # Gemma's (1 + w): w is 0 at init
                    p.normal_(0.0, 0.5)
            # embeddings small enough that, times sqrt(hidden), they do not outweigh the layers: else
            # the tied head finds the last token's own row and greedy output repeats one token
            model.get_input_embeddings().weight.mul_(0.1)
    if noise:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise * p.std())
    model.save_pretrained(str(path), safe_serialization=True)
    (save_byte_tokenizer if byte_tokenizer else _save_tokenizer)(path, vocab_size)
    return path


def save_chat_template(path: Path, template: str) -> None:
    """Set the chat template of the tokenizer saved in `path` (a model family's own, for the
    messages and tool calls it writes)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(path))


def copy_model(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of the model directory `src` at `dst`, with config.json's keys changed as given."""
    import json
    import shutil
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # Phi-3's fused projections, kept fused
# Gemma's four norms a layer: llama.cpp's ffn_norm is the one before the MLP, as for Llama
_GEMMA_GGUF_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "pre_feedforward_layernorm": "ffn_norm",
                           "post_attention_layernorm": "post_attention_norm",
                           "post_feedforward_layernorm": "post_ffw_norm"}
# gpt-oss's norm before the experts, and its router (its sinks and experts: _gpt_oss_expert_tensors)
_GPT_OSS_GGUF_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                             "mlp.router": "ffn_gate_inp"}
# transformers' model_type -> llama.cpp's architecture (Mixtral: a llama with experts)
_GGUF_ARCHS = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3",
               "gpt_oss": "gpt-oss"}


def _gguf_metadata(w, c, head_dim: int) -> None:
    """The hyperparameters convert_hf_to_gguf.py writes for transformers config `c`."""
    from gguf import RopeScalingType
    rope = c.rope_parameters
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)


def _gemma_gguf_metadata(w, c) -> None:
    """The hyperparameters convert_hf_to_gguf.py's Gemma2Model and Gemma3Model write for config `c`:
    no query_pre_attn_scalar (llama.cpp derives the scale from head_dim), Gemma 2 no rope base and
    its soft caps, Gemma 3 its global layers' rope base and linear scaling and its sliding layers'
    base (rope.freq_base_swa)."""
    from gguf import RopeScalingType
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_key_length, c.head_dim),
                       (w.add_value_length, c.head_dim), (w.add_sliding_window, c.sliding_window)):
        add(value)
    if c.model_type == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        return
    full, local = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_freq_base_swa(local["rope_theta"])
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)


def _phi3_gguf_metadata(w, c) -> list[tuple[str, object]]:
    """The hyperparameters convert_hf_to_gguf.py's Phi3MiniModel writes for config `c` (the vocabulary
    size too, for files written without one): no key length, the rotating dims of a head as
    rope.dimension_count, the original context, sliding_window 0 where the config has none, and
    with LongRoPE the attention factor it derives; returns the rope factor tensors it adds,
    (name, float32 array) each."""
    import math

    import numpy as np
    rope = c.rope_parameters
    old_len = rope.get("original_max_position_embeddings") or c.original_max_position_embeddings
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_rope_freq_base, rope["rope_theta"]),
                       (w.add_rope_scaling_orig_ctx_len, old_len), (w.add_sliding_window, c.sliding_window or 0),
                       (w.add_vocab_size, c.vocab_size)):
        add(value)
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads)
    if not rope.get("long_factor"):
        return []
    scale = c.max_position_embeddings / old_len
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(old_len)) if scale > 1 else 1.0)
    return [(f"rope_factors_{k}.weight", np.array(rope[f"{k}_factor"], np.float32)) for k in ("long", "short")]


def _gpt_oss_gguf_metadata(w, c) -> None:
    """The hyperparameters convert_hf_to_gguf.py's GptOssModel writes for config `c` (TextModel's,
    YaRN's with its betas, then the window and the experts' width; no rope dimension count), and
    the vocabulary size, for files written without a vocabulary."""
    from gguf import RopeScalingType
    rope = c.rope_parameters
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_rope_freq_base, rope["rope_theta"]), (w.add_layer_norm_rms_eps, c.rms_norm_eps),
                       (w.add_expert_count, c.num_local_experts), (w.add_expert_used_count, c.num_experts_per_tok),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                       (w.add_sliding_window, c.sliding_window),
                       (w.add_expert_feed_forward_length, c.intermediate_size), (w.add_vocab_size, c.vocab_size)):
        add(value)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _gpt_oss_expert_tensors(name: str, data, block: str) -> list[tuple[str, str, object]] | None:
    """gpt-oss's tensors of layer `block` ("blk.L.") that GptOssModel converts by itself: gate_up
    (E, hidden, 2I), gate and up columns alternating, and its bias (E, 2I) into ffn_gate_exps and
    ffn_up_exps (E, I, hidden) and their (E, I) biases ("name:gate", "name:up"); down (E, I, hidden)
    transposed into ffn_down_exps (E, hidden, I); the sinks as attn_sinks.weight. None for others."""
    if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        kind = "bias" if name.endswith("_bias") else "weight"
        rows = data if kind == "bias" else data.swapaxes(1, 2)                 # (E, 2I[, hidden])
        return [(f"{name}:gate", f"{block}ffn_gate_exps.{kind}", rows[:, 0::2]),
                (f"{name}:up", f"{block}ffn_up_exps.{kind}", rows[:, 1::2])]
    if name.endswith("experts.down_proj"):
        return [(name, f"{block}ffn_down_exps.weight", data.swapaxes(1, 2))]
    if name.endswith("experts.down_proj_bias"):
        return [(name, f"{block}ffn_down_exps.bias", data)]
    if name.endswith("self_attn.sinks"):
        return [(name, f"{block}attn_sinks.weight", data)]
    return None


def _hf_values(name: str, values_of: dict, c):
    """The values the file holds of transformers tensor `name`, in its layout (None: not written):
    gate_up from its two halves (gpt-oss's alternating, and transposed back), gpt-oss's down
    transposed back."""
    import numpy as np
    if f"{name}:gate" not in values_of:
        values = values_of.get(name)
        return values.swapaxes(1, 2) if c.model_type == "gpt_oss" and name.endswith("experts.down_proj") else values
    gate, up = values_of[f"{name}:gate"], values_of[f"{name}:up"]
    if c.model_type != "gpt_oss":
        return np.concatenate([gate, up], axis=1)
    rows = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, *gate.shape[2:])  # (E, 2I[, hidden])
    return rows if rows.ndim == 2 else rows.swapaxes(1, 2)


def _gguf_vocabulary(w, tokens: list[str], chat_template: str | None) -> None:
    """A sentencepiece vocabulary as llama.cpp's converter writes Gemma's: `tokens` (with "<bos>",
    "<eos>", "<unk>" and "<pad>" among them), "<...>" tokens marked control, the template."""
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    for name in ("bos", "eos", "unk", "pad"):
        getattr(w, f"add_{name}_token_id")(tokens.index(f"<{name}>"))
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def _gguf_tensors(state: dict, c) -> list[tuple[str, str, object]]:
    """(our name in `state`, GGUF name, numpy array) of each tensor to write; a transformers model's
    merged experts (E, 2I, H) gate_up and (E, H, I) down become ffn_gate_exps, ffn_up_exps and
    ffn_down_exps (E, rows, cols), "name:gate" and "name:up" the two halves of gate_up; the shared
    expert's one-row gate a vector, as llama.cpp has it."""
    out = []
    for name, tensor in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        parts = name.split(".")
        block = f"blk.{parts[2]}." if parts[1] == "layers" else ""
        if c.model_type == "gpt_oss" and (converted := _gpt_oss_expert_tensors(name, tensor.numpy(), block)):
            out += converted
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.numpy().reshape(tensor.shape[0], 2, -1, tensor.shape[2]).swapaxes(0, 1)
            out += [(f"{name}:gate", f"blk.{parts[2]}.ffn_gate_exps.weight", gate),
                    (f"{name}:up", f"blk.{parts[2]}.ffn_up_exps.weight", up)]
            continue
        if name.endswith("mlp.experts.down_proj"):
            out.append((name, f"blk.{parts[2]}.ffn_down_exps.weight", tensor.numpy()))
            continue
        gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}.get(name)
        if gguf_name is None:
            names = (_GEMMA_GGUF_LAYER_NAMES if c.model_type in ("gemma2", "gemma3_text") else
                     _GPT_OSS_GGUF_LAYER_NAMES if c.model_type == "gpt_oss" else _GGUF_LAYER_NAMES)
            gguf_name = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
        data = tensor.numpy()
        out.append((name, gguf_name, data.reshape(-1) if ".shared_expert_gate." in name else data))  # a vector
    return out


def write_gguf_from_hf(model, path: Path, qtype: str = "F32", merged_experts: bool = True,
                       tokens: list[str] | None = None, chat_template: str | None = None,
                       expert_qtype: str | None = None, token_ids: dict[str, int] | None = None) -> None:
    """Write a transformers model as llama.cpp's convert_hf_to_gguf.py does (its metadata, llama's
    and Mixtral's q/k rows and biases permuted for interleaved rotary pairs, YaRN rope scaling,
    Phi-3's fused attn_qkv and ffn_up (gate then up) and LongRoPE factors as tensors,
    experts merged into one tensor per projection, or with `merged_experts` False one tensor per
    expert, blk.L.ffn_gate.E.weight, as older Mixtral files have them; Gemma's norms w written as
    1 + w, its tied head left out; gpt-oss's experts de-interleaved and biased, its sinks), matrices
    in `qtype` (F32, F16, a type gguf quantizes to, or Q4_K by quantize_q4_k), merged experts in
    `expert_qtype` (default `qtype`; MXFP4 by quantize_mxfp4), biases and routers in float32, with
    `tokens` a sentencepiece vocabulary, the chat template and `token_ids` (such as {"eot": 5},
    tokenizer.ggml.eot_token_id); then put the dequantized values back into `model`, which becomes
    the oracle for the file."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    c = model.config
    arch, heads, kv_heads = _GGUF_ARCHS.get(c.model_type, c.model_type), c.num_attention_heads, c.num_key_value_heads
    w = GGUFWriter(str(path), arch)
    gemma = c.model_type in ("gemma2", "gemma3_text")
    if gemma:
        _gemma_gguf_metadata(w, c)
    elif c.model_type == "phi3":
        for gguf_name, factors in _phi3_gguf_metadata(w, c):
            w.add_tensor(gguf_name, factors)
    elif c.model_type == "gpt_oss":
        _gpt_oss_gguf_metadata(w, c)
    else:
        _gguf_metadata(w, c, getattr(c, "head_dim", None) or c.hidden_size // heads)
    if tokens is not None:
        _gguf_vocabulary(w, tokens, chat_template)
    for name, token in (token_ids or {}).items():
        w.add_uint32(f"tokenizer.ggml.{name}_token_id", token)

    def permute(a, n: int, inverse: bool = False):
        if arch != "llama":
            return a
        shape = (n, a.shape[0] // n // 2, 2) if inverse else (n, 2, a.shape[0] // n // 2)
        return a.reshape(*shape, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    def write(gguf_name: str, data):
        """Add one tensor; returns the values the file holds."""
        kind = (expert_qtype or qtype) if "_exps.weight" in gguf_name else qtype
        if data.ndim == 1 or kind == "F32" or ".ffn_gate_inp" in gguf_name or gguf_name.endswith(".bias"):
            w.add_tensor(gguf_name, np.ascontiguousarray(data, np.float32))  # routers and biases stay float32
            return data
        if kind == "MXFP4":
            raw, values = quantize_mxfp4(data)
            w.add_tensor(gguf_name, raw, raw_dtype=GGMLQuantizationType.MXFP4)
            return values
        if kind == "F16":
            w.add_tensor(gguf_name, data.astype(np.float16))
            return data.astype(np.float16).astype(np.float32)
        data = np.ascontiguousarray(data)
        raw = quantize_q4_k(data) if kind == "Q4_K" else quantize(data, GGMLQuantizationType[kind])
        w.add_tensor(gguf_name, raw, raw_dtype=GGMLQuantizationType[kind])
        return dequantize(raw, GGMLQuantizationType[kind]).reshape(data.shape)

    state = model.state_dict()
    values_of = {}
    for name, gguf_name, data in _gguf_tensors(state, c):
        heads_of = heads if ".q_proj." in name else kv_heads if ".k_proj." in name else 0
        if heads_of:
            data = permute(data, heads_of)
        if "_exps." in gguf_name and not merged_experts:
            values = np.stack([write(gguf_name.replace("_exps.", f".{e}."), d) for e, d in enumerate(data)])
        elif gemma and name.endswith("norm.weight"):  # the converter adds Gemma's 1 to w
            write(gguf_name, data + 1)
            values = data
        else:
            values = write(gguf_name, data)
        values_of[name] = permute(values, heads_of, inverse=True) if heads_of else values
    with torch.no_grad():
        for name, tensor in state.items():
            values = _hf_values(name, values_of, c)
            if values is None:
                continue
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(values)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(autouse=True)
def main_thread_cpus():
    """Each test leaves the main thread's CPUs and torch's thread count as it found them: an
    engine a test steps by hand (not through LLM, which gives them back) leaves its thread as its
    thread governor last set it, pinned to one CPU or cut to one thread, and the next tests would
    run so, or skip where they need two CPUs."""
    cpus, threads = os.sched_getaffinity(0), torch_threads()
    yield
    if os.sched_getaffinity(0) != cpus:
        os.sched_setaffinity(0, cpus)
    if threads and torch_threads() != threads:
        sys.modules["torch"].set_num_threads(threads)


def torch_threads() -> int:
    """torch's intra-op thread count, where a test has imported torch (importing it costs seconds)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else 0


@pytest.fixture(scope="session", autouse=True)
def engine_device():
    """With TOKENMILL_TEST_DEVICE=cuda every engine a test builds without naming a device (nor a
    CPU-only option) runs on CUDA, in float32 (the dtype of the transformers oracle), with a 1 GiB
    KV pool unless the test sizes it (CUDA's default takes 85% of the free memory, which the
    engines a module holds would share ever more thinly): the suite, run on a GPU machine, checks
    the CUDA path."""
    device = os.environ.get("TOKENMILL_TEST_DEVICE")
    if not device:
        yield
        return
    from tokenmill.config import EngineConfig
    init = EngineConfig.__init__

    def on_device(self, *args, **kwargs):
        cpu_only = kwargs.get("attention_backend") == "cpu" or kwargs.get("kv_cache_dtype", "auto") != "auto"
        if not args and "model" in kwargs and "device" not in kwargs and not cpu_only:
            kwargs.update(device=device, dtype=kwargs.get("dtype", "float32"),
                          kv_cache_memory=kwargs.get("kv_cache_memory", 1 << 30))
        init(self, *args, **kwargs)

    EngineConfig.__init__ = on_device
    yield
    EngineConfig.__init__ = init


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch) for arch in TINY_CONFIGS}


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_moe")
    return {arch: build_tiny_model(root / arch, arch) for arch in TINY_MOE_CONFIGS}


@pytest.fixture(scope="session")
def tiny_gemma_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_gemma")
    return {arch: build_tiny_model(root / arch, arch) for arch in TINY_GEMMA_CONFIGS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_bytes(tmp_path_factory) -> Path:
    """A tiny llama with a byte-level BPE tokenizer (structured outputs: grammars over text)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_bytes") / "llama", "llama", byte_tokenizer=True)


# Let test modules import the fakes helper module beside them.
import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


def watch_chunked_prompts(engine) -> set[str]:
    """The ids of requests whose prompt a step of `engine` cut into chunks (a step that ends inside
    the prompt), filled in as the engine steps from now on."""
    chunked: set[str] = set()
    schedule = engine.scheduler.schedule

    def watched():
        sched = schedule()
        for request, n in zip(sched.requests, sched.num_scheduled_tokens):
            if request.num_computed_tokens + n < request.num_tokens:
                chunked.add(request.request_id)
        return sched
    engine.scheduler.schedule = watched
    return chunked


def hf_model(path, attn_implementation: str | None = None, **changes):
    """The transformers oracle of a model directory, in float32 (`changes`: config keys overridden)."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attn_implementation,
                                                **changes).eval()


def rel_err(a, b) -> float:
    """|a - b| / |b|, Frobenius norms."""
    return float((a - b).norm() / b.norm())


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (token 1 ends it, as in the tiny models)."""
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=1, pad_token_id=1)
    return out[0, len(prompt):].tolist()


def greedy_in_16_token_chunks(source, tokenizer, prompts: list[dict], num_kv_blocks: int) -> list[list[int]]:
    """The greedy 12 tokens of each prompt from the model at `source` (a directory or a GGUF file),
    its prompts cut in 16-token chunks (at least two of them seen chunked), four at a time."""
    from tokenmill import LLM, SamplingParams
    llm = LLM(str(source), tokenizer=str(tokenizer), max_num_seqs=4, max_num_batched_tokens=16,
              num_kv_blocks=num_kv_blocks, block_size=16, long_prefill_token_threshold=0)
    chunked = watch_chunked_prompts(llm.engine)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert len(chunked) >= 2
    return [out.outputs[0].token_ids for out in outputs]


def assert_short_prompt_logits(model, config, oracle, tokens: list[int]) -> None:
    """`model`'s logits over `tokens` (all but the last two a prompt in one step, then two decodes,
    on the "auto" backend at block size 16) within 1e-4 of transformers model `oracle`'s."""
    import torch

    from tokenmill.attention import make_backend
    backend = make_backend("auto", torch.device("cpu"), 16, config.head_dim)
    n = len(tokens)
    got = stepwise_logits(model, config, backend, tokens, n - 2, ((0, n - 2), (n - 2, n - 1), (n - 1, n)))
    with torch.no_grad():
        ref = oracle(torch.tensor([tokens])).logits[0]
    assert rel_err(got, ref) <= 1e-4, f"{rel_err(got, ref):.2e}"


def stepwise_logits(model, config, backend, tokens: list[int], prompt_len: int,
                    steps: tuple[tuple[int, int], ...]):
    """`model`'s logits at every position of `tokens`, its first `prompt_len` a prompt fed in the
    chunks `steps` names ((start, end) spans), the rest one token a step, through a ModelRunner
    over a paged pool and `backend`, as the engine runs them."""
    import torch

    from tokenmill.config import CacheConfig
    from tokenmill.kv_cache import KVCacheManager
    from tokenmill.model_runner import ModelRunner
    from tokenmill.request import Request
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker import ModelWorker
    device = torch.device("cpu")
    kv = KVCacheManager(num_blocks=32, block_size=16, enable_prefix_caching=False)
    runner = ModelRunner(ModelWorker(model, config, CacheConfig(32, 16), backend, device, torch.float32), seed=0)
    request = Request(request_id="a", prompt_token_ids=tokens[:prompt_len], params=SamplingParams(), max_tokens=8)
    logits = []
    for start, end in steps:
        if start >= prompt_len:
            request.token_ids.append(tokens[start])
        request.num_computed_tokens = start
        assert kv.allocate(request, end - start)
        inputs = runner.prepare([request], [end - start])
        with torch.inference_mode():
            logits.append(model.compute_logits(runner.worker.forward(inputs.input_ids, inputs.positions, inputs.meta)))
    return torch.cat(logits)
