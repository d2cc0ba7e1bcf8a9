"""The Llama-family decoder over a flat, ragged batch: Llama 2/3, SmolLM2, TinyLlama, Mistral,
Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each q/k head), all with GQA and RoPE; and their
mixture-of-experts kin, whose layers route to experts (moe.py) instead of one MLP: Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE (RMSNorm over all of q and of k) and gpt-oss (biases on every
attention projection, attention sinks, experts with biases and a clamped SwiGLU); Phi-3's rope; and
per-layer sliding-window attention (Mistral v0.1, Qwen2/3 with use_sliding_window, gpt-oss).

The model sees one flat batch of T tokens (every scheduled sequence's new tokens back
to back) and never a (batch, seq) grid: only attention needs to know where one
sequence ends, and it reads that from AttentionMetadata. q/k/v and gate/up are fused
into one matrix each at load time, so a layer runs four matrix products.

Inside a step the layers call their submodules' `.forward` directly, skipping nn.Module.__call__'s
hook handling, a cost paid on every call of every layer for nothing: no hooks are used on these
modules (BENCHMARKS.md has its measure). With the C++ CPU kernels, a step whose attention is all
in the kernel goes further and runs all the layers in one C++ call (`fused_stack`):
DecoderLayer.forward below stays the readable version of it, and the reference it is tested
against bit for bit.

This module is the model alone. How an instance stores its weights on a CPU (projections in
panels or GGUF blocks, embeddings in a GGUF file's rows, the one-call layers) is set up by
cpu_packing.py, through the attributes forward() reads: packed_lm_head, ops, fused_stack.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.config import ModelConfig, UnsupportedModel
from tokenmill.models.moe import AbsentExpert, ClampedSwiGLU, SparseMoeBlock, checkpoint_name
from tokenmill.models.ops import TorchOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_kind(scaling: dict | None) -> str:
    """A rope scaling's type, in transformers 5's key (rope_type) or 4's (type)."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Rotary inverse frequencies (head_dim / 2,), with Llama-3, linear or YaRN scaling when
    configured, or divided by a factor each (a GGUF file's rope_freqs, which is how llama.cpp stores
    Llama 3's)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float64, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors, the heads {inv_freq.numel()} frequencies")
        return inv_freq / factors
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":  # Qwen2.5/Qwen3 long context: as transformers' _compute_yarn_parameters
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

        def dim_at(rotations: float) -> float:
            """The frequency index that turns `rotations` times over the original context."""
            return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = dim_at(scaling.get("beta_fast") or 32), dim_at(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        index = torch.arange(head_dim // 2, dtype=torch.float64, device="cpu")
        ramp = ((index - low) / (high - low or 0.001)).clamp(0, 1)
        return inv_freq / factor * ramp + inv_freq * (1 - ramp)  # high frequencies kept, low ones interpolated
    if kind == "longrope":  # Phi-3: the short factors (Rotary switches to the long ones past the original context)
        return inv_freq / _longrope_factors(scaling)[0]
    raise UnsupportedModel(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn, "
                           "longrope, freq_factors)")


def longrope_angles(positions: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """LongRoPE's angles (Phi-3): each frequency divided by its short factor at positions inside the
    original context and by its long factor from there on. Transformers switches every position of
    a sequence to the long factors once the sequence outgrows the original context; with a KV cache
    the K of earlier positions keep what they were computed with, so here a position's angle depends
    on the position alone."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    short, long = _longrope_factors(scaling)
    if short.shape != inv_freq.shape or long.shape != inv_freq.shape:
        raise ValueError(f"longrope: {short.numel()} short and {long.numel()} long factors for {inv_freq.numel()} "
                         "rotary frequencies")
    inside = (positions < scaling["original_max_position_embeddings"]).unsqueeze(1)
    return torch.where(inside, torch.outer(positions, inv_freq / short), torch.outer(positions, inv_freq / long))


def _longrope_factors(scaling: dict) -> tuple[torch.Tensor, torch.Tensor]:
    if "short_factor" not in scaling or "long_factor" not in scaling:
        raise UnsupportedModel("unsupported rope scaling: longrope without short_factor and long_factor (GGUF files "
                               "keep them as tensors, which are read for phi3 files only)")
    return tuple(torch.tensor(scaling[k], dtype=torch.float64, device="cpu") for k in ("short_factor", "long_factor"))


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Where each of our head dims comes from in a checkpoint whose heads rotate only their first
    `rotary_dim` dims, pairing dim i with i + rotary_dim / 2 (Phi-4-mini). Our rotation pairs i with
    i + head_dim / 2 over the whole head; q and k rows reordered by this put the checkpoint's pairs on
    ours (the first rotary_dim / 2 of our pairs) and its unrotated dims on the rest, whose frequency
    is 0. q.k is unchanged by one order applied to both."""
    half, r, rest = head_dim // 2, rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(r)) + [rotary_dim + m for m in range(rest)]
    second = [r + m for m in range(r)] + [rotary_dim + rest + m for m in range(rest)]
    if len(first) != half or len(second) != half:
        raise ValueError(f"{rotary_dim} rotating dims of {head_dim}: rotary_dim and the rest must both be even")
    return torch.tensor(first + second)


def rope_attention_factor(scaling: dict | None) -> float:
    """What YaRN and LongRoPE scale cos and sin by (so q.k by its square), or the config's own
    attention_factor; 1 for every other scaling."""
    kind = rope_kind(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "longrope":  # sqrt(1 + ln(factor) / ln(original context)), as transformers
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    return get_mscale(mscale) / get_mscale(mscale_all_dim) if mscale and mscale_all_dim else get_mscale(1.0)


class Rotary(nn.Module):
    """Precomputed cos/sin per position; applied with the half-split layout Hugging Face uses."""

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict | None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.theta, self.scaling = head_dim, max_len, theta, scaling
        self.rotary_dim = rotary_dim or head_dim  # the rest turn at frequency 0 (partial_rotary_order)
        self.build()

    def build(self, device: torch.device | None = None) -> None:
        """(Re)compute the float32 tables, e.g. after the model was created on the meta device.
        Computed on the CPU whatever the default device: arange on the meta device goes through
        torch's Python reference ops, whose first use imports torch._dynamo (a second of startup)."""
        positions = torch.arange(self.max_len, dtype=torch.float64, device="cpu")
        if rope_kind(self.scaling) == "longrope":
            angles = longrope_angles(positions, self.rotary_dim, self.theta, self.scaling)
        else:
            angles = torch.outer(positions, rope_inv_freq(self.rotary_dim, self.theta, self.scaling))
        scale, unrotated = rope_attention_factor(self.scaling), (0, (self.head_dim - self.rotary_dim) // 2)
        cos = F.pad(angles.cos() * scale, unrotated, value=1.0)  # (max_len, D/2); unrotated dims pass as they are
        sin = F.pad(angles.sin() * scale, unrotated, value=0.0)
        self.register_buffer("cos", cos.float().to(device), persistent=False)
        self.register_buffer("sin", sin.float().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at each position, (T, D/2), cast once per step to the model's dtype."""
        return self.cos.index_select(0, positions).to(dtype), self.sin.index_select(0, positions).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale
        self.softcap = cfg.attn_softcap  # Gemma 2: the cap on the scores (None: none)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        if cfg.qk_norm_whole:  # OLMoE: one norm over all of q, one over all of k
            self.q_norm, self.k_norm = RMSNorm(self.q_size, cfg.rms_norm_eps), RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.window: int | None = None  # sliding window in tokens, set by the model from cfg.layer_windows
        # gpt-oss: each query head's sink logit (Hq,), kept in float32 for the attention backends
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, backend, ops) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)                          # (T, (Hq + 2 Hkv) * D)
        q, k, v = ops.rotary_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
                                 self.q_norm, self.k_norm)      # q/k RMSNorms first: Qwen3's, OLMoE's
        sinks = None if self.sinks is None else self.sinks.float()
        out = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.window, self.softcap,
                              sinks)                    # (T, Hq, D)
        return self.o_proj.forward(out.view(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.down_proj.forward(ops.silu_mul(self.gate_up_proj.forward(x)))


def feed_forward(cfg: ModelConfig, layer: int) -> MLP | SparseMoeBlock:
    """Layer `layer`'s feed-forward: routed experts where the config makes it sparse, else a dense MLP."""
    moe = cfg.moe
    if moe is None or not moe.is_sparse(layer):
        return MLP(cfg.hidden_size, cfg.intermediate_size)
    if moe.swiglu_limit is not None:  # gpt-oss
        experts = [ClampedSwiGLU(cfg.hidden_size, moe.expert_intermediate_size, moe.swiglu_limit, moe.swiglu_alpha)
                   if moe.holds(e) else AbsentExpert() for e in range(moe.num_experts)]
        return SparseMoeBlock(moe, cfg.hidden_size, experts)
    experts = [MLP(cfg.hidden_size, moe.expert_intermediate_size) if moe.holds(e) else AbsentExpert()
               for e in range(moe.num_experts)]
    shared = MLP(cfg.hidden_size, moe.shared_expert_intermediate_size) if moe.shared_expert_intermediate_size else None
    return SparseMoeBlock(moe, cfg.hidden_size, experts, shared)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = feed_forward(cfg, layer)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta, backend, ops):
        """Pre-norm block. The residual stream is carried separately so that each add fuses
        with the norm that follows it. Returns (block output, residual stream)."""
        h, residual = ops.add_rms_norm(x, residual, self.input_layernorm)
        h = self.self_attn.forward(h, cos, sin, k_cache, v_cache, meta, backend, ops)
        h, residual = ops.add_rms_norm(h, residual, self.post_attention_layernorm)
        return self.mlp.forward(h, ops), residual


# Hugging Face checkpoint names that map into a fused parameter: (our name, shard index). gate_proj
# and up_proj stand alone: the dense MLP's, each expert's (mlp.experts.3.gate_proj) and the shared one's.
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _checkpoint_name(name: str, shard: int) -> str:
    """A parameter shard by the checkpoint's own name (layers.0.self_attn.k_proj.weight, not the
    fused qkv_proj it is loaded into)."""
    for hf_name, (ours, index) in FUSED.items():
        if f".{ours}." in f".{name}" and index == shard:
            return name.replace(ours, hf_name)
    return name


class LlamaForCausalLM(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer  # what each layer is (gemma.py's model sets its own)

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.config = cfg
        # not randomly initialised (the checkpoint overwrites it; normal_ on the meta device would
        # import torch._dynamo, see Rotary.build)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        for i, layer in enumerate(self.layers):
            layer.self_attn.window = cfg.window(i)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
        self.packed_lm_head: nn.Module | None = None  # set by cpu_packing.pack_for_cpu
        self.ops = TorchOps()                         # element-wise steps; fused ones set by the loader
        self.fused_layers: list | None = None         # each layer as one C++ object (cpu_packing.fuse_layers)
        self.fused_stack = None                       # and all of them, run in one call

    def build_rotary(self, device: torch.device) -> None:
        """(Re)compute the rotary tables on `device` (after the model was created on the meta device)."""
        self.rotary.build(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend) -> torch.Tensor:
        """input_ids, positions: (T,). Returns the final hidden states (T, hidden)."""
        x, residual = self.embed_tokens(input_ids), None
        cos, sin = self.rotary(positions, x.dtype)
        in_kernel = backend.name == "cpu" and backend.all_in_kernel(meta)  # what a fused layer can run
        if in_kernel and self.fused_stack is not None:
            return self.fused_stack.forward(x, cos, sin, [k for k, _ in kv_caches], [v for _, v in kv_caches],
                                            meta.slot_block, meta.slot_offset, meta.block_tables,
                                            meta.query_start_loc, meta.seq_lens)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer.forward(x, residual, cos, sin, k_cache, v_cache, meta, backend, self.ops)
        return self.ops.add_rms_norm(x, residual, self.norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32, only for the positions that sample."""
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; raise on anything missing."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int]] = set()
        for name, tensor in weights:
            name = checkpoint_name(name.removeprefix("model."))
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            target, shard = name, None
            for hf_name, (ours, index) in FUSED.items():
                if f".{hf_name}." in f".{name}":
                    target, shard = name.replace(hf_name, ours), index
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[target]
            dest = param if shard is None else self._shard(param, target, shard)
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"model expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add((target, shard if shard is not None else 0))
        expected = {(n, i) for n, p in params.items() for i in range(self._num_shards(n))}
        if missing := sorted(expected - loaded):
            raise ValueError(f"checkpoint is missing weights: {[_checkpoint_name(*m) for m in missing][:8]}")

    def _num_shards(self, name: str) -> int:
        return 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else 1

    def _shard(self, param: torch.Tensor, name: str, index: int) -> torch.Tensor:
        cfg = self.config
        if "qkv_proj" in name:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            sizes = [q, kv, kv]
        else:  # gate and up: the dense MLP's, an expert's or the shared expert's
            sizes = [param.shape[0] // 2] * 2
        return param.narrow(0, sum(sizes[:index]), sizes[index])
