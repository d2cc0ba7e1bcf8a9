"""Engine configuration: frozen dataclasses, validated once, ValueError on bad input.

`EngineConfig` is the one flat object a user fills in (the names follow vLLM's
where it has one). The engine resolves what depends on the model and the
machine (pool size, context length) and hands each layer only the slice it
needs: `SchedulerConfig` to the scheduler, `CacheConfig` to the block pool.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
               "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
               "tb": 1000**4, "tib": 1024**4}

SCHEDULING_POLICIES = ("fcfs", "priority", "srpf", "edf")
PREEMPTION_MODES = ("recompute", "swap")
KV_ROLES = ("prefill", "decode", "both")
KV_CONNECTORS = ("shared_storage", "nixl")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"auto": None, "half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "fp32": "float32"}  # vLLM's names (auto: float32 on CPU, bfloat16 on CUDA)
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "int8")


def parse_size(value: int | str, name: str) -> int:
    """Bytes from an int or a string such as "2GiB", "512 MB" or "1.5g"; errors name the setting `name`."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected bytes or a size string, got {value!r}")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{name}: cannot parse size {value!r} (try '2GiB' or 2147483648)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward: a router picks `top_k` of `num_experts` SwiGLU experts
    for each token and sums their outputs, weighted by its softmax probabilities."""

    num_experts: int
    top_k: int                            # experts per token
    expert_intermediate_size: int         # each routed expert's SwiGLU width
    norm_topk_prob: bool                  # the top-k probabilities renormalised to sum to 1
    float32_weights: bool = False         # Mixtral: outputs scaled by the float32 weights (else cast first)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an expert every token runs, scaled by a
                                          # sigmoid gate; 0: none
    dense_layers: tuple[int, ...] = ()    # layers with a dense MLP (ModelConfig.intermediate_size) instead
    held_experts: tuple[int, int] | None = None  # a tensor-parallel rank's experts, [first, end); None: all
    router_bias: bool = False             # gpt-oss: the router's linear layer has a bias
    softmax_after_topk: bool = False      # gpt-oss: the k largest logits, softmax over those k alone
                                          # (else softmax over every expert, then the k most probable)
    swiglu_limit: float | None = None     # gpt-oss: experts with biases and a clamped SwiGLU
                                          # (moe.ClampedSwiGLU), gate clamped above and up both
                                          # ways at this; None: plain SwiGLU experts without biases
    swiglu_alpha: float = 1.702           # gpt-oss: the gain of that SwiGLU's sigmoid

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"model config: swiglu_limit must be positive or None, got {self.swiglu_limit}")
        if self.top_k > self.num_experts:
            raise ValueError(f"model config: num_experts_per_tok ({self.top_k}) exceeds num_experts "
                             f"({self.num_experts})")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` routes to experts (else it has a dense MLP)."""
        return layer not in self.dense_layers

    def holds(self, expert: int) -> bool:
        """Whether this process holds expert `expert`'s weights (all of them but under expert parallelism)."""
        return self.held_experts is None or self.held_experts[0] <= expert < self.held_experts[1]


@dataclass(frozen=True)
class EncoderConfig:
    """A bidirectional encoder (BERT): each prompt's tokens attend to all of that prompt, so the
    model serves embeddings only, each prompt run whole in one step. Read from config.json and,
    in a sentence-transformers directory, from its modules (models/bert.py)."""

    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2
    gelu_approximate: str = "none"  # F.gelu's `approximate`: "none" (hidden_act "gelu", erf) or "tanh"
    pooling: str = "cls"            # the checkpoint's pooling: "cls", "mean" or "last"
    normalize: bool = True          # the checkpoint L2-normalises its vectors

    def __post_init__(self) -> None:
        if self.pooling not in ("cls", "mean", "last"):
            raise ValueError(f"encoder config: pooling must be cls, mean or last, got {self.pooling!r}")
        if self.gelu_approximate not in ("none", "tanh"):
            raise ValueError(f"encoder config: gelu_approximate must be none or tanh, got {self.gelu_approximate!r}")


