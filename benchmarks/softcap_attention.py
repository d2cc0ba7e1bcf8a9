"""What Gemma 2's soft-capped attention scores cost on the CPU: decode steps of one attention layer
shaped as Gemma 2 2B's (8 query heads, 4 kv heads, head_dim 256) through the C++ kernel without a
cap, with one (c * tanh(s / c) on every score) and through the torch backend with one (what a
capped model ran on before the kernel took the cap). Runs interleaved, medians of the rounds.

    python benchmarks/softcap_attention.py [--contexts 1024 4096] [--batches 1 8] [--rounds 15]
"""

from __future__ import annotations

import argparse

import torch
from attention_steps import interleaved_medians, paged_step

from tokenmill.attention import make_backend

HQ, HKV, D, BS = 8, 4, 256, 16


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
            step = paged_step([1] * batch, context, HQ, HKV, D, BS)
            medians = interleaved_medians({name: (lambda b=backend, c=cap: b.forward(*step, D ** -0.5, None, c))
                                           for name, (backend, cap) in runs.items()}, args.rounds)
            print(f"{batch:>5} {context:>7} " + " ".join(f"{m:>15.2f}" for m in medians.values()))


if __name__ == "__main__":
    main()
