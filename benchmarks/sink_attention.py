"""What gpt-oss's attention sinks cost on the CPU: one attention layer shaped as gpt-oss-20b's (64
query heads, 8 kv heads, head_dim 64), decode steps and a prompt chunk, through the C++ kernel
without sinks, with them (one more logit in each row's softmax denominator) and through the torch
backend with them (plain-torch scores and softmax). Runs interleaved, medians of the rounds.

    python benchmarks/sink_attention.py [--contexts 1024 4096] [--rounds 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from tokenmill.attention import AttentionMetadata, make_backend

HQ, HKV, D, BS = 64, 8, 64, 16


def step(query_lens: list[int], context: int) -> tuple:
    """The last query_lens[i] tokens of sequence i of `context` keys each, in shuffled blocks of a
    fresh pool; every sequence counted short (num_short), as the runner counts them for the C++
    kernel at head_dim 64 (`for_backend` recounts them for another)."""
    blocks_per_seq, batch = -(-context // BS), len(query_lens)
    num_blocks = batch * blocks_per_seq + 1
    tables = torch.randperm(num_blocks - 1).view(batch, blocks_per_seq).int()
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(context - n, context) for n in query_lens])
    rows = torch.cat([torch.full((n,), i) for i, n in enumerate(query_lens)])
    slots = tables[rows, positions // BS].long() * BS + positions % BS
    meta = AttentionMetadata(
        slot_block=slots // BS, slot_offset=slots % BS, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32), block_tables=tables,
        query_start_loc_host=starts, seq_lens_host=[context] * batch, block_size=BS,
        num_short=batch, num_short_tokens=starts[-1])
    t = starts[-1]
    k_cache, v_cache = torch.randn(num_blocks, HKV, BS, D), torch.randn(num_blocks, HKV, BS, D)
    q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    return q, k, v, k_cache, v_cache, meta


def for_backend(inputs: tuple, backend) -> tuple:
    """`inputs` with the sequences the backend takes as short queries counted as the runner counts them."""
    *tensors, meta = inputs
    if max(b - a for a, b in zip(meta.query_start_loc_host, meta.query_start_loc_host[1:])) > backend.short_query_max:
        meta = dataclasses.replace(meta, num_short=0, num_short_tokens=0)
    return (*tensors, meta)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    cpu, sinks = torch.device("cpu"), torch.randn(HQ)
    runs = {"kernel, no sinks": (make_backend("cpu", cpu, BS, D), None),
            "kernel, sinks": (make_backend("cpu", cpu, BS, D), sinks),
            "torch, sinks": (make_backend("torch", cpu, BS, D), sinks)}
    print(f"threads {torch.get_num_threads()}; ms per layer, median of {args.rounds} interleaved rounds")
    print(f"{'step':>16} {'context':>7} " + " ".join(f"{name:>16}" for name in runs))
    for label, query_lens in (("decode x1", [1]), ("decode x8", [1] * 8), ("prompt chunk 512", [512])):
        for context in args.contexts:
            inputs = step(query_lens, context)
            times = {name: [] for name in runs}
            with torch.inference_mode():
                for _ in range(args.rounds + 2):  # the first two rounds warm up
                    for name, (backend, s) in runs.items():
                        start = time.perf_counter()
                        backend.forward(*for_backend(inputs, backend), D ** -0.5, None, None, s)
                        times[name].append(time.perf_counter() - start)
            print(f"{label:>16} {context:>7} " + " ".join(f"{statistics.median(t[2:]) * 1e3:>16.2f}"
                                                            for t in times.values()))


if __name__ == "__main__":
    main()
