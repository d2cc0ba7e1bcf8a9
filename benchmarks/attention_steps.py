"""What the one-layer attention benchmarks (softcap_attention.py, sink_attention.py) share: a step
over a fresh paged pool, and medians of runs that take turns."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from tokenmill.attention import AttentionMetadata


def paged_step(query_lens: list[int], context: int, hq: int, hkv: int, d: int, bs: int) -> tuple:
    """(q, k, v, k_cache, v_cache, meta): the last query_lens[i] tokens of sequence i of `context`
    keys each, in shuffled blocks of a fresh pool of `hkv` heads of `d` dims in blocks of `bs`;
    every sequence counted short (num_short), as the runner counts decodes for the C++ kernel."""
    blocks_per_seq, batch = -(-context // bs), len(query_lens)
    num_blocks = batch * blocks_per_seq + 1
    tables = torch.randperm(num_blocks - 1).view(batch, blocks_per_seq).int()
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(context - n, context) for n in query_lens])
    rows = torch.cat([torch.full((n,), i) for i, n in enumerate(query_lens)])
    slots = tables[rows, positions // bs].long() * bs + positions % bs
    meta = AttentionMetadata(
        slot_block=slots // bs, slot_offset=slots % bs, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32), block_tables=tables,
        query_start_loc_host=starts, seq_lens_host=[context] * batch, block_size=bs,
        num_short=batch, num_short_tokens=starts[-1])
    t = starts[-1]
    k_cache, v_cache = torch.randn(num_blocks, hkv, bs, d), torch.randn(num_blocks, hkv, bs, d)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    return q, k, v, k_cache, v_cache, meta


def interleaved_medians(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each run's median time in ms over `rounds` rounds in which the runs take turns, after two
    warm-up rounds, under torch.inference_mode."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for _ in range(rounds + 2):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
