"""The shared-storage KV connector: prompt blocks handed from a prefill instance to a decode
instance as files in a directory both see (a local disk, /dev/shm, a network mount).

    <kv_storage_path>/<pool fingerprint>/<block hash>.kv    one full block, every layer's K and V:
                                                           (layers, 2, kv_heads, block_size, row),
                                                           its raw bytes in the pool's dtype

A block's name is the prefix cache's chained hash of its tokens and of every token before it
(kv_cache.hash_block), so the decode instance finds a prompt's blocks from its own tokens and
needs nothing but `do_remote_prefill` from the params. Files are written to a temporary name and
renamed, so a reader never sees half a block. The storage is a hand-off, not a cache: the decode
instance deletes a prompt's files once it loaded them (its own prefix cache keeps the blocks from
then on), and the prefill instance deletes files nobody took within FILE_TTL.

The prefill side writes when a request that asked for it (`do_remote_decode`) ends with its
prompt computed; the decode side reads at admission, on the scheduler's thread, and reports the
load finished at the next step (a local file takes milliseconds: not worth a thread). A missing,
unreadable or mis-shaped file fails the load, and the scheduler computes those tokens itself.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from tokenmill.kv_cache import extend_block_hashes
from tokenmill.kv_connector import external_block_span, hands_over, prompt_blocks_computed
from tokenmill.outputs import FinishResult
from tokenmill.request import Request

logger = logging.getLogger(__name__)

FILE_TTL = 600.0  # seconds a block file waits for a decode instance before the prefill side deletes it


class SharedStorageConnector:
    def __init__(self, path: str, role: str, worker, block_size: int, fingerprint: str) -> None:
        self.dir = Path(path) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.role = role                  # "prefill", "decode" or "both"
        self.worker = worker              # reads and writes the pool's blocks (ModelWorker)
        layers, kv, _, heads, size, dim = worker.kv_cache.shape
        self.block_shape, self.dtype = (layers, kv, heads, size, dim), worker.kv_cache.dtype  # one block's file
        self.block_size = block_size
        self.engine_id = uuid.uuid4().hex
        self.num_blocks_saved = 0         # cumulative, for tests and metrics
        self.num_blocks_loaded = 0
        self.num_load_failures = 0
        self._next_prune = 0.0            # wall clock: when _prune next looks at the directory
        self._loaded: dict[str, bool] = {}  # loads done since finished_loads() last asked

    # ---- decode side ----------------------------------------------------------------------

    def num_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        params = request.params.kv_transfer_params
        if self.role == "prefill" or not params or not params.get("do_remote_prefill"):
            return 0
        first = num_local_tokens // self.block_size
        hashes = self._hashes(request, (request.num_prompt_tokens - 1) // self.block_size + 1)
        n = 0
        for block_hash in hashes[first:]:
            if not self._file(block_hash).exists():
                break
            n += 1
        return n * self.block_size

    def start_load(self, request: Request, block_ids: list[int], num_local_tokens: int,
                   num_external_tokens: int) -> bool:
        self._loaded[request.request_id] = self._load(request, block_ids, num_local_tokens, num_external_tokens)
        return True

    def finished_loads(self) -> dict[str, bool]:
        loaded, self._loaded = self._loaded, {}
        return loaded

    def cancel_load(self, request_id: str) -> None:
        self._loaded.pop(request_id, None)

    def _load(self, request: Request, block_ids: list[int], num_local_tokens: int, num_external_tokens: int) -> bool:
        first, last = external_block_span(num_local_tokens, num_external_tokens, self.block_size)
        hashes = self._hashes(request, last)[first:last]
        try:
            blocks = torch.stack([self._read(h) for h in hashes], dim=2)
            self.worker.write_blocks(block_ids[first:last], blocks)
        except Exception as exc:  # (missing, truncated, another layout): computed here instead
            self.num_load_failures += 1
            logger.warning("request %s: loading %d transferred blocks failed (%s: %s); computing them here",
                           request.request_id, len(hashes), type(exc).__name__, exc)
            return False
        self.num_blocks_loaded += len(hashes)
        for block_hash in self._hashes(request, last):  # (those of the local hit too: this instance has them)
            self._file(block_hash).unlink(missing_ok=True)
        return True

    # ---- prefill side ---------------------------------------------------------------------

    def on_finish(self, request: Request, block_ids: list[int]) -> FinishResult:
        if self.role == "decode" or not hands_over(request):
            return FinishResult()
        num_full = prompt_blocks_computed(request, self.block_size)
        hashes = self._hashes(request, num_full)
        todo = [(i, h) for i, h in enumerate(hashes) if not self._file(h).exists()]
        if todo:
            blocks = self.worker.read_blocks([block_ids[i] for i, _ in todo])
            for j, (_, block_hash) in enumerate(todo):
                self._write(block_hash, blocks[:, :, j].clone())
        self.num_blocks_saved += len(todo)
        self._prune()
        return FinishResult({"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                             "remote_block_ids": [], "remote_host": None, "remote_port": None})

    def released(self) -> list[str]:
        return []  # the files are the hand-off: no block is ever held

    def close(self) -> None:
        pass

    # ---- files ----------------------------------------------------------------------------

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The chained hashes of the request's first `num_blocks` blocks of tokens (full ones only)."""
        num_blocks = min(num_blocks, len(request.token_ids) // self.block_size)
        return extend_block_hashes(request, [], num_blocks, self.block_size)

    def _prune(self) -> None:
        """At most once a minute: delete block files no decode instance took within FILE_TTL (their
        request's decode leg never came: the client left, or the router computed it elsewhere)."""
        now = time.time()
        if now < self._next_prune:
            return
        self._next_prune = now + 60.0
        for path in self.dir.iterdir():
            try:
                if path.stat().st_mtime < now - FILE_TTL:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:  # (taken meanwhile)
                pass

    def _file(self, block_hash: bytes) -> Path:
        return self.dir / f"{block_hash.hex()}.kv"

    def _write(self, block_hash: bytes, block: torch.Tensor) -> None:
        path = self._file(block_hash)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        block.contiguous().view(torch.uint8).numpy().tofile(tmp)
        os.replace(tmp, path)

    def _read(self, block_hash: bytes) -> torch.Tensor:
        """One block as _write left it: its raw bytes, which must be exactly one block of this pool."""
        raw = np.fromfile(self._file(block_hash), dtype=np.uint8)
        expected = int(np.prod(self.block_shape)) * self.dtype.itemsize
        if raw.size != expected:
            raise ValueError(f"{self._file(block_hash).name} has {raw.size} bytes, a block of this pool {expected}")
        return torch.from_numpy(raw).view(self.dtype).view(self.block_shape)
