"""What Gemma 2's soft-capped attention scores cost on the CPU: decode steps of one attention layer
shaped as Gemma 2 2B's (8 query heads, 4 kv heads, head_dim 256) through the C++ kernel without a
cap, with one (c * tanh(s / c) on every score) and through the torch backend with one (what a
capped model ran on before the kernel took the cap). Runs interleaved, medians of the rounds.

    python benchmarks/softcap_attention.py [--contexts 1024 4096] [--batches 1 8] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.attention import AttentionMetadata, make_backend

HQ, HKV, D, BS = 8, 4, 256, 16


def decode_step(batch: int, context: int) -> tuple:
    """One decode token per sequence over `context` keys each, in shuffled blocks of a fresh pool."""
    blocks_per_seq = -(-context // BS)
    num_blocks = batch * blocks_per_seq + 1
    pool = torch.randperm(num_blocks - 1)
    tables = pool.view(batch, blocks_per_seq).int()
    last = context - 1
    slots = tables[:, last // BS].long() * BS + last % BS
    meta = AttentionMetadata(
        slot_block=slots // BS, slot_offset=slots % BS, query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32), block_tables=tables,
        query_start_loc_host=list(range(batch + 1)), seq_lens_host=[context] * batch, block_size=BS,
        num_short=batch, num_short_tokens=batch)
    k_cache, v_cache = torch.randn(num_blocks, HKV, BS, D), torch.randn(num_blocks, HKV, BS, D)
    q, k, v = torch.randn(batch, HQ, D), torch.randn(batch, HKV, D), torch.randn(batch, HKV, D)
    return q, k, v, k_cache, v_cache, meta


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    runs = {"kernel, no cap": (make_backend("cpu", cpu, BS, D), None),
            "kernel, cap 50": (make_backend("cpu", cpu, BS, D), 50.0),
            "torch, cap 50": (make_backend("torch", cpu, BS, D), 50.0)}
    print(f"threads {torch.get_num_threads()}; ms per layer, median of {args.rounds} interleaved rounds")
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{name:>15}" for name in runs))
    for batch in args.batches:
        for context in args.contexts:
            step = decode_step(batch, context)
            times = {name: [] for name in runs}
            with torch.inference_mode():
                for _ in range(args.rounds + 2):  # the first two rounds warm up
                    for name, (backend, cap) in runs.items():
                        start = time.perf_counter()
                        backend.forward(*step, D ** -0.5, None, cap)
                        times[name].append(time.perf_counter() - start)
            print(f"{batch:>5} {context:>7} " + " ".join(f"{statistics.median(t[2:]) * 1e3:>15.2f}"
                                                          for t in times.values()))


if __name__ == "__main__":
    main()
