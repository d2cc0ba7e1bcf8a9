"""What gpt-oss's attention sinks cost on the CPU: one attention layer shaped as gpt-oss-20b's (64
query heads, 8 kv heads, head_dim 64), decode steps and a prompt chunk, through the C++ kernel
without sinks, with them (one more logit in each row's softmax denominator) and through the torch
backend with them (plain-torch scores and softmax). Runs interleaved, medians of the rounds.

    python benchmarks/sink_attention.py [--contexts 1024 4096] [--rounds 15]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from attention_steps import interleaved_medians, paged_step

from tokenmill.attention import make_backend

HQ, HKV, D, BS = 64, 8, 64, 16


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
            inputs = paged_step(query_lens, context, HQ, HKV, D, BS)
            medians = interleaved_medians(
                {name: (lambda b=backend, s=s: b.forward(*for_backend(inputs, b), D ** -0.5, None, None, s))
                 for name, (backend, s) in runs.items()}, args.rounds)
            print(f"{label:>16} {context:>7} " + " ".join(f"{m:>16.2f}" for m in medians.values()))


if __name__ == "__main__":
    main()
