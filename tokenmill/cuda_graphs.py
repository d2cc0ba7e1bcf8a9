"""Decode steps replayed from captured CUDA graphs.

A decode step of a 28-layer model issues about 600 kernel launches, and on a GPU issuing them
from Python takes longer than running them (BENCHMARKS.md, GPU section). A CUDA graph records
the launches of one step once and replays them with a single call.

A graph fixes every shape and address, so captured steps run on static buffers, one graph per
batch size in `capture_sizes`:
  * a step of b sequences runs the graph of the next size n >= b; the n - b padding rows decode
    into a scratch block that no sequence owns (`null_block`, one past the block manager's
    pool), each with a context of one token, so they write and read only that block;
  * block tables are as wide as the longest sequence the model takes, so any step fits.
Only steps in which every sequence brings one token (plain decodes) are replayed; prompt chunks
and speculative verification run eagerly. The logits are computed after the replay, for the
rows that sample, as in an eager step.

On a CPU nothing is captured and `run` calls the same forward on the same buffers, which lets
tests check the padding without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from tokenmill.attention import AttentionMetadata

logger = logging.getLogger(__name__)


MAX_CAPTURED_BATCH = 512  # larger decode steps run eagerly: their launches cost little beside the work


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (rounded up, at most 512): a step pads
    at most 15 rows, which costs little while decoding is bound by reading the weights and the KV
    cache. Up to 8 sequences: the powers of two below max_batch, and max_batch itself."""
    max_batch = min(max_batch, MAX_CAPTURED_BATCH)
    sizes = [n for n in (1, 2, 4, 8) if n < max_batch]
    return sizes + list(range(16, max_batch + 16, 16)) if max_batch > 8 else sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend,
                 block_size: int, max_batch: int, max_model_len: int, null_block: int,
                 device: torch.device) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.block_size, self.null_block = block_size, null_block
        self.sizes = capture_sizes(max_batch)
        n, width = self.sizes[-1], -(-max_model_len // block_size)

        def buffer(fill: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.full(shape or (n,), fill, dtype=dtype, device=device)
        self.input_ids = buffer(0, torch.int64)
        self.positions = buffer(0, torch.int64)
        self.slot_block = buffer(null_block, torch.int64)
        self.slot_offset = buffer(0, torch.int64)
        self.seq_lens = buffer(1, torch.int32)
        self.block_tables = buffer(null_block, torch.int32, n, width)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if device.type == "cuda":
            self._capture()

    def _metadata(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_block=self.slot_block[:n], slot_offset=self.slot_offset[:n],
            query_start_loc=self.query_start_loc[:n + 1], seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n], query_start_loc_host=list(range(n + 1)), seq_lens_host=[1] * n,
            block_size=self.block_size, num_short=n, num_short_tokens=n)

    def _forward(self, n: int) -> torch.Tensor:
        return self.model(self.input_ids[:n], self.positions[:n], self._metadata(n), self.kv_caches, self.backend)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest first, all in one memory pool: a smaller graph reuses the larger's memory.
        While capturing, every row is a padding row, so no sequence's K/V is touched."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):
            self._forward(n)  # warm-up outside the capture: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[n] = self._forward(n)
            self.graphs[n] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode graphs (batch 1..%d) in %.1f s", len(self.sizes), self.sizes[-1],
                    time.perf_counter() - start)

    def fits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A plain decode step (one token per sequence) of a batch no larger than the largest graph."""
        return (input_ids.shape[0] == meta.num_seqs <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Copy the step into the buffers, reset the padding rows and replay. Returns the hidden
        states of all n rows; the step's b sequences are the first b."""
        b = meta.num_seqs
        n = self.sizes[bisect.bisect_left(self.sizes, b)]
        for buf, src in ((self.input_ids, input_ids), (self.positions, positions),
                         (self.slot_block, meta.slot_block), (self.slot_offset, meta.slot_offset),
                         (self.seq_lens, meta.seq_lens)):
            buf[:b].copy_(src, non_blocking=True)
        self.block_tables[:b, :meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if n > b:  # stale ids and positions are valid values; slots and contexts must point at the scratch block
            self.slot_block[b:n].fill_(self.null_block)
            self.slot_offset[b:n].zero_()
            self.seq_lens[b:n].fill_(1)
            self.block_tables[b:n, 0].fill_(self.null_block)
        if n in self.graphs:
            self.graphs[n].replay()
            return self.outputs[n]
        return self._forward(n)
