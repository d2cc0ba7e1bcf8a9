"""Whether the block pool's twins pay: the `prefix` workload (one 512-token system prompt, 64
questions) through two engines in one process, one whose pool keeps a block computed again while
its content is cached elsewhere as a twin (taking the cached block's place when that is evicted),
one whose pool keeps only the first block of each content (one hash -> block map, as vLLM).
With a roomy pool and with pools small enough to evict and preempt; prefix-cache hit rate,
evictions, preemptions and outputs side by side.

    python benchmarks/prefix_twins.py [--pools 0 160 96] [--seed 0]

(pool 0: the engine's default size). Whichever variant the code does not have is the subclass
below.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the checkout this runs in
import tokenmill.kv_cache as kv_cache  # noqa: E402
from tokenmill.bench.throughput import run_engine  # noqa: E402
from tokenmill.bench.workloads import prefix_workload  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402
from tokenmill.models.loader import default_model_path  # noqa: E402

BlockPool = kv_cache.BlockPool


class TwinPool(BlockPool):
    """The pool as it is, counting the twins it makes and those that replace an evicted block."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.twins_made = self.twins_promoted = 0

    def cache(self, block: int, block_hash: bytes) -> None:
        if self.block_hash[block] is None and block not in self.twin_hash and block_hash in self.cached:
            self.twins_made += 1
        super().cache(block, block_hash)

    def _forget(self, block: int) -> None:
        self.twins_promoted += self.block_hash[block] in self.twins
        super()._forget(block)


class OneMapPool(BlockPool):
    """A block whose content is already cached elsewhere is not cached at all."""

    def cache(self, block: int, block_hash: bytes) -> None:
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.block_hash[block] = block_hash
            self.cached[block_hash] = block


def run(pool_class, num_blocks: int, seed: int) -> tuple[dict, list]:
    kv_cache.BlockPool = pool_class
    try:
        engine = LLMEngine(EngineConfig(model=str(default_model_path()), num_kv_blocks=num_blocks or None))
    finally:
        kv_cache.BlockPool = BlockPool
    result = run_engine(engine, prefix_workload(seed=seed), pool_class.__name__, progress=False)
    stats = engine.scheduler.stats()
    pool = engine.scheduler.kv.pool
    figures = {"hit rate": stats.prefix_tokens_hit / max(stats.prefix_tokens_queried, 1),
               "evictions": stats.num_evictions, "preemptions": stats.num_preemptions,
               "twins made": getattr(pool, "twins_made", "-"),
               "twins promoted": getattr(pool, "twins_promoted", "-"),
               "peak used": max(s.kv_blocks_used for s in result.steps), "wall s": result.wall}
    return figures, result.outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pools", type=int, nargs="+", default=[0, 160, 96])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for num_blocks in args.pools:
        rows = {}
        for pool_class in (TwinPool, OneMapPool):
            rows[pool_class.__name__], outputs = run(pool_class, num_blocks, args.seed)
            rows[pool_class.__name__]["outputs"] = outputs
        same = rows["TwinPool"].pop("outputs") == rows["OneMapPool"].pop("outputs")
        print(f"pool {num_blocks or 'default'} blocks; outputs equal: {same}")
        for name, figures in rows.items():
            print(f"  {name:<10} " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in figures.items()))


if __name__ == "__main__":
    main()
