"""What an engine is built from, in the order their sizes depend on each other:

    device -> checkpoint, tokenizer -> context length -> weights (and a draft model's)
           -> KV pool blocks from the memory left -> worker (pool tensors) -> runner
           -> scheduler (the pool's bookkeeping) -> speculator -> input and output processors

With tensor_parallel_size N > 1 this process is rank 0: before the weights it starts ranks
1..N-1 (tp_rank.py), loads its own shard, and the pool gets the fewest blocks any rank can hold.

LLMEngine (engine.py) takes the parts and runs the step loop over them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from tokenmill.attention import make_backend
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.cpu_threads import ThreadGovernor
from tokenmill.device import activation_dtype, context_length, kv_dtype_name, resolve_device, thread_governor
from tokenmill.input_processor import InputProcessor
from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_connector import GuardedConnector, KVConnector, pool_fingerprint
from tokenmill.kv_nixl import NixlConnector
from tokenmill.kv_storage import SharedStorageConnector
from tokenmill.model_runner import ModelRunner, kv_pool_blocks, pool_too_big
from tokenmill.models.loader import (
    BROKEN_FILE_ERRORS,
    Checkpoint,
    load_model,
    load_tokenizer,
    open_checkpoint,
    resolve_model_path,
    unreadable,
)
from tokenmill.models.parallel import TPShard, check_divisible
from tokenmill.output_processor import OutputProcessor
from tokenmill.pooling_params import PoolingParams
from tokenmill.proposers import make_proposer
from tokenmill.scheduler import Scheduler
from tokenmill.spec_decode import SpeculationPolicy, Speculator
from tokenmill.structured import GrammarCompiler
from tokenmill.tp_rank import RankProcesses, torchrun_rank
from tokenmill.worker import ModelWorker, kv_bytes_per_token

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
    input_processor: InputProcessor   # tokenizes and validates requests
    output_processor: OutputProcessor  # detokenizes; stop strings end requests through the scheduler
    ranks: RankProcesses | None = None  # tensor parallelism: ranks 1..N-1, which close() ends


def build_engine_parts(config: EngineConfig) -> EngineParts:
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = thread_governor(config, device)
    path = resolve_model_path(config.model)
    checkpoint = open_checkpoint(path)
    dtype = activation_dtype(config, device)
    kv_dtype = getattr(torch, kv_dtype_name(config, checkpoint.quantized(), device))
    model_config: ModelConfig = checkpoint.config
    if config.tensor_parallel_size > 1:
        check_divisible(model_config, config.tensor_parallel_size)  # before any rank starts
    tokenizer = load_tokenizer(path, config.tokenizer)
    eos = set(model_config.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    max_len = context_length(config, model_config)
    ranks = _start_ranks(config, checkpoint, device) if config.tensor_parallel_size > 1 else None
    try:
        runner, scheduler, speculator, cache_config, max_len = _model_and_pool(
            config, checkpoint, device, dtype, kv_dtype, max_len, threads, ranks)
    except BaseException:
        if ranks is not None:
            ranks.abort()
        raise
    grammars = GrammarCompiler(tokenizer, model_config.vocab_size, frozenset(eos))
    inputs = InputProcessor(tokenizer, model_config.vocab_size, frozenset(eos), max_len, config.scheduling_policy,
                            grammars, **encoder_inputs(model_config))
    return EngineParts(device, dtype, kv_dtype, path, model_config, tokenizer, frozenset(eos), max_len,
                       cache_config, runner, scheduler, speculator, inputs,
                       OutputProcessor(tokenizer, scheduler.end_on_stop_string), ranks)


def _start_ranks(config: EngineConfig, checkpoint: Checkpoint, device: torch.device) -> RankProcesses:
    """Start ranks 1..N-1 (unless torchrun started them) and join them as rank 0. The CPU kernels are
    loaded first: torch's loader holds a lock while it checks the cached build, which ranks loading
    at once would queue on."""
    if device.type == "cpu" and config.kernels == "auto":
        load_cpu_kernels(required=False)
    ranks = RankProcesses.under_torchrun(config) if torchrun_rank() is not None else RankProcesses(config)
    try:
        ranks.join(device)
    except BaseException:
        ranks.abort()
        raise
    return ranks


def _model_and_pool(config: EngineConfig, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                    kv_dtype: torch.dtype, max_len: int, threads: ThreadGovernor | None,
                    ranks: RankProcesses | None
                    ) -> tuple[ModelRunner, Scheduler, Speculator | None, CacheConfig, int]:
    """The weights (this rank's shard under tensor parallelism), the pool sized from the memory left
    (the fewest blocks of any rank), the worker, runner, scheduler and speculator over them; and the
    context length, lowered to what the pool holds."""
    shard = TPShard(0, config.tensor_parallel_size) if ranks is not None else None
    try:
        model = load_model(checkpoint, max_len, dtype, device, config.kernels, config.gguf_blocks,
                           config.int8_rows_choice, shard, ranks.group.all_reduce if ranks is not None else None,
                           config.bf16_weights_choice)
    except (*BROKEN_FILE_ERRORS, SafetensorError) as exc:
        raise unreadable(checkpoint.path, exc) from exc
    local_config: ModelConfig = model.config  # this rank's heads (all of them without tensor parallelism)
    # A draft model is loaded before the pool is sized (on a GPU, from the memory left), and its
    # own pool gets as many blocks: each block then costs the two models' K/V.
    proposer = (make_proposer(config.speculative, config, checkpoint.config.vocab_size)
                if config.speculative is not None else None)
    draft_kv = proposer.kv_bytes_per_token(kv_dtype) if proposer is not None else 0
    if local_config.encoder is not None and config.num_kv_blocks is None:
        # an encoder's blocks hold no K/V (worker.py), only the scheduler's count: as many as every
        # seat filled with a full-length prompt, not memory's worth
        num_blocks = config.max_num_seqs * -(-max_len // config.block_size)
    else:
        num_blocks = kv_pool_blocks(config, device,
                                    kv_bytes_per_token(local_config, kv_dtype) + draft_kv, max_len)
    if ranks is not None:
        with ranks.sender().failures():
            num_blocks = ranks.group.min_over_ranks(num_blocks)
    window = _released_window(config, local_config)
    # the most tokens one sequence holds blocks for: with blocks outside the window given back, the
    # window and a step's tokens, and the partial blocks at both ends
    held = max_len if window is None else min(max_len, window + config.max_num_batched_tokens + 2 * config.block_size)
    if num_blocks * config.block_size < held:
        logger.warning("KV pool holds %d tokens: max_model_len lowered from %d%s", num_blocks * config.block_size,
                       max_len, _int8_hint(device, local_config, kv_dtype))
        max_len = num_blocks * config.block_size
    cache_config = CacheConfig(num_blocks, config.block_size, config.enable_prefix_caching)
    runner, scheduler = _runner_and_scheduler(config, model, local_config, cache_config, device, dtype, kv_dtype,
                                              max_len, threads, ranks, checkpoint.path.name)
    speculator = None
    if proposer is not None:
        proposer.allocate(num_blocks, config.block_size, kv_dtype)
        speculator = Speculator(proposer, SpeculationPolicy(config.num_speculative_tokens),
                                adaptive=config.speculative_adaptive)
    return runner, scheduler, speculator, cache_config, max_len


def _int8_hint(device: torch.device, model_config: ModelConfig, kv_dtype: torch.dtype) -> str:
    """For a CPU pool too small for the context: how many more tokens an int8 pool would hold."""
    if device.type != "cpu" or kv_dtype == torch.int8:
        return ""
    ratio = kv_bytes_per_token(model_config, kv_dtype) / kv_bytes_per_token(model_config, torch.int8)
    return f" (kv_cache_dtype='int8' would hold {ratio:.1f}x the tokens in the same memory)"


def _released_window(config: EngineConfig, model_config: ModelConfig) -> int | None:
    """The window outside which a sequence's blocks are given back as it grows (every layer
    windowed), or None: a model with a global layer, or a KV connector that may still save a
    finished request's blocks (all of them)."""
    return model_config.kv_window if config.kv_role is None else None


