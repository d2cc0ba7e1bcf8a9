"""The model worker: what one device holds and runs. The model's weights, the KV pool tensors,
the attention backend, the decode graphs and the CPU thread count live here; a step comes in as
tensors already prepared (token ids, positions, attention metadata) and leaves as hidden states.

The worker knows nothing of requests, sampling or the scheduler: those stay with the runner
(model_runner.py), which prepares each step once and hands the worker its tensors. That line is
where tensor-parallel ranks sit, each a worker over its share of the heads and of the pool: on
rank 0 the worker has `peers` (distributed.StepSender) and sends every swap and step to the other
ranks before running its own share; they run theirs from what they receive (tp_rank.py).

    pool  (layers, K|V, blocks + 1, kv_heads, block_size, row)
          the last block is scratch: padding rows of a replayed decode graph write there;
          row = head_dim, or head_dim + 4 in an int8 pool, whose (block, head) runs hold block_size
          rows of codes and then their float32 scales (csrc/paged_attention_cpu.cpp)
"""

from __future__ import annotations

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.config import CacheConfig, ModelConfig
from tokenmill.cpu_threads import ThreadGovernor
from tokenmill.cuda_graphs import DecodeGraphs
from tokenmill.distributed import StepSender
from tokenmill.host_memory import huge_page_zeros

INT8_SCALE_BYTES = 4  # an int8 pool's float32 scale per row of codes


def pool_row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """The pool's last dimension: head_dim, with room for each row's scale in an int8 pool."""
    return head_dim + (INT8_SCALE_BYTES if kv_dtype == torch.int8 else 0)


def kv_bytes_per_token(model_config: ModelConfig, kv_dtype: torch.dtype) -> int:
    """One token's K and V in every layer, in bytes of a pool of kv_dtype."""
    rows = 2 * model_config.num_layers * model_config.num_kv_heads
    return rows * pool_row_width(model_config.head_dim, kv_dtype) * kv_dtype.itemsize


class ModelWorker:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, cache_config: CacheConfig, backend,
                 device: torch.device, kv_dtype: torch.dtype, num_host_blocks: int = 0,
                 threads: ThreadGovernor | None = None, peers: StepSender | None = None) -> None:
        self.model = model
        self.peers = peers  # tensor parallelism on rank 0: the other ranks (None: this is the only one)
        self.backend = backend
        self.device = device
        self.threads = threads  # CPU: sets each step's thread count from the cores free now
        self.block_size = cache_config.block_size
        self.null_block = cache_config.num_blocks  # the scratch block
        # an encoder keeps no K/V between steps (models/bert.py): its pool has no layers, its blocks
        # are the scheduler's bookkeeping alone
        num_layers = 0 if model_config.encoder is not None else model_config.num_layers
        shape = (num_layers, 2, cache_config.num_blocks + 1, model_config.num_kv_heads,
                 cache_config.block_size, pool_row_width(model_config.head_dim, kv_dtype))
        # On the CPU the pool sits on huge pages, lazily committed (pages never touched cost no memory);
        # on a GPU it is zeroed when the backend reads past a sequence's end, where it needs finite values.
        if device.type == "cpu":
            self.kv_cache = huge_page_zeros(shape, kv_dtype)
        else:
            alloc = torch.zeros if getattr(backend, "reads_padding", False) else torch.empty
            self.kv_cache = alloc(shape, dtype=kv_dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(num_layers)]
        # Host pool for preemption by swapping (pinned on CUDA so the copies run at full speed).
        self.host_kv_cache = None if not num_host_blocks else torch.empty(
            (*self.kv_cache.shape[:2], num_host_blocks, *self.kv_cache.shape[3:]), dtype=kv_dtype,
            pin_memory=device.type == "cuda")
        self.graphs: DecodeGraphs | None = None

    @property
    def vocab_size(self) -> int:
        """The width of the logits (the embedding's rows, padding included)."""
        return self.model.embed_tokens.num_embeddings

    @property
    def short_query_max(self) -> int:
        """The longest query the backend's batched short-query kernel takes (0: none)."""
        return getattr(self.backend, "short_query_max", 0)

    def capture_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Replay plain decode steps of up to max_batch sequences from CUDA graphs from now on."""
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, self.block_size, max_batch,
                                   max_model_len, self.null_block, self.device)

    def begin_step(self) -> None:
        """Before a step's work: the CPU thread count for it."""
        if self.threads is not None:
            self.threads.update()

    def use_device(self) -> None:
        """Make this worker's GPU the calling thread's current device (nothing on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def reset_threads(self) -> None:
        """Give the calling thread back every CPU thread the governor may have taken from it
        (ThreadGovernor.reset); nothing where the count is fixed."""
        if self.threads is not None:
            self.threads.reset()

    def release_threads(self) -> None:
        """Let the OpenMP worker threads that the calling thread started exit (building the engine
        ran parallel kernels on it), before the engine steps on a thread of its own: each thread that
        runs parallel kernels keeps a team of workers, and with more workers than cores libgomp makes
        idle ones sleep at once instead of spinning, so that every kernel call would have to wake them."""
        kernels = getattr(self.backend, "kernel", None)  # the CPU backend's C++ module
        if kernels is not None:
            kernels.release_threads()

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy preempted requests' blocks out to the host pool, then readmitted ones back in;
        before the forward pass, which may write into the blocks just swapped out."""
        if self.peers is not None and (swap_out or swap_in):
            with self.peers.failures():
                self.peers.send_swap(swap_out, swap_in)
        for copies, src, dst in ((swap_out, self.kv_cache, self.host_kv_cache),
                                 (swap_in, self.host_kv_cache, self.kv_cache)):
            if copies:
                src_idx = torch.tensor([a for a, _ in copies], device=src.device)
                dst_idx = torch.tensor([b for _, b in copies], device=dst.device)
                dst.index_copy_(2, dst_idx, src.index_select(2, src_idx).to(dst.device))

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """These blocks' K/V, every layer, on the host: (layers, 2, len(block_ids), kv_heads,
        block_size, row). For a KV connector handing a prompt to another instance."""
        idx = torch.tensor(block_ids, device=self.kv_cache.device)
        return self.kv_cache.index_select(2, idx).cpu()

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Put K/V from another instance into these blocks (`blocks` shaped as read_blocks returns)."""
        if blocks.shape[2] != len(block_ids) or blocks.shape[:2] + blocks.shape[3:] != (
                self.kv_cache.shape[:2] + self.kv_cache.shape[3:]):
            raise ValueError(f"blocks of shape {tuple(blocks.shape)} do not fit this pool "
                             f"{tuple(self.kv_cache.shape)} at {len(block_ids)} blocks")
        idx = torch.tensor(block_ids, device=self.kv_cache.device)
        self.kv_cache.index_copy_(2, idx, blocks.to(self.kv_cache.device, self.kv_cache.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model over one flat batch, writing its K/V into the pool: (T, hidden) states. On rank
        0 of several, the other ranks get the step first and run it alongside."""
        if self.peers is not None:
            with self.peers.failures():
                self.peers.send_step(input_ids, positions, meta)
                return self.model(input_ids, positions, meta, self.kv_caches, self.backend)
        if self.graphs is not None and self.graphs.fits(input_ids, meta):
            return self.graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, meta, self.kv_caches, self.backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, hidden) -> (rows, vocab) float32 logits. On rank 0 of several, each rank computes
        its vocabulary rows' slice and rank 0 gathers them; on another rank, its own slice."""
        if self.peers is not None:
            with self.peers.failures():
                return self.peers.logits(hidden, self.model.compute_logits, self.vocab_size)
        return self.model.compute_logits(hidden)
