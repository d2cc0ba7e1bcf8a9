"""The CPU attention kernel alone, decodes over 30 layers of the default model's shapes, for builds
of the kernels from several checkouts side by side in one process (rounds alternated).

    python benchmarks/cpu_attention.py old=/tmp/old/tokenmill/csrc new=tokenmill/csrc \
        [--batch 64] [--context 300] [--contiguous] [--heads 16 16 --head-dim 128 --kv-dtype float16]

Each checkout's csrc is built as its own extension module (kernel_builds.py). The pool sits on
huge pages as the engine's does, one (K, V) pair per layer, the sequences' blocks at random places
in it (or one after another with --contiguous), so every layer reads from memory.
Prints each build's median time for the 30 layers and the rate it reads K/V at, beside a plain
sequential read of the pool for scale.
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

LAYERS, BLOCK = 30, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="name=path/to/csrc")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--contiguous", action="store_true")
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"),
                        help="query and kv heads (the default model's: 9 and 3)")
    parser.add_argument("--head-dim", type=int, default=64, help="the default model's: 64")
    parser.add_argument("--kv-dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    D, kv_dtype = args.head_dim, getattr(torch, args.kv_dtype)
    builds = build_named(args.builds)
    torch.manual_seed(0)
    hq, hkv = args.heads
    blocks_per_seq = -(-args.context // BLOCK)
    num_blocks = args.batch * blocks_per_seq + 200
    pool = huge_page_zeros((LAYERS, 2, num_blocks, hkv, BLOCK, D), kv_dtype)
    pool.normal_()
    order = torch.arange(num_blocks) if args.contiguous else torch.randperm(num_blocks)
    tables = order[: args.batch * blocks_per_seq].view(args.batch, blocks_per_seq).to(torch.int32).contiguous()
    q = torch.randn(args.batch, hq, D)
    query_start = torch.arange(args.batch + 1, dtype=torch.int32)
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32)

    def run(mod) -> list[torch.Tensor]:
        return [mod.paged_attention(q, pool[layer, 0], pool[layer, 1], tables, query_start, seq_lens, D ** -0.5)
                for layer in range(LAYERS)]

    outs = {name: run(mod) for name, mod in builds.items()}
    first = next(iter(outs.values()))
    times: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(args.rounds):
        for name, mod in builds.items():
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                run(mod)
                best = min(best, time.perf_counter() - start)
            times[name].append(best)
    gigabytes = LAYERS * 2 * args.batch * args.context * hkv * D * kv_dtype.itemsize / 1e9
    layout = "contiguous" if args.contiguous else "scattered"
    print(f"batch {args.batch}, context {args.context}, {layout} blocks, {torch.get_num_threads()} threads")
    for name, ts in times.items():
        med = statistics.median(ts)
        same = all(torch.equal(a, b) for a, b in zip(outs[name], first))
        print(f"{name:>8}: {med * 1e3:7.2f} ms for {LAYERS} layers, {gigabytes / med:5.1f} GB/s of K/V"
              f" (outputs of all layers {'identical' if same else 'DIFFER'} to the first build's)")
    start = time.perf_counter()
    pool.sum()
    seconds = time.perf_counter() - start
    print(f"a sequential read of the whole pool: {pool.numel() * kv_dtype.itemsize / 1e9 / seconds:.1f} GB/s")


if __name__ == "__main__":
    main()