class UnsupportedModel(ValueError):
    """A model's config or file asks for what tokenmill does not run (an architecture, a variant,
    an option): named as such, not taken for a broken file."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer (or of an encoder, with `encoder`), read from
    config.json or GGUF metadata."""

    architecture: str                  # "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # Llama-3 style {"rope_type": "llama3", "factor": ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False       # Qwen2: bias on q, k, v projections
    qk_norm: bool = False              # Qwen3: RMSNorm on each head of q and k
    rotary_dim: int | None = None      # dims of each head that rotate (Phi-4-mini: 3/4); None: all of them
    qk_norm_whole: bool = False        # OLMoE: RMSNorm over all of q and all of k, before the heads split
    moe: MoEConfig | None = None       # mixture-of-experts feed-forward (None: a dense MLP in every layer)
    encoder: EncoderConfig | None = None  # a bidirectional encoder (BERT), which serves embeddings only
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layer_windows: tuple[int | None, ...] = ()  # per layer: the query at position p sees keys
                                       # p - w + 1 .. p (w tokens, itself included); None: all of
                                       # 0 .. p. Empty: every layer global
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power (None: head_dim's)
    attn_softcap: float | None = None  # Gemma 2: attention scores s become c * tanh(s / c) before the softmax
    final_softcap: float | None = None  # Gemma 2: the same cap on the output logits
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' rotary base, unscaled (None: as global)
    o_proj_bias: bool = False          # gpt-oss: a bias on the attention's output projection too
    attention_sinks: bool = False      # gpt-oss: a learned logit per query head (self_attn.sinks) joins
                                       # each softmax's denominator, taking mass but adding no value

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"model config: layer_windows has {len(self.layer_windows)} entries for "
                             f"{self.num_layers} layers")
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ValueError(f"model config: layer_windows must be positive or None, got {self.layer_windows}")
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "local_rope_theta"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"model config: {name} must be positive or None, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window in tokens, None for a global layer."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_window(self) -> int | None:
        """How many of a sequence's newest tokens any layer still reads, when every layer has a
        window (the widest); None when a layer is global and so every token stays needed."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(self.layer_windows)

    @property
    def kv_elements_per_token(self) -> int:
        """K and V for one token across all layers, in elements (the pool's bytes: worker.kv_bytes_per_token)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class EngineConfig:
    """Everything a user can set. `None` means "derive a sane default from the model and machine"."""

    model: str | None = None                 # HF directory, .gguf file, or None for the default model
    max_num_seqs: int = 256                  # most sequences in one step
    max_num_batched_tokens: int = 512        # per-step token budget (decodes + prompt chunks)
    max_model_len: int | None = None         # prompt + output; default: the model's context length
    long_prefill_token_threshold: int | None = None  # a prompt longer than this gets small chunks while
                                             # others decode (default: max_num_batched_tokens; 0: off)
    block_size: int = 16                     # tokens per KV block
    kv_cache_memory: int | str | None = None  # KV pool size in bytes or "2GiB"
    num_kv_blocks: int | None = None         # exact pool size in blocks (overrides kv_cache_memory)
    dtype: str | None = None                 # unset: on the CPU float32 activations, with bfloat16 weights
                                             # in the products where the kernels have AVX512-BF16
                                             # (bf16_weights_choice) and 8-bit x for GGUF blocks where
                                             # they have VNNI (int8_rows_choice); bfloat16 on CUDA.
                                             # "float32": the CPU's exact path
    kv_cache_dtype: str = "auto"             # "auto": the model's dtype; "float16" or "bfloat16" (CPU):
                                             # half the KV bytes to store and read, values rounded to
                                             # 11 bits (and held within +-65504) or to 8 bits; "int8"
                                             # (CPU kernels): 8-bit codes and a scale per token and head
    device: str = "cpu"                      # "cpu" or "cuda"
    seed: int | None = 0                     # seeds the sampler for requests without their own seed
                                             # (None: a random one, drawn here)
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    kv_watermark: float = 0.01               # share of the pool kept free when admitting
    preemption_mode: str = "recompute"      # "swap": copy a victim's blocks to host memory and back
    swap_space: int | str = "4GiB"           # host pool for preemption_mode="swap"
    static_batching: bool = False            # baseline mode for benchmarks: admit a batch only when empty
    attention_backend: str = "auto"          # "auto", "reference", "cpu", "torch", "triton" (CUDA)
    kernels: str = "auto"                    # "auto": packed projections (C++ panel GEMM) and fused C++
                                             # ops on CPU float32, Triton element-wise kernels on CUDA;
                                             # "torch": plain torch ops (the reference)
    gguf_blocks: bool = True                 # CPU: GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q3-6_K projections stay in blocks,
                                             # decoded in the kernel (bit-identical results, a fifth of
                                             # the memory), as do MXFP4 experts (GGUF or Hugging Face
                                             # gpt-oss); False: dequantized to float32 panels
    gguf_int8_rows: int | None = None        # CPU, GGUF blocks: the layers' products in steps of up to
                                             # this many rows take x in 8 bits per 32 values, multiplied
                                             # with the codes as integers, as llama.cpp does (faster,
                                             # slightly less exact: BENCHMARKS.md); a request's tokens
                                             # then depend on its step's size. 0: never, results
                                             # bit-identical to float32 panels'.
                                             # None: every step where the kernels have VNNI, unless dtype
                                             # is "float32" (int8_rows_choice)
    enforce_eager: bool = False              # CUDA: no decode graphs, every step launched from Python
    async_output: bool | None = None         # build a step's outputs during the next step's device work
                                             # (one step later); default: on CUDA, off on CPU
    async_scheduling: bool | None = None     # schedule and launch step N+1 before step N's tokens reach
                                             # the host (they feed N+1 on the device); default: on CUDA
                                             # without speculation, off on CPU
    num_threads: int | None = None           # CPU threads for a step, fixed; default: the usable cores
                                             # less those other processes hold now (cpu_threads.py)
    speculative: str | None = None           # "ngram" (prompt lookup) or "draft:PATH" (a smaller model)
    num_speculative_tokens: int = 4          # most drafts per sequence per step
    ngram_min: int = 1
    ngram_max: int = 4
    speculative_adaptive: bool = True        # decide each step whether speculating pays (else always)
    tokenizer: str | None = None             # tokenizer directory when it differs from the model's
    trace_file: str | None = None            # write steps and request timelines as Chrome trace JSON (trace.py)
    tensor_parallel_size: int = 1            # ranks that split each layer's heads and MLP (distributed.py);
                                             # 1: one process, no torch.distributed
    distributed_timeout: float = 60.0        # seconds a rank waits on a collective or on startup before
                                             # it gives up with an error (tensor_parallel_size > 1)
    kv_role: str | None = None               # disaggregated prefill/decode (kv_connector.py): "prefill" keeps
                                             # finished prompts' K/V for a decode instance, "decode" loads
                                             # them into its requests' blocks, "both"; None: no transfer
    kv_connector: str = "shared_storage"     # how K/V moves between instances: "shared_storage" (block files),
                                             # "nixl" (the decode instance reads the prefill one's pool: kv_nixl.py)
    kv_storage_path: str | None = None       # shared_storage: a directory both instances read and write
    kv_side_channel_host: str = "127.0.0.1"  # nixl, prefill: where decode instances fetch this agent's metadata
    kv_side_channel_port: int = 0            # nixl, prefill: its TCP port (0: any free one, reported in the params)
    kv_hold_timeout: float = 30.0            # nixl, prefill: seconds a finished prompt's blocks wait to be read
    kv_transfer_timeout: float = 10.0        # nixl, decode: seconds a read may take before the prompt is computed

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        rows = self.gguf_int8_rows
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
            raise ValueError(f"gguf_int8_rows must be an integer >= 0 or None, got {rows!r}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and parse_size(self.kv_cache_memory, "kv_cache_memory") <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))  # (frozen)
        if self.seed is None:
            object.__setattr__(self, "seed", secrets.randbits(63))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -(1 << 63) <= self.seed < 1 << 63:
            raise ValueError(f"seed must be a 64-bit integer or None, got {self.seed!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        kind, _, index = self.device.partition(":")
        if kind not in ("cpu", "cuda") or (index and not (index.isdigit() and kind == "cuda")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if str(self.kv_cache_dtype).startswith("fp8"):  # vLLM's fp8, fp8_e4m3, fp8_e5m2
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: there is no fp8 pool; on the CPU 'int8' "
                             "holds the same bytes (a scale per token and head) with half to a quarter of "
                             "fp8-e4m3's rounding error (BENCHMARKS.md)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.device.split(":")[0] != "cpu":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is for the CPU (on CUDA the pool "
                             "already takes the model's 2-byte dtype)")
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("async_scheduling does not combine with speculative decoding: drafts are "
                             "proposed from tokens on the host")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if parse_size(self.swap_space, "swap_space") < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space!r}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if self.attention_backend not in ("auto", "reference", "cpu", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto|reference|cpu|torch|triton, "
                             f"got {self.attention_backend!r}")
        if self.kernels not in ("auto", "torch"):
            raise ValueError(f"kernels must be 'auto' or 'torch', got {self.kernels!r}")
        if self.speculative is not None and not (self.speculative == "ngram" or self.speculative.startswith("draft:")):
            raise ValueError(f"speculative must be 'ngram' or 'draft:PATH', got {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) and ngram_max ({self.ngram_max}) need "
                             f"1 <= ngram_min <= ngram_max")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be positive, got {self.distributed_timeout}")
        self._check_kv_transfer()
        if size > 1 and self.speculative is not None and self.speculative.startswith("draft:"):
            raise ValueError("a draft model (speculative='draft:PATH') does not combine with "
                             "tensor_parallel_size > 1 yet; 'ngram' does")

    def _check_kv_transfer(self) -> None:
        if self.kv_role is None:
            return
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {KV_CONNECTORS}, got {self.kv_connector!r}")
        if self.kv_connector == "shared_storage" and not self.kv_storage_path:
            raise ValueError("kv_connector 'shared_storage' needs kv_storage_path: a directory both instances see")
        if not 0 <= self.kv_side_channel_port < 65536:
            raise ValueError(f"kv_side_channel_port must be in [0, 65535], got {self.kv_side_channel_port}")
        for name in ("kv_hold_timeout", "kv_transfer_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive seconds, got {getattr(self, name)!r}")
        if self.tensor_parallel_size > 1:
            raise ValueError("kv_role does not combine with tensor_parallel_size > 1 yet")

    def host_blocks(self, bytes_per_block: int) -> int:
        """Blocks of `bytes_per_block` in the host pool that swap preemption fills (0 without it)."""
        if self.preemption_mode != "swap":
            return 0
        return parse_size(self.swap_space, "swap_space") // bytes_per_block

    @property
    def torch_dtype_name(self) -> str:
        """float32 on CPU (no native bf16 there), bfloat16 on CUDA, unless set."""
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    @property
    def int8_rows_choice(self) -> int | None:
        """gguf_int8_rows where set; unset, 0 (the exact path) under dtype="float32", else None: the
        loader's choice by the CPU (models/loader.py: every step where the kernels have VNNI)."""
        if self.gguf_int8_rows is not None:
            return self.gguf_int8_rows
        return 0 if self.dtype == "float32" else None

    @property
    def bf16_weights_choice(self) -> bool | None:
        """Whether the CPU's packed float weights go in bfloat16 panels: never under dtype="float32"
        (the exact path), always under "bfloat16" (where the kernels take it: device.activation_dtype);
        unset, None: the loader's choice by the CPU (models/loader.py: where the kernels have
        AVX512-BF16)."""
        return {"float32": False, "bfloat16": True}.get(self.dtype)

    @property
    def kv_dtype_name(self) -> str:
        return self.torch_dtype_name if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


@dataclass(frozen=True)
class CacheConfig:
    """The KV block pool, resolved: exact number of blocks and tokens per block."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError(f"cache config: num_blocks ({self.num_blocks}) and block_size "
                             f"({self.block_size}) must be positive")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs to know, with the context length already resolved."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"
    kv_watermark: float = 0.01
    preemption_mode: str = "recompute"
    static_batching: bool = False
    long_prefill_token_threshold: int = 0  # 0: long prompts are not held back
    long_prefill_min_chunk: int = 16       # a long prompt's chunk beside decodes: max(this, decodes / 2)
    starvation_seconds: float = 30.0   # a request waiting this long is served first, whatever the policy

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0 or self.max_model_len <= 1:
            raise ValueError("scheduler config: max_num_seqs, max_num_batched_tokens must be "
                             "positive and max_model_len > 1")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.long_prefill_token_threshold < 0 or self.long_prefill_min_chunk < 1:
            raise ValueError("scheduler config: long_prefill_token_threshold must be >= 0 and "
                             "long_prefill_min_chunk >= 1")

    @classmethod
    def from_engine(cls, config: EngineConfig, max_model_len: int) -> "SchedulerConfig":
        return cls(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                   max_model_len=max_model_len, policy=config.scheduling_policy,
                   kv_watermark=config.kv_watermark, preemption_mode=config.preemption_mode,
                   static_batching=config.static_batching,
                   long_prefill_token_threshold=(config.max_num_batched_tokens
                                                 if config.long_prefill_token_threshold is None
                                                 else config.long_prefill_token_threshold))