def _runner_and_scheduler(config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig,
                          cache_config: CacheConfig, device: torch.device, dtype: torch.dtype,
                          kv_dtype: torch.dtype, max_len: int, threads: ThreadGovernor | None,
                          ranks: RankProcesses | None = None, model_name: str = "") -> tuple[ModelRunner, Scheduler]:
    """The worker with the KV pool's tensors (this rank's KV heads) and the runner over it; the
    scheduler with the pool's bookkeeping and the KV connector (named after `model_name`, the
    checkpoint's file or directory). Under tensor parallelism the worker sends each step to the
    other ranks."""
    num_blocks, block_size = cache_config.num_blocks, cache_config.block_size
    bytes_per_block = block_size * kv_bytes_per_token(model_config, kv_dtype)
    num_host_blocks = config.host_blocks(bytes_per_block)
    backend = make_backend(config.attention_backend, device, block_size, model_config.head_dim, dtype, kv_dtype)
    try:  # the pool's tensors first, then its bookkeeping (a list entry per block)
        worker = ModelWorker(model, model_config, cache_config, backend, device, kv_dtype, num_host_blocks, threads,
                             ranks.sender() if ranks is not None else None)
        kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, num_host_blocks,
                            _released_window(config, model_config))
    except (MemoryError, OSError, RuntimeError) as exc:  # mmap's ENOMEM, torch's allocators, CUDA OOM
        raise MemoryError(pool_too_big(config, device, num_blocks, num_host_blocks, bytes_per_block, exc)) from exc
    # (no graphs under tensor parallelism, whose collectives would be captured, nor for MoE models,
    # whose captured step would run every expert on every row, nor for an encoder, which never decodes)
    if (device.type == "cuda" and not config.enforce_eager and getattr(backend, "graph_safe", False)
            and ranks is None and model_config.moe is None and model_config.encoder is None):
        worker.capture_graphs(config.max_num_seqs, max_len)
    connector = _connector(config, model_config, worker, model_name)
    return ModelRunner(worker, config.seed), Scheduler(SchedulerConfig.from_engine(config, max_len), kv,
                                                       connector=connector)


