"""What an engine is built from, in the order their sizes depend on each other:

    device -> checkpoint, tokenizer -> context length -> weights (and a draft model's)
           -> KV pool blocks from the memory left -> worker (pool tensors) -> runner
           -> scheduler (the pool's bookkeeping) -> speculator

LLMEngine (engine.py) takes the parts and runs the step loop over them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from tokenmill.attention import make_backend
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_size
from tokenmill.cpu_threads import ThreadGovernor, usable_cpus
from tokenmill.kv_cache import KVCacheManager
from tokenmill.model_runner import ModelRunner, kv_pool_blocks, pool_too_big
from tokenmill.models.loader import (
    BROKEN_FILE_ERRORS,
    load_model,
    load_tokenizer,
    open_checkpoint,
    resolve_model_path,
    unreadable,
)
from tokenmill.proposers import make_proposer
from tokenmill.scheduler import Scheduler
from tokenmill.spec_decode import SpeculationPolicy, Speculator
from tokenmill.worker import ModelWorker

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    device: torch.device
    dtype: torch.dtype                # weights and activations
    kv_dtype: torch.dtype             # the KV pool
    model_path: Path
    model_config: ModelConfig
    tokenizer: object                 # a transformers tokenizer
    eos_token_ids: frozenset[int]     # the model's and the tokenizer's
    max_model_len: int                # prompt + output, lowered to the positions and the pool
    cache_config: CacheConfig
    runner: ModelRunner
    scheduler: Scheduler
    speculator: Speculator | None


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


def thread_governor(config: EngineConfig, device: torch.device) -> ThreadGovernor | None:
    """--num-threads fixes the CPU threads; otherwise they follow the cores left free (cpu_threads.py)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
        return None
    if device.type != "cpu":
        return None
    cpus, limit = usable_cpus()
    return ThreadGovernor(cpus, limit, torch.set_num_threads)


def context_length(config: EngineConfig, model_config: ModelConfig) -> int:
    positions = model_config.max_position_embeddings
    max_len = min(config.max_model_len or positions, positions)
    if config.max_model_len is not None and config.max_model_len > max_len:
        logger.warning("max_model_len %d is past the model's %d positions: lowered to %d",
                       config.max_model_len, max_len, max_len)
    return max_len


def build_engine_parts(config: EngineConfig) -> EngineParts:
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype, kv_dtype = getattr(torch, config.torch_dtype_name), getattr(torch, config.kv_dtype_name)
    threads = thread_governor(config, device)
    path = resolve_model_path(config.model)
    checkpoint = open_checkpoint(path)
    model_config: ModelConfig = checkpoint.config
    tokenizer = load_tokenizer(path, config.tokenizer)
    eos = set(model_config.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    max_len = context_length(config, model_config)
    try:
        model = load_model(checkpoint, max_len, dtype, device, config.kernels, config.gguf_blocks,
                           config.gguf_int8_rows)
    except (*BROKEN_FILE_ERRORS, SafetensorError) as exc:
        raise unreadable(path, exc) from exc
    # A draft model is loaded before the pool is sized (on a GPU, from the memory left), and its
    # own pool gets as many blocks: each block then costs the two models' K/V.
    proposer = (make_proposer(config.speculative, config, model_config.vocab_size)
                if config.speculative is not None else None)
    draft_kv = proposer.kv_elements_per_token if proposer is not None else 0
    num_blocks = kv_pool_blocks(config, device, (model_config.kv_bytes_per_token + draft_kv) * kv_dtype.itemsize,
                                max_len)
    if num_blocks * config.block_size < max_len:
        logger.warning("KV pool holds %d tokens: max_model_len lowered from %d", num_blocks * config.block_size,
                       max_len)
        max_len = num_blocks * config.block_size
    cache_config = CacheConfig(num_blocks, config.block_size, config.enable_prefix_caching)
    runner, scheduler = _runner_and_scheduler(config, model, model_config, cache_config, device, dtype, kv_dtype,
                                              max_len, threads)
    speculator = None
    if proposer is not None:
        proposer.allocate(num_blocks, config.block_size)
        speculator = Speculator(proposer, SpeculationPolicy(config.num_speculative_tokens),
                                adaptive=config.speculative_adaptive)
    return EngineParts(device, dtype, kv_dtype, path, model_config, tokenizer, frozenset(eos), max_len,
                       cache_config, runner, scheduler, speculator)


def _runner_and_scheduler(config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig,
                          cache_config: CacheConfig, device: torch.device, dtype: torch.dtype,
                          kv_dtype: torch.dtype, max_len: int,
                          threads: ThreadGovernor | None) -> tuple[ModelRunner, Scheduler]:
    """The worker with the KV pool's tensors and the runner over it; the scheduler with the pool's
    bookkeeping."""
    num_blocks, block_size = cache_config.num_blocks, cache_config.block_size
    bytes_per_block = block_size * model_config.kv_bytes_per_token * kv_dtype.itemsize
    num_host_blocks = parse_size(config.swap_space) // bytes_per_block if config.preemption_mode == "swap" else 0
    backend = make_backend(config.attention_backend, device, block_size, model_config.head_dim, dtype)
    try:  # the pool's tensors first, then its bookkeeping (a list entry per block)
        worker = ModelWorker(model, model_config, cache_config, backend, device, kv_dtype, num_host_blocks, threads)
        kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, num_host_blocks)
    except (MemoryError, OSError, RuntimeError) as exc:  # mmap's ENOMEM, torch's allocators, CUDA OOM
        raise MemoryError(pool_too_big(config, device, num_blocks, num_host_blocks, bytes_per_block, exc)) from exc
    if device.type == "cuda" and not config.enforce_eager and getattr(backend, "graph_safe", False):
        worker.capture_graphs(config.max_num_seqs, max_len)
    return ModelRunner(worker, config.seed), Scheduler(SchedulerConfig.from_engine(config, max_len), kv)
