"""What a process of the engine runs with, whichever rank it is: its device, its CPU thread count,
its KV pool's dtype, and the context length the model's positions and the options allow. Shared
by the engine (engine_parts.py) and the tensor-parallel ranks it starts (tp_rank.py).
"""

from __future__ import annotations

import logging
import os

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.cpu_kernels import load_cpu_kernels, this_cpu
from tokenmill.cpu_threads import ThreadGovernor, usable_cpus

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """The engine's device, with its index ("cuda" is the current GPU: torch.cuda.set_device needs
    an index); a CUDA device on a torch that sees none is an error before anything loads."""
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this torch build sees no CUDA GPU "
                         f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'})")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def rank_device(name: str, local_rank: int) -> torch.device:
    """A tensor-parallel rank's device: the CPU, or the GPU numbered by its rank on its machine
    ("cuda:1" for local rank 1 whatever index `name` gives rank 0)."""
    device = torch.device(name)
    return resolve_device(f"cuda:{local_rank}") if device.type == "cuda" else device


def thread_governor(config: EngineConfig, device: torch.device) -> ThreadGovernor | None:
    """--num-threads fixes the CPU threads; otherwise they follow the cores left free (cpu_threads.py),
    pinned by the C++ kernels where the governor binds them (two CPUs and a neighbour).
    Tensor-parallel ranks on one CPU share its cores: each runs a fixed share of them (1/N, or 1 over
    torchrun's LOCAL_WORLD_SIZE, the ranks on this machine), since every all-reduce waits for the
    slowest rank and a governor per rank would see the others as load."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
        return None
    if device.type != "cpu":
        return None
    cpus, limit = usable_cpus()
    if config.tensor_parallel_size > 1:
        here = int(os.environ.get("LOCAL_WORLD_SIZE", config.tensor_parallel_size))
        torch.set_num_threads(max(1, limit // here))
        return None
    kernels = load_cpu_kernels(required=False) if config.kernels == "auto" else None
    return ThreadGovernor(cpus, limit, torch.set_num_threads, bind=kernels.bind_threads if kernels else None)


def context_length(config: EngineConfig, model_config: ModelConfig) -> int:
    """The model's positions, or max_model_len below them; for an encoder, whose prompts run whole in
    one step, no more than a step's budget (max_num_batched_tokens)."""
    positions = model_config.max_position_embeddings
    max_len = min(config.max_model_len or positions, positions)
    if config.max_model_len is not None and config.max_model_len > max_len:
        logger.warning("max_model_len %d is past the model's %d positions: lowered to %d",
                       config.max_model_len, max_len, max_len)
    if model_config.encoder is not None and config.max_num_batched_tokens < max_len:
        logger.warning("an encoder's prompt runs whole in one step: max_model_len lowered from %d to "
                       "max_num_batched_tokens (%d)", max_len, config.max_num_batched_tokens)
        max_len = config.max_num_batched_tokens
    return max_len


def activation_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The dtype the model computes in between its products: config.torch_dtype_name's, except
    dtype="bfloat16" on a CPU whose kernels have AVX512-BF16 (kernels "auto"), which takes the
    arithmetic the defaults take there: bfloat16 weights and x in every product and a bfloat16 pool
    (EngineConfig.bf16_weights_choice, kv_dtype_name), float32 between the products: several times
    the speed of torch's own bfloat16 layers there (BENCHMARKS.md), and closer to float32."""
    if (config.dtype == "bfloat16" and device.type == "cpu" and config.kernels == "auto"
            and this_cpu().has("avx512_bf16")):
        return torch.float32
    return getattr(torch, config.torch_dtype_name)


def kv_dtype_name(config: EngineConfig, quantized: bool, device: torch.device) -> str:
    """The KV pool's dtype: the one config.kv_cache_dtype names, except on a CPU where, with
    kv_cache_dtype and dtype both left unset, a 2-byte pool halves the bytes for the attention to
    read (BENCHMARKS.md). For a quantized GGUF file (Checkpoint.quantized) float16 where the kernels
    have AVX512-VNNI: with the layers' products taking x in 8 bits there
    (EngineConfig.int8_rows_choice), that is llama.cpp's arithmetic with its default cache, and its
    three more bits of mantissa kept the default model's answers where bfloat16 flipped one. For
    float weights bfloat16 where they have AVX512-BF16, as the weights were trained and as vLLM
    keeps them, with the products in bfloat16 (EngineConfig.bf16_weights_choice).
    dtype="float32" keeps the float32 pool."""
    if config.kv_cache_dtype == "auto" and config.dtype is None and device.type == "cpu":
        if quantized and this_cpu().has("avx512_vnni"):
            return "float16"
        if not quantized and this_cpu().has("avx512_bf16"):
            return "bfloat16"
    return config.kv_dtype_name
