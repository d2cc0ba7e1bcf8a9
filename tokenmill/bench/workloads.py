"""Benchmark workloads: lists of requests with fixed prompt token ids and output lengths.

All are deterministic for a seed, use random token ids (so no tokenizer is involved), and
ask for exact output lengths (EOS ignored), so every engine does the same work.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def random_workload(num_requests: int = 64, prompt_len: tuple[int, int] = (32, 256),
                    output_len: tuple[int, int] = (32, 256), seed: int = 0,
                    vocab: int = 10000) -> list[BenchRequest]:
    """Prompt and output lengths uniform in the given inclusive ranges, token ids in [0, vocab)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        p = rng.randint(*prompt_len)
        o = rng.randint(*output_len)
        out.append(BenchRequest([rng.randrange(vocab) for _ in range(p)], o))
    return out


def prefix_workload(num_requests: int = 64, system_len: int = 512, question_len: tuple[int, int] = (32, 128),
                    output_len: int = 64, seed: int = 0, vocab: int = 10000) -> list[BenchRequest]:
    """One shared system prompt followed by a distinct question per request."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(system_len)]
    return [BenchRequest(system + [rng.randrange(vocab) for _ in range(rng.randint(*question_len))], output_len)
            for _ in range(num_requests)]


def long_workload(num_short: int = 32, short_prompt: int = 64, short_output: int = 128,
                  num_long: int = 1, long_prompt: int = 4000, long_output: int = 16,
                  seed: int = 0, vocab: int = 10000) -> list[BenchRequest]:
    """Many short chats decoding, then a few long prompts arriving among them (they come last,
    so with continuous batching they land while the short ones decode)."""
    rng = random.Random(seed)
    short = [BenchRequest([rng.randrange(vocab) for _ in range(short_prompt)], short_output)
             for _ in range(num_short)]
    long = [BenchRequest([rng.randrange(vocab) for _ in range(long_prompt)], long_output) for _ in range(num_long)]
    return short + long


WORKLOADS = {"random": random_workload, "prefix": prefix_workload, "long": long_workload}


def static_batches(workload: list[BenchRequest], batch_size: int, pad_token_id: int) -> list[BenchRequest]:
    """The same requests as static batching runs them: consecutive batches, each prompt left-padded
    to the batch's longest prompt and each output extended to the batch's longest output."""
    out = []
    for i in range(0, len(workload), batch_size):
        batch = workload[i:i + batch_size]
        longest_prompt = max(len(r.prompt_token_ids) for r in batch)
        longest_output = max(r.max_tokens for r in batch)
        out.extend(BenchRequest([pad_token_id] * (longest_prompt - len(r.prompt_token_ids)) + r.prompt_token_ids,
                                longest_output) for r in batch)
    return out
