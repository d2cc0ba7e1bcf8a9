"""The CPU attention kernel alone on one prompt chunk late in a long prompt, for builds of the
kernels from several checkouts side by side in one process (rounds alternated).

    python benchmarks/cpu_prompt_attention.py old=/tmp/old/tokenmill/csrc new=tokenmill/csrc [--rounds 15]

One sequence, the default model's heads (9 query, 3 kv, D 64), blocks of 16 at random places in
the pool: a 512-token chunk at the end of contexts of 600 (a float16 pool), 2,000 and 8,000 keys
(float32), the case of a long prompt's later chunks. Prints each build's median time and GFLOP/s
(the chunk's causal QK and PV products), and whether its outputs equal the first build's bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_builds import build_named  # noqa: E402 (beside this script)

D, HQ, HKV, BLOCK, CHUNK = 64, 9, 3, 16, 512
CASES = [(600, torch.float16), (2000, torch.float32), (8000, torch.float32)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="name=path/to/csrc")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    builds = build_named(args.builds)
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads; a {CHUNK}-token chunk ending a context of L keys")
    for context, dtype in CASES:
        num_blocks = -(-context // BLOCK)
        k = torch.randn(num_blocks + 8, HKV, BLOCK, D).to(dtype)
        v = torch.randn(num_blocks + 8, HKV, BLOCK, D).to(dtype)
        table = torch.randperm(num_blocks + 8)[:num_blocks].to(torch.int32).view(1, num_blocks).contiguous()
        q = torch.randn(CHUNK, HQ, D)
        query_start, seq_lens = torch.tensor([0, CHUNK], dtype=torch.int32), torch.tensor([context], dtype=torch.int32)

        def run(mod) -> torch.Tensor:
            return mod.paged_attention(q, k, v, table, query_start, seq_lens, D ** -0.5)
        outs = {name: run(mod) for name, mod in builds.items()}
        times: dict[str, list[float]] = {name: [] for name in builds}
        for _ in range(args.rounds):
            for name, mod in builds.items():
                start = time.perf_counter()
                run(mod)
                times[name].append(time.perf_counter() - start)
        flops = HQ * CHUNK * (context - CHUNK / 2) * D * 4
        first = next(iter(outs.values()))
        for name in builds:
            med = statistics.median(times[name])
            same = "identical to" if torch.equal(outs[name], first) else "DIFFER from"
            print(f"L={context} ({str(dtype).removeprefix('torch.')} pool) {name}: {med * 1e3:.1f} ms, "
                  f"{flops / med / 1e9:.1f} GFLOP/s, outputs {same} the first build's")


if __name__ == "__main__":
    main()
