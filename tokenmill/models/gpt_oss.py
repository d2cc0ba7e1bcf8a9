"""OpenAI's gpt-oss (model_type gpt_oss) read from a Hugging Face directory, as transformers'
modeling_gpt_oss.py defines it. The model is the Llama-family decoder (llama.py) with:

    attention       biases on q, k, v and o; a learned sink logit per query head in each softmax
                    (self_attn.sinks); every second layer from the first slides over sliding_window
                    tokens (config.layer_types); YaRN rope
    feed-forward    a mixture of experts (moe.py): a router with a bias, the k largest logits and a
                    softmax over those k; experts with biases and a clamped SwiGLU (moe.ClampedSwiGLU)

This module reads the config's fields for those, and turns the checkpoint's expert tensors, all
of a layer's experts in one tensor each, into the per-expert names the model loads:

    mlp.router.{weight,bias}                  -> mlp.gate.{weight,bias}
    mlp.experts.gate_up_proj  (E, hidden, 2I)  -> mlp.experts.e.{gate,up}_proj.weight  (I, hidden) each
    mlp.experts.gate_up_proj_bias  (E, 2I)    -> mlp.experts.e.{gate,up}_proj.bias    (I,) each
    mlp.experts.down_proj     (E, I, hidden)   -> mlp.experts.e.down_proj.weight      (hidden, I)
    mlp.experts.down_proj_bias  (E, hidden)   -> mlp.experts.e.down_proj.bias

The fused gate_up interleaves its columns: even ones are the gate's, odd ones the up's.

Released checkpoints store the experts' two matrices in MXFP4 (quantization_config quant_method
mxfp4): `{gate_up,down}_proj_blocks` (E, N, K / 32, 16) uint8 and `_scales` (E, N, K / 32) uint8,
each matrix in the (out, in) layout of a linear layer. A block is 32 values of 4 bits (FP4 E2M1,
two a byte, the low nibble first) sharing a scale byte s that means 2^(s - 127) (E8M0). On the CPU
with the panel kernel they stay in their blocks: mxfp4_weight_blocks gives each expert's gate, up
and down rows in ggml's block layout (ggml_mxfp4_rows: the layout GGUF files store, which
gguf_loader.py gives the kernel the same way), read one expert at a time when packed. Elsewhere
they are dequantized at load to float32 (then the model's dtype), as are a GGUF file's
(dequantize_ggml_mxfp4).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from tokenmill.config import ModelConfig, MoEConfig, UnsupportedModel
from tokenmill.models.packed_linear import GGUFMatrix

# transformers' defaults (GptOssConfig) for what a config.json may leave out
GPT_OSS_DEFAULTS = {"head_dim": 64, "sliding_window": 128, "rms_norm_eps": 1e-5, "attention_bias": True,
                    "max_position_embeddings": 131072, "num_experts_per_tok": 4, "swiglu_limit": 7.0,
                    "swiglu_alpha": 1.702}
GPT_OSS_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096}
GPT_OSS_DEFAULT_THETA = 150000.0

# The 16 values of an FP4 E2M1 code (sign bit, 2 exponent bits, 1 mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def gpt_oss_config(cfg: dict) -> dict:
    """A gpt-oss config.json with transformers' defaults filled in (rope: YaRN over a 4,096-token
    original context; theta 150,000 where neither config.json's top level nor its rope_parameters
    name one)."""
    cfg = {**GPT_OSS_DEFAULTS, **cfg}
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        cfg["rope_parameters"] = dict(GPT_OSS_DEFAULT_ROPE)
    if cfg.get("rope_theta") is None and "rope_theta" not in (cfg.get("rope_parameters") or {}):
        cfg["rope_theta"] = GPT_OSS_DEFAULT_THETA
    return cfg


def gpt_oss_moe(cfg: dict) -> MoEConfig:
    """The experts of a gpt-oss config (gpt_oss_config's)."""
    return MoEConfig(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
                     norm_topk_prob=False, router_bias=True, softmax_after_topk=True,
                     swiglu_limit=float(cfg["swiglu_limit"]), swiglu_alpha=float(cfg["swiglu_alpha"]))


def gpt_oss_fields(cfg: dict) -> dict:
    """The ModelConfig fields of a gpt-oss config (gpt_oss_config's) beyond the Llama family's and
    its experts'; a quantization other than MXFP4 refused by name."""
    quant = cfg.get("quantization_config")
    if quant is not None and quant.get("quant_method") != "mxfp4":
        raise UnsupportedModel(f"unsupported quantization_config quant_method {quant.get('quant_method')!r} for "
                               "gpt_oss (supported: mxfp4, or none)")
    if not cfg["attention_bias"]:
        raise UnsupportedModel("unsupported gpt_oss variant: attention_bias = False (supported: True)")
    return {"attention_bias": True, "o_proj_bias": True, "attention_sinks": True}


def _fp4_times_scale(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP4 codes (..., G, 32) and E8M0 scale bytes (..., G) -> (..., G * 32) float32: each code's
    value (FP4_VALUES) times 2^(scale - 127)."""
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)[codes.int()].flatten(-2)   # (..., G * 32)
    exponents = (scales.int() - 127).repeat_interleave(32, dim=-1)                    # (..., G * 32)
    return torch.ldexp(values, exponents)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 (..., G, 16) uint8 blocks and (..., G) uint8 scales -> (..., G * 32) float32: value
    2i of a block from byte i's low nibble, 2i + 1 from its high one, times 2^(scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype}: expected uint8 (..., G, 16) and (..., G)")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)      # (..., G, 32)
    return _fp4_times_scale(codes, scales)


def dequantize_ggml_mxfp4(rows: torch.Tensor) -> torch.Tensor:
    """MXFP4 rows as a GGUF file stores them (ggml's block_mxfp4, type 39), (..., G * 17) uint8
    -> (..., G * 32) float32. A block of 32 values is its E8M0 scale byte, then 16 bytes whose low
    nibbles are values 0-15 and high nibbles values 16-31 (Q4_0's order, not the Hugging Face
    checkpoints' pairs). ggml's table holds twice FP4_VALUES and its scale is 2^(scale - 128):
    the same products as FP4_VALUES times 2^(scale - 127), which this computes."""
    if rows.dtype != torch.uint8 or rows.shape[-1] % 17:
        raise ValueError(f"MXFP4 rows {tuple(rows.shape)} {rows.dtype}: expected uint8 (..., G * 17)")
    blocks = rows.reshape(*rows.shape[:-1], -1, 17)                             # (..., G, 17)
    qs = blocks[..., 1:]                                                        # (..., G, 16)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)                             # (..., G, 32)
    return _fp4_times_scale(codes, blocks[..., 0])


def ggml_mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hugging Face MXFP4 (..., G, 16) uint8 blocks and (..., G) uint8 scales -> the same values as
    ggml's block_mxfp4 rows (..., G * 17) uint8, which dequantize_ggml_mxfp4 and the panel kernel
    read: per block the scale byte, then byte j holding value j's code in its low nibble and value
    j + 16's in its high one (the checkpoint's byte i holds values 2i and 2i + 1)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype}: expected uint8 (..., G, 16) and (..., G)")
    # ggml's byte 2m holds values 2m and 2m + 16: the low nibbles of the checkpoint's bytes m and
    # m + 8; its byte 2m + 1 values 2m + 1 and 2m + 17: their high nibbles
    first, second = blocks[..., :8], blocks[..., 8:]                           # (..., G, 8) each
    rows = np.empty((*blocks.shape[:-1], 17), dtype=np.uint8)                  # (..., G, 17)
    rows[..., 0] = scales
    rows[..., 1::2] = (first & 0x0F) | (second << 4)
    rows[..., 2::2] = (first >> 4) | (second & 0xF0)
    return rows.reshape(*blocks.shape[:-2], -1)                                # (..., G * 17)


def check_mxfp4_scales(rows: np.ndarray, name: str) -> None:
    """MXFP4 rows (N, G * 17) as the panel kernel decodes them: each value FP4 times the float
    whose bits are the scale byte e << 23, 2^(e - 127) for e from 1 to 254. A block with a nonzero
    value and e = 0 (values below float32's normal range, which the kernel would take as 0) or any
    block with e = 255 (E8M0's NaN) is refused naming the tensor."""
    blocks = rows.reshape(-1, 17)
    e = blocks[:, 0]
    suspect = np.flatnonzero((e == 0) | (e == 255))                            # the codes read only there
    bad = suspect[(e[suspect] == 255) | (blocks[suspect, 1:] & 0x77).any(-1)]
    if bad.size:
        raise ValueError(f"{name}: an MXFP4 block's scale byte is {int(e[bad[0]])} (0 with nonzero values, or 255: "
                         "NaN), which the CPU kernel does not decode")


# each expert matrix a checkpoint stores in MXFP4: (our matrix, its rows of the checkpoint's: the
# gate_up's interleaved even and odd ones, or all)
_MXFP4_PARTS = {"gate_up_proj": (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))),
                "down_proj": (("down_proj", slice(None)),)}


def mxfp4_expert_names(name: str, num_experts: int) -> list[str]:
    """The per-expert weight names checkpoint tensor `name` holds when it is an expert matrix's
    MXFP4 blocks or scales (model.layers.0.mlp.experts.gate_up_proj_blocks ->
    model.layers.0.mlp.experts.{0..E-1}.{gate,up}_proj.weight); [] for any other tensor."""
    prefix, sep, kind = name.partition("mlp.experts.")
    matrix = kind.removesuffix("_blocks").removesuffix("_scales")
    if not sep or matrix == kind or matrix not in _MXFP4_PARTS:
        return []
    return [f"{prefix}mlp.experts.{e}.{part}.weight" for e in range(num_experts) for part, _ in _MXFP4_PARTS[matrix]]


def _expert_rows(blocks_at: tuple[Path, str], scales_at: tuple[Path, str], expert: int, rows: slice,
                 name: str) -> torch.Tensor:
    """Rows `rows` of one expert's MXFP4 matrix, read from the safetensors files holding its blocks
    and scales ((file, tensor name) each), as ggml_mxfp4_rows lays them out, scales checked."""
    from safetensors import safe_open
    parts = []
    for file, tensor in (blocks_at, scales_at):
        with safe_open(str(file), framework="numpy") as f:
            parts.append(f.get_slice(tensor)[expert, rows])             # (N, G, 16) blocks, (N, G) scales
    out = ggml_mxfp4_rows(*parts)
    check_mxfp4_scales(out, name)
    return torch.from_numpy(out)


def mxfp4_weight_blocks(files: list[Path], cfg: ModelConfig, wanted: Callable[[str], bool]) -> dict[str, GGUFMatrix]:
    """Every expert matrix a gpt-oss checkpoint (its safetensors `files`) stores in MXFP4, as the
    panel kernel reads it: our per-expert name (those `wanted`) -> a GGUFMatrix of kind MXFP4 whose
    rows (N, G * 17) are read from the files when it is packed, one expert at a time. A matrix of
    another shape than the config's, or blocks without their scales, is refused naming it."""
    from safetensors import safe_open
    where, shapes = {}, {}
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                if mxfp4_expert_names(name, 1):
                    where[name], shapes[name] = file, tuple(f.get_slice(name).get_shape())
    hidden, inter, experts = cfg.hidden_size, cfg.moe.expert_intermediate_size, cfg.moe.num_experts
    out = {}
    for name in (n for n in where if n.endswith("_blocks")):
        matrix = name.partition("mlp.experts.")[2].removesuffix("_blocks")
        scales = name.removesuffix("_blocks") + "_scales"
        rows, cols = (2 * inter, hidden) if matrix == "gate_up_proj" else (hidden, inter)
        if shapes[name] != (experts, rows, cols // 32, 16) or shapes.get(scales) != (experts, rows, cols // 32):
            raise ValueError(f"{name.removesuffix('_blocks')}: MXFP4 blocks {shapes[name]} and scales "
                             f"{shapes.get(scales)}, expected ({experts}, {rows}, {cols // 32}, 16) and "
                             f"({experts}, {rows}, {cols // 32})")
        names = iter(mxfp4_expert_names(name, experts))
        for expert in range(experts):
            for _, part_rows in _MXFP4_PARTS[matrix]:
                ours = next(names)
                if wanted(ours):
                    read = functools.partial(_expert_rows, (where[name], name), (where[scales], scales), expert,
                                             part_rows, ours)
                    out[ours] = GGUFMatrix("MXFP4", len(range(rows)[part_rows]), read, cols)
    return out


def _expert_tensors(prefix: str, kind: str, experts: Iterable[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's fused expert tensor `kind` (gate_up_proj, down_proj or their _bias), given expert
    by expert, under our per-expert names; a weight in the (out, in) layout of a linear layer."""
    for e, part in enumerate(experts):
        name = f"{prefix}mlp.experts.{e}."
        if kind == "gate_up_proj":                                             # (2I, hidden), interleaved rows
            yield name + "gate_proj.weight", part[0::2]
            yield name + "up_proj.weight", part[1::2]
        elif kind == "gate_up_proj_bias":
            yield name + "gate_proj.bias", part[0::2]
            yield name + "up_proj.bias", part[1::2]
        elif kind == "down_proj":
            yield name + "down_proj.weight", part
        elif kind == "down_proj_bias":
            yield name + "down_proj.bias", part
        else:
            raise ValueError(f"unexpected weight {prefix}mlp.experts.{kind!r} in checkpoint")


def gpt_oss_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors under the names the model loads (the module docstring's table), MXFP4
    expert matrices dequantized one expert at a time. A matrix's blocks wait for its scales (or
    the other way round), which may come from another shard."""
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        prefix, sep, kind = name.partition("mlp.experts.")
        if not sep:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        if kind.endswith(("_blocks", "_scales")):
            matrix, part = kind.rsplit("_", 1)
            other = waiting.pop(f"{prefix}mlp.experts.{matrix}_{'scales' if part == 'blocks' else 'blocks'}", None)
            if other is None:
                waiting[name] = tensor
                continue
            blocks, scales = (tensor, other) if part == "blocks" else (other, tensor)
            if blocks.shape[:-1] != scales.shape:
                raise ValueError(f"{prefix}mlp.experts.{matrix}: MXFP4 blocks {tuple(blocks.shape)} do not match "
                                 f"scales {tuple(scales.shape)}")
            yield from _expert_tensors(prefix, matrix, (dequantize_mxfp4(b, s) for b, s in zip(blocks, scales)))
        elif kind in ("gate_up_proj", "down_proj"):                            # (E, in, out): transposed
            yield from _expert_tensors(prefix, kind, tensor.transpose(1, 2))
        else:
            yield from _expert_tensors(prefix, kind, tensor)
    if waiting:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {sorted(waiting)[:4]}")