def _connector(config: EngineConfig, model_config: ModelConfig, worker, model_name: str) -> KVConnector | None:
    """The connector `config.kv_role` and `config.kv_connector` ask for, over the worker's pool,
    guarded (GuardedConnector); None without a kv_role."""
    if config.kv_role is None:
        return None
    if model_config.encoder is not None:
        raise ValueError(f"kv_role: an encoder ({model_config.architecture}) keeps no K/V to hand over")
    fingerprint = pool_fingerprint(model_name, model_config, config.block_size,
                                   str(worker.kv_cache.dtype).removeprefix("torch."))
    if config.kv_connector == "nixl":
        return GuardedConnector(NixlConnector(
            config.kv_role, worker, config.block_size, fingerprint, config.kv_side_channel_host,
            config.kv_side_channel_port, config.kv_hold_timeout, config.kv_transfer_timeout))
    return GuardedConnector(SharedStorageConnector(config.kv_storage_path, config.kv_role, worker, config.block_size,
                                                   fingerprint))


def encoder_inputs(model_config: ModelConfig) -> dict:
    """An encoder's InputProcessor options: it serves embeddings only, pooled by default as its
    checkpoint says (nothing for a decoder)."""
    encoder = model_config.encoder
    if encoder is None:
        return {}
    return {"encoder": model_config.architecture, "default_pooling": PoolingParams(encoder.pooling, encoder.normalize)}
