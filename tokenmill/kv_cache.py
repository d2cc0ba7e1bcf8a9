"""The KV block pool and per-request block allocation (PagedAttention's bookkeeping).

The K/V tensors themselves live in the model runner; this module only decides
which block ids a request owns. Plain Python, so tests can check exact block
ids, ref counts and free order.

A request's blocks, block_size = 4, 10 tokens of which 6 are computed:

    token index   0 1 2 3 | 4 5 6 7 | 8 9 . .
    block_ids       [17]      [3]       [42]
    state         computed   |computed|  new   <- allocate(req, 4) made sure [42] exists
    hash          h17 = H(None, t0..t3), h3 = H(h17, t4..t7); [42] is not full: no hash

A block is registered in the cache as soon as a step is scheduled to fill it, so a request
admitted later in the same step can share it: within one forward pass every layer writes
the new K/V of all tokens before any token attends.

Every block is in exactly one of three states, and the counts add up to the pool:
  * free       ref 0, no hash:           handed out first, most recently freed first (its
               memory is still warm in cache, and the pool's untouched pages stay untouched)
  * evictable  ref 0, hash kept (cached): reused LRU-first only when no free block is left,
               or revived by a prefix-cache hit
  * in use     ref >= 1:                 never handed out; shared read-only when ref > 1
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tokenmill.request import Request

# A block's state in BlockPool.block_states(), one byte each (the dashboard draws them).
BLOCK_FREE, BLOCK_OWNED, BLOCK_SHARED, BLOCK_CACHED = 0, 1, 2, 3


def hash_block(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """A collision-resistant id for a full block: its tokens and, through the parent, every earlier token."""
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(request: Request, hashes: list[bytes], num_blocks: int, block_size: int) -> list[bytes]:
    """`hashes`, the chained hashes of the request's first blocks, extended to its first
    `num_blocks` full blocks. The first block's parent is the digest of the request's cache_salt
    (vLLM's) if it has one, so that requests share blocks only with requests of the same salt
    (one tenant cannot time another's prompts by their cache hits). The prefix cache and the
    disaggregated block store (kv_storage.py) hash alike, through here."""
    salt = request.cache_salt
    parent = hashes[-1] if hashes else None if salt is None else hashlib.blake2b(
        b"cache_salt:" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    for i in range(len(hashes), num_blocks):
        parent = hash_block(parent, request.token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    """Block ids with ref counts, a free list, and an LRU pool of cached (evictable) blocks.

    Invariants, kept by every method: `num_free_blocks + num_evictable_blocks + num_used_blocks
    == num_blocks`; a block with ref > 0 is in neither queue; `cached` maps each hash to one
    block whose `block_hash` is that hash. A block in use whose content is cached in another
    block is its twin: it takes the other's place when that one is evicted.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}                       # hash -> block id
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # ref 0, no hash; a stack, 0 on top
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; oldest first
        self.twins: dict[bytes, list[int]] = {}                  # hash -> uncached blocks in use of that content
        self.twin_hash: dict[int, bytes] = {}                    # each such block -> its hash
        self.num_evictions = 0
        self.num_shared_refs = 0  # references beyond the first, summed over blocks (for waste figures)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def block_states(self) -> bytes:
        """Each block's state as one byte: BLOCK_FREE, BLOCK_OWNED (ref 1), BLOCK_SHARED (ref > 1) or
        BLOCK_CACHED (ref 0, hash kept: evictable). The ref counts go through numpy in a few C passes
        (~0.3 ms for 10,000 blocks on a loaded 2-core Zen 3, ref counts of 256 included, where a Python
        loop took 2.7 ms), paid only by whoever asks."""
        refs = np.frombuffer(array("q", self.ref_counts), dtype=np.int64)
        states = np.minimum(refs, BLOCK_SHARED).astype(np.uint8)
        if self._evictable:
            states[np.fromiter(self._evictable, dtype=np.int64, count=len(self._evictable))] = BLOCK_CACHED
        return states.tobytes()

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks with ref count 1; uncached blocks first, then evict least recently used."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"allocate({n}) with only {self.num_free_blocks} blocks available")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
                self.num_evictions += 1
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def share(self, block_ids: list[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit); revives evictable ones."""
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            else:
                self.num_shared_refs += 1
            self.ref_counts[block] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in the given order (which becomes eviction order)."""
        for block in block_ids:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"double free of block {block}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] > 0:
                self.num_shared_refs -= 1
            else:
                if block in self.twin_hash:
                    self._drop_twin(block)
                if self.block_hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def cache(self, block: int, block_hash: bytes) -> None:
        """Record a full, computed block's hash so later prompts can share it. While an identical
        block is cached the first is kept, and this one waits as its twin."""
        if self.block_hash[block] is not None or block in self.twin_hash:
            return
        if block_hash in self.cached:
            self.twins.setdefault(block_hash, []).append(block)
            self.twin_hash[block] = block_hash
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def uncache(self, block_ids: list[int]) -> None:
        """Forget the hashes of these blocks (their contents can no longer be trusted)."""
        for block in block_ids:
            if block in self.twin_hash:
                self._drop_twin(block)
            if self.block_hash[block] is None:
                continue
            self._forget(block)
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)

    def _forget(self, block: int) -> None:
        """Drop a cached block's hash; the oldest twin of its content, if any, is cached instead."""
        block_hash = self.block_hash[block]
        self.block_hash[block] = None
        del self.cached[block_hash]
        if block_hash in self.twins:
            twin = self.twins[block_hash][0]
            self._drop_twin(twin)
            self.block_hash[twin] = block_hash
            self.cached[block_hash] = twin

    def _drop_twin(self, block: int) -> None:
        block_hash = self.twin_hash.pop(block)
        twins = self.twins[block_hash]
        twins.remove(block)
        if not twins:
            del self.twins[block_hash]

    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests call this every step)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not free & evictable, "block both free and evictable"
        for block in range(self.num_blocks):
            ref = self.ref_counts[block]
            assert ref >= 0
            assert (ref == 0) == (block in free or block in evictable), f"block {block}: ref {ref}"
            assert (block in evictable) <= (self.block_hash[block] is not None)
            assert (block in free) <= (self.block_hash[block] is None)
        for h, block in self.cached.items():
            assert self.block_hash[block] == h
        assert self.twin_hash == {b: h for h, blocks in self.twins.items() for b in blocks}
        for block, h in self.twin_hash.items():
            assert self.ref_counts[block] > 0 and self.block_hash[block] is None and h in self.cached
        assert len(free) + len(evictable) + self.num_used_blocks == self.num_blocks
        assert self.num_shared_refs == sum(max(r - 1, 0) for r in self.ref_counts)


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks that cover a request's first `num_tokens` prompt tokens: `block_ids` are the
    blocks after the first `num_skipped` (those wholly before the window of the first query to
    compute, with a window; none without), which need not be cached."""

    block_ids: list[int]
    num_tokens: int
    num_skipped: int = 0


class KVCacheManager:
    """Per-request allocation on top of a BlockPool: grow, share prefixes, free, swap.

    With `num_host_blocks`, a second pool in host memory receives the blocks of requests
    preempted by swapping; the copies themselves are the runner's job, given as
    (source block, destination block) pairs.

    With `window` (a model whose every layer has a sliding window, the widest of them), a running
    request's leading blocks that no future query can see are given back as it grows
    (`release_outside_window`), so that it holds about a window of K/V whatever its length. Their
    entries in block_ids become `null_block` (the pool tensors' scratch block, one past the last),
    keeping every later block at its position; the windowed kernels never read them. A released
    block keeps its hash: a prefix hit may revive it (its K/V is still the prefix's) until it is
    evicted, and then the hit stops before it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, window: int | None = None) -> None:
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.null_block = num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest chain of cached full blocks matching the request's tokens.

        At most `num_tokens - 1` tokens are reused, so at least one token is computed and the
        step that finishes the prompt has logits to sample from. A request that wants its prompt's
        logprobs, or the mean of its prompt's hidden states, reuses nothing: it needs the model's
        output at every prompt position.
        """
        if not self.enable_prefix_caching or request.needs_every_position:
            return PrefixHit([], 0)
        self._extend_hashes(request, request.num_tokens - 1)
        blocks = [self.pool.lookup(h) for h in request.block_hashes[:(request.num_tokens - 1) // self.block_size]]
        if self.window is None:
            n = blocks.index(None) if None in blocks else len(blocks)
            return PrefixHit(blocks[:n], n * self.block_size)
        # With a window, a hit of n blocks needs only those from the one holding position
        # n * block_size - window + 1 (the first the next query sees): the chained hashes vouch
        # for everything before them. The longest n whose needed blocks are all cached wins.
        best, run_start = PrefixHit([], 0), 0
        for i, block in enumerate(blocks):
            if block is None:
                run_start = i + 1
                continue
            n = i + 1
            skip = max(0, n * self.block_size - self.window + 1) // self.block_size
            if skip >= run_start:
                best = PrefixHit(blocks[skip:n], n * self.block_size, skip)
        return best

    def can_allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None,
                     reserve: int = 0) -> bool:
        """Whether `allocate` would succeed while leaving `reserve` blocks available."""
        return self._num_new_blocks(request, num_new_tokens, hit) + reserve <= self._available(hit)

    def admission_shortfall(self, request: Request, num_new_tokens: int, hit: PrefixHit | None) -> int:
        """Blocks missing to admit a waiting request with `num_new_tokens` (after its prefix hit,
        or, with hit None, its swapped blocks coming back); 0 or less when it fits."""
        if hit is None:
            return self.blocks_needed(request.num_computed_tokens + num_new_tokens) - self.pool.num_free_blocks
        return self._num_new_blocks(request, num_new_tokens, hit) - self._available(hit)

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None,
                 register: bool = True) -> bool:
        """Make the request's blocks cover `num_computed_tokens + num_new_tokens` tokens (after
        the hit's), and register the blocks this step will fill in the prefix cache (not with
        `register` False: a KV connector's load fills them later, and they are registered as the
        request's next chunk is allocated, once the load succeeded).

        `hit` (admission only) first takes shared references on cached prefix blocks; the
        scheduler then moves the request's counter past them. Returns False, changing nothing,
        if the pool is short.

            block_ids   [hit 0][hit 1][new 2][new 3]
            tokens      |<- hit.num_tokens ->|<- num_new_tokens ->|

        A hit that skips its first blocks (outside the window) puts null_block in their place,
        counted as released.
        """
        if not self.can_allocate(request, num_new_tokens, hit):
            return False
        skipped = 0
        if hit is not None:
            self.pool.share(hit.block_ids)
            request.block_ids.extend([self.null_block] * hit.num_skipped + hit.block_ids)
            request.num_released_blocks = hit.num_skipped
            skipped = hit.num_tokens
        request.block_ids.extend(self.pool.allocate(self._num_new_blocks(request, skipped + num_new_tokens)))
        if register:
            self._cache_full_blocks(request, request.num_computed_tokens + skipped + num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        """Return all of a request's blocks (and host blocks, if swapped); tail blocks first in
        eviction order (least shareable). Its counter is the scheduler's to reset."""
        self.pool.free(list(reversed(request.block_ids[request.num_released_blocks:])))
        if request.swapped_block_ids:
            self.host_pool.free(request.swapped_block_ids)
            request.swapped_block_ids = []
        request.block_ids.clear()
        request.num_registered_blocks = request.num_released_blocks = 0

    def release_outside_window(self, request: Request) -> int:
        """Give back the request's leading blocks that lie wholly before the window of its next
        query (position num_computed_tokens, the lowest any later step computes); returns how
        many. Nothing without a window.

            window 6, block_size 4, 13 tokens computed: the next query (13) sees 8..13
            token index   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13
            block_ids      [null]    [null]    [42]        [8]    <- blocks 0 and 1 given back
        """
        if self.window is None:
            return 0
        first_seen = max(0, request.num_computed_tokens - self.window + 1)
        num_outside = min(first_seen // self.block_size, len(request.block_ids))
        start = request.num_released_blocks
        if num_outside <= start:
            return 0
        self.pool.free(request.block_ids[start:num_outside])  # oldest first: the first to be evicted
        request.block_ids[start:num_outside] = [self.null_block] * (num_outside - start)
        request.num_released_blocks = num_outside
        return num_outside - start

    def blocks_held_alone(self, request: Request, keep: set[int] = frozenset()) -> int:
        """Blocks that freeing `request` would return to the pool (no other request shares them),
        not counting those in `keep`."""
        refs = self.pool.ref_counts
        return sum(1 for b in request.block_ids[request.num_released_blocks:] if refs[b] == 1 and b not in keep)

    def forget_cached(self, holders: list[Request]) -> None:
        """Forget every cached hash (a failed step may have left blocks half written); `holders`,
        the requests that keep their blocks, offer the full ones again at their next allocation."""
        self.pool.uncache(list(range(self.pool.num_blocks)))
        for request in holders:
            request.num_registered_blocks = 0

    def trim(self, request: Request) -> None:
        """Free the blocks past the request's computed tokens (after rejected speculative tokens).
        Those blocks were never registered in the cache: drafts are not tokens of the request."""
        keep = self.blocks_needed(request.num_computed_tokens)
        if len(request.block_ids) > keep:
            self.pool.free(list(reversed(request.block_ids[keep:])))
            del request.block_ids[keep:]

    def can_swap_out(self, request: Request) -> bool:
        """Whether the host pool takes the request's blocks; never once some were released (its
        K/V is no longer whole: preempted, it computes its tokens again)."""
        return (self.host_pool is not None and not request.num_released_blocks
                and self.host_pool.num_free_blocks >= len(request.block_ids))

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move a request's blocks to the host pool, keeping its computed tokens.
        Returns (device block, host block) copies, to run before the next forward pass."""
        host = self.host_pool.allocate(len(request.block_ids))
        copies = list(zip(request.block_ids, host))
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_registered_blocks = 0
        request.swapped_block_ids = host
        return copies

    def can_swap_in(self, request: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        return need + reserve <= self.pool.num_free_blocks

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """Bring a swapped request back with room for `num_new_tokens` more; returns
        (host block, device block) copies, to run before the next forward pass."""
        device = self.pool.allocate(self.blocks_needed(request.num_computed_tokens + num_new_tokens))
        copies = list(zip(request.swapped_block_ids, device))
        self.host_pool.free(request.swapped_block_ids)
        request.swapped_block_ids = []
        request.block_ids = device
        self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
        return copies

    def slots_filled(self, requests: list[Request]) -> int:
        """Pool slots holding a computed token, shared blocks counted once (they are full)."""
        released = sum(r.num_released_blocks for r in requests)
        return sum(r.num_computed_tokens for r in requests) - (self.pool.num_shared_refs + released) * self.block_size

    def _num_new_blocks(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        covered = len(hit.block_ids) + hit.num_skipped if hit is not None else 0
        computed = request.num_computed_tokens + (hit.num_tokens if hit is not None else 0)
        return max(0, self.blocks_needed(computed + num_new_tokens) - len(request.block_ids) - covered)

    def _available(self, hit: PrefixHit | None) -> int:
        """Free blocks, not counting evictable ones the hit is about to revive."""
        revived = sum(1 for b in hit.block_ids if self.pool.ref_counts[b] == 0) if hit else 0
        return self.pool.num_free_blocks - revived

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_tokens` tokens, each
        once (`num_registered_blocks`: a decode step fills at most one, and offering all of them
        again every step cost a millisecond a step at batch 256; the pool keeps a block whose
        content is cached elsewhere as a twin, so nothing needs offering twice)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        self._extend_hashes(request, num_full * self.block_size)
        for i in range(max(request.num_registered_blocks, request.num_released_blocks), num_full):
            self.pool.cache(request.block_ids[i], request.block_hashes[i])
        request.num_registered_blocks = num_full

    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Hash the request's full blocks within its first `num_tokens` tokens, once each."""
        extend_block_hashes(request, request.block_hashes, num_tokens // self.block_size, self.block_size)
