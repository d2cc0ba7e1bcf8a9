"""Gemma 2 and Gemma 3, text only (Gemma3ForCausalLM, or the language model of a multimodal
Gemma3ForConditionalGeneration checkpoint: loader.py reads its text_config and skips its vision
tower), over the same flat, ragged batch as the Llama family, whose attention, rotary tables, fused
projections and loading they reuse.

What differs from a Llama layer, as transformers' modeling_gemma2.py and modeling_gemma3.py have it:

    embeddings      multiplied by sqrt(hidden_size), that factor first rounded to the model's dtype
    RMSNorm         scales by (1 + w): the weights arrive as 1 + w, so every norm runs as a plain
                    RMSNorm (loader.hf_unfused adds the 1 to a Hugging Face checkpoint's w, in
                    float32; llama.cpp's converter has added it to a GGUF file's)
    layer           four norms, around both blocks ("sandwich"):
                        x = x + post_attention_norm(attn(input_norm(x)))
                        x = x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))
    MLP             GeGLU: GELU (tanh approximation) of the gate, times up
    attention       scores scaled by query_pre_attn_scalar ** -0.5; head_dim its own (not
                    hidden / heads); sliding and global layers interleave (config.layer_windows)
    Gemma 2         scores soft-capped (c * tanh(s / c), attn_logit_softcapping) before the
                    softmax, which every attention backend but Triton's does (make_backend picks
                    torch for such a model on CUDA); output logits capped the same way
                    (final_logit_softcapping)
    Gemma 3         RMSNorm on each q and k head (also 1 + w); the sliding layers rotate with their
                    own base (rope_local_base_freq, unscaled), the global ones with rope_theta and
                    its scaling; no soft-capping of scores (transformers passes none)

The embeddings are tied to the output head in every released checkpoint (the model follows
tie_word_embeddings either way). Only the torch element-wise ops run GeGLU (ops.gelu_tanh_mul), and
the one-call C++ layer stack (cpu_packing.fuse_layers) is for Llama layers only, so on a CPU these
layers run in Python around the packed projections.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.config import ModelConfig
from tokenmill.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm, Rotary

GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")  # model_type values this module serves


class GeGLUMLP(MLP):
    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.down_proj.forward(ops.gelu_tanh_mul(self.gate_up_proj.forward(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GeGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta, backend, ops):
        """Sandwich-norm block. As in the Llama layer, the residual stream is carried separately
        so that each add fuses with the norm after it; a block's own output norm takes no residual.
        Returns (block output, residual stream)."""
        h, residual = ops.add_rms_norm(x, residual, self.input_layernorm)
        h = self.self_attn.forward(h, cos, sin, k_cache, v_cache, meta, backend, ops)
        h = ops.add_rms_norm(h, None, self.post_attention_layernorm)[0]
        h, residual = ops.add_rms_norm(h, residual, self.pre_feedforward_layernorm)
        h = self.mlp.forward(h, ops)
        return ops.add_rms_norm(h, None, self.post_feedforward_layernorm)[0], residual


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__(cfg, max_len)
        # Gemma 3's sliding layers rotate with their own base, unscaled; None: one table for all
        self.local_rotary = (None if cfg.local_rope_theta is None else
                             Rotary(cfg.head_dim, max_len, cfg.local_rope_theta, None))
        self.embed_scale = cfg.hidden_size ** 0.5

    def build_rotary(self, device: torch.device) -> None:
        super().build_rotary(device)
        if self.local_rotary is not None:
            self.local_rotary.build(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend) -> torch.Tensor:
        """input_ids, positions: (T,). Returns the final hidden states (T, hidden)."""
        x = self.embed_tokens(input_ids)                                      # (T, hidden)
        # sqrt(hidden) rounded to float32 and then to the model's dtype, as transformers scales
        x = x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype).item()
        global_cos_sin = self.rotary(positions, x.dtype)
        local_cos_sin = global_cos_sin if self.local_rotary is None else self.local_rotary(positions, x.dtype)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            cos, sin = local_cos_sin if layer.self_attn.window is not None else global_cos_sin
            x, residual = layer.forward(x, residual, cos, sin, k_cache, v_cache, meta, backend, self.ops)
        return self.ops.add_rms_norm(x, residual, self.norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32; Gemma 2's logits capped to (-c, c) by c * tanh(l / c)."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
