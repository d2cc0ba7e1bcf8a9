"""The CPU attention kernel alone, decodes over 30 layers of the default model's shapes, for builds
of the kernels from several checkouts, and pools of several dtypes, side by side in one process
(rounds alternated).

    python benchmarks/cpu_attention.py old=/tmp/old/tokenmill/csrc new=tokenmill/csrc \
        [--batch 64] [--context 300] [--contiguous] [--heads 16 16 --head-dim 128] \
        [--kv-dtype float16 int8] [--block-size 16 32]

Each checkout's csrc is built as its own extension module (kernel_builds.py). The pool sits on
huge pages as the engine's does, one (K, V) pair per layer, the sequences' blocks at random places
in it (or one after another with --contiguous), so every layer reads from memory.
Prints each build's median time for the 30 layers and the rate it reads K/V at, beside a plain
sequential read of the pool for scale. An int8 pool holds random codes and a scale per row.
Several dtypes or block sizes are pools of their own, alternated as the builds are.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))  # the checkout this runs in
from kernel_builds import build_named  # noqa: E402 (beside this script)

from tokenmill.host_memory import huge_page_zeros  # noqa: E402
from tokenmill.worker import pool_row_width  # noqa: E402

LAYERS = 30


def random_pool(num_blocks: int, hkv: int, block: int, d: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """(LAYERS, 2, num_blocks, hkv, block, row) on huge pages, as worker.py lays the pool out."""
    pool = huge_page_zeros((LAYERS, 2, num_blocks, hkv, block, pool_row_width(d, kv_dtype)), kv_dtype)
    if kv_dtype != torch.int8:
        return pool.normal_()
    runs = pool.view(LAYERS, 2, num_blocks, hkv, -1)  # each run: `block` rows of codes, then their scales
    runs[..., :block * d] = torch.randint(-127, 128, runs[..., :block * d].shape, dtype=torch.int8)
    runs[..., block * d:].view(torch.float32).fill_(1 / 50)  # about normal values' spread
    return pool


def random_tables(batch: int, blocks_per_seq: int, num_blocks: int, contiguous: bool) -> torch.Tensor:
    """Each sequence's blocks: one after another, or at random places in the pool."""
    order = torch.arange(num_blocks) if contiguous else torch.randperm(num_blocks)
    return order[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="name=path/to/csrc")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--contiguous", action="store_true")
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"),
                        help="query and kv heads (the default model's: 9 and 3)")
    parser.add_argument("--head-dim", type=int, default=64, help="the default model's: 64")
    parser.add_argument("--kv-dtype", nargs="+", choices=("float32", "float16", "bfloat16", "int8"),
                        default=["float32"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block-size", type=int, nargs="+", default=[16], help="tokens per block (default 16)")
    args = parser.parse_args()
    D = args.head_dim
    builds = build_named(args.builds)
    torch.manual_seed(0)
    hq, hkv = args.heads
    q = torch.randn(args.batch, hq, D)
    query_start = torch.arange(args.batch + 1, dtype=torch.int32)
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    pools, tables = {}, {}  # by (dtype, block size)
    for block in args.block_size:
        blocks_per_seq = -(-args.context // block)
        num_blocks = args.batch * blocks_per_seq + 200
        tables[block] = random_tables(args.batch, blocks_per_seq, num_blocks, args.contiguous)
        for name in args.kv_dtype:
            pools[name, block] = random_pool(num_blocks, hkv, block, D, getattr(torch, name))

    def run(mod, pool: torch.Tensor, table: torch.Tensor) -> list[torch.Tensor]:
        return [mod.paged_attention(q, pool[layer, 0], pool[layer, 1], table, query_start, seq_lens, D ** -0.5)
                for layer in range(LAYERS)]

    runs = [(f"{name}/{dtype}/{block}", mod, pool, tables[block])
            for name, mod in builds.items() for (dtype, block), pool in pools.items()]
    outs = {label: run(mod, pool, table) for label, mod, pool, table in runs}
    times: dict[str, list[float]] = {label: [] for label, *_ in runs}
    for _ in range(args.rounds):
        for label, mod, pool, table in runs:
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                run(mod, pool, table)
                best = min(best, time.perf_counter() - start)
            times[label].append(best)
    layout = "contiguous" if args.contiguous else "scattered"
    print(f"batch {args.batch}, context {args.context}, {layout} blocks, {torch.get_num_threads()} threads;"
          " label: build/dtype/block size")
    for label, mod, pool, table in runs:
        med = statistics.median(times[label])
        gigabytes = LAYERS * 2 * args.batch * args.context * hkv * pool.shape[-1] * pool.element_size() / 1e9
        first = outs[f"{next(iter(builds))}/{label.split('/', 1)[1]}"]  # the first build's, same pool
        same = all(torch.equal(a, b) for a, b in zip(outs[label], first))
        print(f"{label:>20}: {med * 1e3:7.2f} ms for {LAYERS} layers, {gigabytes / med:5.1f} GB/s of K/V"
              f" (outputs of all layers {'identical' if same else 'DIFFER'} to the first build's)")
    for (dtype, block), pool in pools.items():
        start = time.perf_counter()
        pool.view(-1).view(torch.float32).sum()  # the bytes as float32, whatever they hold
        seconds = time.perf_counter() - start
        rate = pool.numel() * pool.element_size() / 1e9 / seconds
        print(f"a sequential read of the whole {dtype} pool of blocks of {block}: {rate:.1f} GB/s")


if __name__ == "__main__":
    main()
