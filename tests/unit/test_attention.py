"""Attention backends against a dense float64 oracle on a random paged pool."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import needs_triton

from tokenmill.attention import AttentionMetadata, make_backend

BS, HKV, HQ, D = 16, 2, 6, 16  # Triton's tl.dot needs tiles of at least 16


def build_case(query_lens, seq_lens, seed=0, hkv=HKV, hq=HQ, d=D):
    """Random pool and a ragged batch whose sequences live in shuffled, non-contiguous blocks."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-s // BS) for s in seq_lens) + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, contexts = [], [], []
    k_cache = torch.randn(num_blocks, hkv, BS, d, generator=g)
    v_cache = torch.randn(num_blocks, hkv, BS, d, generator=g)
    for q_len, s_len in zip(query_lens, seq_lens):
        blocks = [free.pop() for _ in range(-(-s_len // BS))]
        tables.append(blocks)
        seq_slots = [blocks[p // BS] * BS + p % BS for p in range(s_len)]
        slots.extend(seq_slots[s_len - q_len:])
        contexts.append(seq_slots)
    t = sum(query_lens)
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    width = max(len(b) for b in tables)
    bt = torch.tensor([b + [0] * (width - len(b)) for b in tables], dtype=torch.int32)
    cu = [0]
    for q_len in query_lens:
        cu.append(cu[-1] + q_len)
    short = 0
    while short < len(query_lens) and query_lens[short] == 1:
        short += 1
    slots = torch.tensor(slots)
    meta = AttentionMetadata(
        slot_block=slots // BS, slot_offset=slots % BS, query_start_loc=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt, query_start_loc_host=cu,
        seq_lens_host=list(seq_lens), block_size=BS, num_short=short, num_short_tokens=cu[short])
    return q, k, v, k_cache, v_cache, meta, contexts


def by_slot(cache):
    """(num_blocks, Hkv, bs, D) -> (slots, Hkv, D), slot = block * bs + offset."""
    return cache.transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])


def _to(meta: AttentionMetadata, device) -> AttentionMetadata:
    import dataclasses
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


def dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, scale, window=None, softcap=None, sinks=None):
    slots = meta.slot_block * BS + meta.slot_offset
    k_cache, v_cache = by_slot(k_cache).double(), by_slot(v_cache).double()
    k_cache[slots] = k.double()
    v_cache[slots] = v.double()
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i, ctx in enumerate(contexts):
        start, end = meta.query_start_loc_host[i], meta.query_start_loc_host[i + 1]
        keys, values = k_cache[ctx], v_cache[ctx]  # (L, Hkv, D)
        for j, t in enumerate(range(start, end)):
            visible = len(ctx) - (end - start) + j + 1
            seen = slice(0 if window is None else max(0, visible - window), visible)
            for h in range(q.shape[1]):
                scores = keys[seen, h // group] @ q[t, h].double() * scale
                if softcap is not None:
                    scores = (scores / softcap).tanh() * softcap
                if sinks is not None:  # one more logit in the softmax, its probability dropped
                    out[t, h] = torch.cat([scores, sinks[h:h + 1].double()]).softmax(0)[:-1] @ values[seen, h // group]
                else:
                    out[t, h] = scores.softmax(0) @ values[seen, h // group]
    return out


CASES = {
    "decodes_only": ([1, 1, 1], [5, 17, 1]),
    "prefill_only": ([9, 12], [9, 12]),
    "mixed": ([1, 1, 3, 7, 20], [33, 2, 10, 7, 45]),
    # chunks over several 64-token tiles (Triton's prefill kernel), continuing earlier ones, and a
    # decode over more than 64 keys (several steps of the decode kernel)
    "long_chunks": ([1, 1, 70, 130, 5], [140, 3, 100, 130, 200]),
}


BACKENDS = ["reference", "torch", "cpu", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_dense_oracle(backend_name, case):
    device = torch.device("cuda" if backend_name == "triton" and torch.cuda.is_available() else "cpu")
    backend = make_backend(backend_name, device, block_size=BS, head_dim=D)
    q, k, v, k_cache, v_cache, meta, contexts = (x.to(device) if isinstance(x, torch.Tensor) else x
                                                 for x in build_case(*CASES[case]))
    meta = _to(meta, device)
    if getattr(backend, "short_query_max", 0) < 1:
        meta.num_short = meta.num_short_tokens = 0
    scale = D ** -0.5
    expected = dense_oracle(q.cpu(), k.cpu(), v.cpu(), k_cache.cpu(), v_cache.cpu(), _to(meta, "cpu"), contexts, scale)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale).cpu()
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)
    # the step's K/V landed in the pool
    slots = (meta.slot_block * BS + meta.slot_offset).cpu()
    assert torch.equal(by_slot(k_cache.cpu())[slots], k.cpu()) and torch.equal(by_slot(v_cache.cpu())[slots], v.cpu())


def poison_outside_window(k_cache, v_cache, meta, window):
    """Point each sequence's blocks that no query of the step can see (wholly before its first
    query's window) at a NaN-filled block, as a pool does once it gives them back: a backend that
    reads one returns NaN. Returns the pools with that block appended."""
    poison = k_cache.shape[0]
    for i in range(meta.num_seqs):
        q_len = meta.query_start_loc_host[i + 1] - meta.query_start_loc_host[i]
        first_seen = max(0, meta.seq_lens_host[i] - q_len - window + 1)
        meta.block_tables[i, :first_seen // BS] = poison
    nan = torch.full_like(k_cache[:1], float("nan"))
    return torch.cat([k_cache, nan]), torch.cat([v_cache, nan])


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("window", [1, 16, 37])
@pytest.mark.parametrize("case", ["mixed", "long_chunks"])
def test_backend_restricted_to_a_sliding_window_matches_dense_oracle(backend_name, window, case):
    """Each query sees its last `window` positions only (itself included, as transformers'
    sliding-window mask), and blocks wholly before the window are never read."""
    device = torch.device("cuda" if backend_name == "triton" and torch.cuda.is_available() else "cpu")
    backend = make_backend(backend_name, device, block_size=BS, head_dim=D)
    q, k, v, k_cache, v_cache, meta, contexts = build_case(*CASES[case], seed=window)
    expected = dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, 0.25, window)
    k_cache, v_cache = poison_outside_window(k_cache, v_cache, meta, window)
    if getattr(backend, "short_query_max", 0) < 1:
        meta.num_short = meta.num_short_tokens = 0
    out = backend.forward(*(x.to(device) for x in (q, k, v, k_cache, v_cache)), _to(meta, device), 0.25, window)
    assert torch.allclose(out.cpu().double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [5, 100, 300])
@pytest.mark.parametrize("query_lens,seq_lens", [([1], [1000]), ([1, 1, 20, 9], [300, 70, 420, 9])])
def test_cpu_kernel_restricted_to_a_window(window, query_lens, seq_lens):
    """The C++ kernel with a window, every sequence in it: a lone decode whose window is split in
    parts (300 keys: 2 parts of whole blocks) or not, and prompt tiles of a head size that would
    take the tile products without a window; blocks before the window hold NaN."""
    backend = make_backend("cpu", torch.device("cpu"))
    q, k, v, k_cache, v_cache, meta, contexts = build_case(query_lens, seq_lens, seed=7, hkv=2, hq=8, d=64)
    meta.num_short, meta.num_short_tokens = len(query_lens), sum(query_lens)
    expected = dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, 0.125, window)
    k_cache, v_cache = poison_outside_window(k_cache, v_cache, meta, window)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, window)
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("num_sms", [1, 12, 64])  # 1, 2 and 16 splits of each context for 3 decodes
def test_triton_decode_splits_contexts(num_sms):
    """Flash-decoding: contexts split over several programs and merged equal the oracle, with
    splits that get no keys (short contexts), and in a mixed step that writes into a view."""
    from tokenmill.attention.triton_decode import TritonPagedAttention
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = TritonPagedAttention(num_sms=num_sms)
    for query_lens, seq_lens in (([1, 1, 1], [300, 2, 65]), ([1, 1, 1, 20], [130, 1, 64, 40])):
        q, k, v, k_cache, v_cache, meta, contexts = build_case(query_lens, seq_lens, seed=num_sms)
        expected = dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, 0.25)
        out = backend.forward(*(x.to(device) for x in (q, k, v, k_cache, v_cache)), _to(meta, device), 0.25)
        assert torch.allclose(out.cpu().double(), expected, rtol=1e-4, atol=1e-5)


def test_decode_splits_fill_the_gpu():
    pytest.importorskip("triton")
    from tokenmill.attention.triton_decode import decode_splits
    assert decode_splits(1, 8, 132) == 16      # 8 programs: as many splits as allowed
    assert decode_splits(4, 8, 132) == 8       # 32 programs: 5 splits wanted, a power of two
    assert decode_splits(16, 8, 132) == 2
    assert decode_splits(17, 8, 132) == 1      # 136 programs fill 132 SMs


def test_cpu_kernel_handles_multi_token_short_queries():
    """Speculative verification sends a few query tokens per sequence through the kernel."""
    backend = make_backend("cpu", torch.device("cpu"))
    q, k, v, k_cache, v_cache, meta, contexts = build_case([3, 4, 2], [40, 9, 2], seed=3)
    meta.num_short, meta.num_short_tokens = 3, 9
    expected = dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, 0.25)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.25)
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 8])
@pytest.mark.parametrize("query_lens", [[20, 9, 1, 17], [20, 9, 1, 17, 1, 1, 1, 8, 1, 3]])
def test_cpu_kernel_tiles_prompt_chunks(query_lens, threads):
    """Prompt chunks longer than a tile (8 tokens) through the kernel: each token still sees
    exactly the keys up to itself. With 1 thread both batches have enough tiles for items of all
    kv heads; with 8 threads they have few, and an item takes one kv head."""
    backend = make_backend("cpu", torch.device("cpu"))
    seq_lens = [q + 13 * i for i, q in enumerate(query_lens)]
    q, k, v, k_cache, v_cache, meta, contexts = build_case(query_lens, seq_lens, seed=11, hkv=3, hq=9, d=64)
    meta.num_short, meta.num_short_tokens = len(query_lens), sum(query_lens)
    expected = dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("seq_lens", [[1000], [300, 70], [129, 1, 640, 64, 200]])
@pytest.mark.parametrize("hkv,hq,d", [(3, 9, 64), (2, 16, 32)])  # group 16: would take the prompt route unsplit
def test_cpu_kernel_splits_decode_contexts(threads, seq_lens, hkv, hq, d):
    """A step of few decodes splits each long context into parts of whole blocks, one per work
    item, and merges the parts' softmax sums: the result must still be each token's attention
    over its whole context, for any number of parts (threads) and contexts too short to split."""
    backend = make_backend("cpu", torch.device("cpu"))
    q, k, v, k_cache, v_cache, meta, contexts = build_case([1] * len(seq_lens), seq_lens, seed=3, hkv=hkv, hq=hq, d=d)
    expected = dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, d ** -0.5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = backend.forward(q, k, v, k_cache, v_cache, meta, d ** -0.5)
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hkv,hq,d", [(3, 9, 64), (2, 4, 128), (1, 7, 32), (4, 4, 8), (2, 16, 24)])
@pytest.mark.parametrize("many_tokens", [False, True])
def test_cpu_kernel_head_shapes(hkv, hq, d, many_tokens):
    """Group sizes 1 to 8 and head dims on every code path (AVX2 tiles of 32 and 8 floats); few
    tokens give one kv head per work item, many give all of a token's heads."""
    backend = make_backend("cpu", torch.device("cpu"))
    n = 40 if many_tokens else 2
    query_lens, seq_lens = [1] * n, [1 + (7 * i) % 61 for i in range(n)]
    q, k, v, k_cache, v_cache, meta, contexts = build_case(query_lens, seq_lens, seed=5, hkv=hkv, hq=hq, d=d)
    expected = dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, d ** -0.5)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, d ** -0.5)
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hkv,hq", [(3, 9), (2, 4), (2, 14), (1, 5)])  # groups of 3, 2, 3 + 3 + 1 and 3 + 2
def test_cpu_kernel_query_heads_together_or_alone(hkv, hq, dtype):
    """The query heads of a kv head are scored together (each key loaded once for two or three of
    them); every head's output must be the same, bit for bit, as with that head alone against its
    kv head, for decodes (and a two-token chunk where that makes fewer than 8 query rows per kv
    head: from 8 rows a tile takes the matrix-product route), with partly filled last blocks, at
    a scale that is not a power of two (so that where it is applied shows in the bits)."""
    backend = make_backend("cpu", torch.device("cpu"))
    group = hq // hkv
    query_lens, seq_lens = [1, 1, 2 if 2 * group < 8 else 1, 1], [45, 100, 19, 3]
    q, k, v, k_cache, v_cache, meta, _ = build_case(query_lens, seq_lens, seed=17, hkv=hkv, hq=hq, d=64)
    meta.num_short, meta.num_short_tokens = len(query_lens), sum(query_lens)  # all through the kernel
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    together = backend.forward(q, k, v, k_cache, v_cache, meta, 0.1)
    for head in range(hq):
        kv = head // group
        alone = backend.forward(q[:, head:head + 1].contiguous(), k[:, kv:kv + 1].contiguous(),
                                v[:, kv:kv + 1].contiguous(), k_cache[:, kv:kv + 1].contiguous(),
                                v_cache[:, kv:kv + 1].contiguous(), meta, 0.1)
        assert torch.equal(together[:, head], alone[:, 0]), head


@pytest.mark.parametrize("hkv,hq,d", [(3, 9, 64), (2, 4, 128), (2, 2, 64), (1, 7, 32), (2, 16, 24)])
def test_cpu_kernel_prompt_chunks_head_shapes(hkv, hq, d):
    """Prompt chunks through the kernel: tiles of 8 query rows or more per kv head run as small
    matrix products when d is a multiple of 32 (group sizes 1 to 8, a partial last panel of 16
    rows, a first chunk and later chunks, a 300-token chunk in tiles of 16, pass 2's last 1 to 5
    rows after its groups of six), the per-row path otherwise; every query still sees exactly the
    keys up to itself."""
    backend = make_backend("cpu", torch.device("cpu"), head_dim=d)
    query_lens = [1, 300, 3, 37, 8, 2, 15]
    seq_lens = [40, 330, 3, 37, 100, 9, 95]
    q, k, v, k_cache, v_cache, meta, contexts = build_case(query_lens, seq_lens, seed=13, hkv=hkv, hq=hq, d=d)
    meta.num_short, meta.num_short_tokens = len(query_lens), sum(query_lens)
    expected = dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, d ** -0.5)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, d ** -0.5)
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 8, 12, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_kernel_other_block_sizes(block_size, dtype):
    """The kernel at block sizes other than 16 (prompt tiles, a long chunk, a decode), against the
    reference backend's per-sequence SDPA over the same pool: blocks of one key, blocks that do not
    divide a prompt tile's span of 64 keys in pass 2 (12), and blocks longer than it (128)."""
    from tokenmill.attention.reference import attend_sequence
    from tokenmill.cpu_kernels import load_cpu_kernels
    kernels = load_cpu_kernels(required=True)
    g = torch.Generator().manual_seed(1)
    query_lens, seq_lens = [30, 1, 300, 9], [70, 20, 300, 9]
    width = max(-(-s // block_size) for s in seq_lens)
    num_blocks, hkv, d, hq = 4 * width + 8, 2, 64, 8
    k_cache = torch.randn(num_blocks, hkv, block_size, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, hkv, block_size, d, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:4 * width].view(4, width).int()
    q = torch.randn(sum(query_lens), hq, d, generator=g)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = kernels.paged_attention(q, k_cache, v_cache, tables, starts, torch.tensor(seq_lens, dtype=torch.int32), 0.125)
    expected = torch.cat([attend_sequence(q[starts[i]:starts[i + 1]], k_cache, v_cache, tables[i], seq_lens[i], 0.125)
                          for i in range(4)])
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_cpu_backend_routes_prompt_chunks_by_head_size():
    assert make_backend("cpu", torch.device("cpu"), head_dim=64).short_query_max > 100_000
    assert make_backend("cpu", torch.device("cpu"), head_dim=24).short_query_max == 32


FP16_CASES = {**CASES, "many_decodes": ([1] * 40, [1 + (7 * i) % 61 for i in range(40)]),
              "kernel_tiles": ([20, 1, 9], [50, 17, 9])}


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend_name", ["reference", "torch", "cpu"])
@pytest.mark.parametrize("case", list(FP16_CASES))
def test_two_byte_pool_matches_the_oracle_on_its_rounded_values(backend_name, case, pool_dtype):
    """kv_cache_dtype="float16" or "bfloat16": the step's K/V are rounded into the pool (to nearest,
    as torch converts), and attention over the pool equals exact attention over those rounded values
    (the kernel widens them to float32)."""
    backend = make_backend(backend_name, torch.device("cpu"), block_size=BS, head_dim=64)
    q, k, v, k_cache, v_cache, meta, contexts = build_case(*FP16_CASES[case], seed=7, hkv=3, hq=9, d=64)
    if case == "kernel_tiles" and backend_name == "cpu":  # every sequence through the kernel
        meta.num_short, meta.num_short_tokens = 3, 30
    k_cache, v_cache = k_cache.to(pool_dtype), v_cache.to(pool_dtype)
    expected = dense_oracle(q, k.to(pool_dtype).float(), v.to(pool_dtype).float(), k_cache.float(), v_cache.float(),
                            meta, contexts, 0.125)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)
    slots = meta.slot_block * BS + meta.slot_offset
    assert torch.equal(by_slot(k_cache)[slots], k.to(pool_dtype))
    assert torch.equal(by_slot(v_cache)[slots], v.to(pool_dtype))


@pytest.mark.parametrize("backend_name", ["reference", "cpu"])
def test_float16_pool_saturates_instead_of_overflowing(backend_name):
    backend = make_backend(backend_name, torch.device("cpu"), block_size=BS, head_dim=64)
    q, k, v, k_cache, v_cache, meta, contexts = build_case([1], [5], seed=2, hkv=3, hq=9, d=64)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    k[0, 0, 0], v[0, 0, 0] = 1e6, -1e6
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    slot = int(meta.slot_block[0] * BS + meta.slot_offset[0])
    assert by_slot(k_cache)[slot, 0, 0] == 65504 and by_slot(v_cache)[slot, 0, 0] == -65504
    assert torch.isfinite(out).all()


def test_cpu_write_kv_rejects_bad_slots_and_shapes():
    kernel = make_backend("cpu", torch.device("cpu")).kernel
    k_cache, v_cache = torch.zeros(4, HKV, BS, D), torch.zeros(4, HKV, BS, D)
    k = v = torch.ones(1, HKV, D)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel.write_kv(k, v, k_cache, v_cache, torch.tensor([4]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="shapes disagree"):
        kernel.write_kv(torch.ones(1, 1, D), torch.ones(1, 1, D), k_cache, v_cache, torch.tensor([0]),
                        torch.tensor([0]))
    assert not k_cache.any()


def test_the_triton_backend_is_refused_off_cuda_without_the_interpreter(monkeypatch):
    """Off CUDA every Triton launch would fail ("0 active drivers"), each step failing its
    requests: the engine is refused at construction instead."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA"):
        make_backend("triton", torch.device("cpu"))


@pytest.mark.parametrize("query_len", [1, 9])
def test_non_finite_scores_give_nan_not_an_average(query_len):
    """A non-finite query or key (a diverged model) gives NaN where SDPA does, on the decode path
    and on the prompt tiles (9 query rows, head size 64), instead of equal weights over the values
    or a key silently dropped (exp of NaN used to come out as exp(-87)); other rows are untouched."""
    d = 64
    backend = make_backend("cpu", torch.device("cpu"), block_size=BS, head_dim=d)
    q, k, v, k_cache, v_cache, meta, contexts = build_case([query_len], [40], hkv=1, hq=1, d=d)
    meta.num_short, meta.num_short_tokens = 1, query_len  # the kernel takes the chunk, as the runner has it
    q[-1, 0, 3] = float("nan")
    out = backend.forward(q, k, v, k_cache, v_cache, meta, d ** -0.5)
    assert torch.isnan(out[-1]).all() and torch.isfinite(out[:-1]).all()
    q[-1, 0, 3] = 0.0
    first = contexts[0][5]  # a NaN key at position 5, which every query row sees
    k_cache[first // BS, 0, first % BS, 0] = float("nan")
    assert torch.isnan(backend.forward(q, k, v, k_cache, v_cache, meta, d ** -0.5)).all()


@pytest.mark.parametrize("backend_name", ["reference", "torch", "cpu", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("case,d", [("decodes_only", D), ("mixed", D), ("long_chunks", D), ("long_chunks", 32)])
def test_soft_capped_scores_match_the_dense_oracle(backend_name, window, case, d):
    """Gemma 2's cap: each score s becomes c * tanh(s / c) before the softmax, in decodes (split
    over parts of the context or not) and prompt chunks (the C++ kernel's row-by-row passes, also
    for a head size whose uncapped chunks take its tile products), with and without a window; the
    cap changes the result at these scores."""
    device = torch.device("cuda" if backend_name == "triton" and torch.cuda.is_available() else "cpu")
    backend = make_backend(backend_name, device, block_size=BS, head_dim=d)
    if backend_name == "triton":
        backend.num_sms = 12  # decodes split over parts of their contexts, as on a GPU with few sequences
    q, k, v, k_cache, v_cache, meta, contexts = build_case(*CASES[case], seed=3, d=d)
    expected = dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, 0.5, window, softcap=1.5)
    uncapped = dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, 0.5, window)
    if getattr(backend, "short_query_max", 0) < 1:
        meta.num_short = meta.num_short_tokens = 0
    out = backend.forward(*(x.to(device) for x in (q, k, v, k_cache, v_cache)), _to(meta, device), 0.5, window, 1.5)
    assert torch.allclose(out.cpu().double(), expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(uncapped, expected, rtol=1e-2, atol=1e-2)


SINK_CASES = {**CASES, "long_decodes": ([1, 1], [400, 700])}  # contexts the C++ kernel splits in parts


@pytest.mark.parametrize("backend_name, case, d", [
    *[(name, case, D) for name in ("reference", "torch", "cpu") for case in ("decodes_only", "long_decodes", "mixed")],
    ("cpu", "long_chunks", 32),
    *[pytest.param("triton", case, D, marks=needs_triton) for case in ("decodes_only", "long_decodes", "long_chunks")]])
@pytest.mark.parametrize("window", [None, 16])
def test_attention_sinks_match_the_dense_oracle(backend_name, window, case, d):
    """gpt-oss's sinks: each query head's logit joins its softmax denominator and adds no value, so
    out = sum_j e^s_j v_j / (sum_j e^s_j + e^sink); in decodes (the C++ kernel's parts merged or
    not) and prompt chunks (its row-by-row passes and, at head size 32 without a window, its tile
    products; Triton's decodes split in parts and its 64-query tiles), with and without a window;
    the sinks change the result at these values."""
    device = torch.device("cuda" if backend_name == "triton" and torch.cuda.is_available() else "cpu")
    backend = make_backend(backend_name, device, block_size=BS, head_dim=d)
    if backend_name == "triton":
        backend.num_sms = 12  # decodes split over parts of their contexts, as on a GPU with few sequences
    q, k, v, k_cache, v_cache, meta, contexts = build_case(*SINK_CASES[case], seed=5, d=d)
    sinks = torch.linspace(-1.0, 9.0, HQ)  # up to where they outweigh several hundred keys
    expected = dense_oracle(q, k, v, k_cache, v_cache, meta, contexts, 0.5, window, sinks=sinks)
    if getattr(backend, "short_query_max", 0) < 1:
        meta.num_short = meta.num_short_tokens = 0
    inputs = (*(x.to(device) for x in (q, k, v, k_cache, v_cache)), _to(meta, device), 0.5, window)
    out = backend.forward(*inputs, None, sinks.to(device)).cpu()
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)
    without = backend.forward(*inputs).cpu()
    assert not torch.allclose(without, out, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case,d", [("long_decodes", D), ("long_chunks", 32), ("mixed", 64)])
def test_cpu_kernel_with_sinks_matches_the_reference_backend(case, d):
    """The C++ kernel's sinks against the reference backend's on the same pool, a float16 pool
    included: a sink far above every score takes nearly all the mass (outputs near 0), one far
    below none of it."""
    reference, cpu = make_backend("reference", torch.device("cpu")), make_backend(
        "cpu", torch.device("cpu"), block_size=BS, head_dim=d)
    sinks = torch.tensor([-30.0, 0.0, 1.0, 2.5, 30.0, 80.0])
    for dtype in (torch.float32, torch.float16):
        q, k, v, k_cache, v_cache, meta, _ = build_case(*SINK_CASES[case], seed=7, d=d)
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
        want = reference.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, d ** -0.5, None, None, sinks)
        got = cpu.forward(q, k, v, k_cache, v_cache, meta, d ** -0.5, None, None, sinks)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert got[:, 5].abs().max() < 1e-20 and got[:, 0].abs().max() > 0.05


# ---- the int8 pool: 8-bit codes and a float32 scale per token and kv head ----------------------

def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as csrc/paged_attention_cpu.cpp documents the int8 pool: scale = max |x| / 127, codes
    x * (127 / max |x|) rounded to nearest even (a row of zeros: scale 0, codes 0; a row with a NaN
    or an infinity: scale NaN, codes 0)."""
    finite = x.isfinite().all(-1, keepdim=True)
    x = torch.where(finite, x, 0.0)
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    scales = torch.where(finite, amax / 127, float("nan"))
    return (x * inv).round().clamp(-127, 127).to(torch.int8), scales.squeeze(-1)


def int8_pool(cache: torch.Tensor) -> torch.Tensor:
    """(N, Hkv, bs, D) floats as an int8 pool (N, Hkv, bs, D + 4): each run's codes, then its scales."""
    n, h, bs, d = cache.shape
    codes, scales = quantize_rows(cache)
    runs = torch.cat([codes.reshape(n, h, bs * d), scales.contiguous().view(torch.int8)], -1)
    return runs.reshape(n, h, bs, d + 4)


def dequantize_pool(pool: torch.Tensor) -> torch.Tensor:
    """An int8 pool's values, code * scale, as (N, Hkv, bs, D) float32."""
    n, h, bs, width = pool.shape
    d = width - 4
    runs = pool.reshape(n, h, bs * width)
    codes, scales = runs[..., :bs * d].reshape(n, h, bs, d), runs[..., bs * d:].contiguous().view(torch.float32)
    return codes.float() * scales[..., None]


def dequantized(x: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_rows(x)
    return codes.float() * scales[..., None]


def int8_backend(d: int):
    return make_backend("cpu", torch.device("cpu"), block_size=BS, head_dim=d, kv_dtype=torch.int8)


INT8_CASES = {**FP16_CASES, "long_decodes": ([1, 1], [400, 700])}


@pytest.mark.parametrize("case", list(INT8_CASES))
@pytest.mark.parametrize("hkv,hq,d", [(3, 9, 64), (2, 4, 128), (2, 16, 24), (1, 3, 20)])
def test_int8_pool_matches_the_oracle_on_its_dequantized_values(case, hkv, hq, d):
    """kv_cache_dtype="int8": each written row of K and V becomes codes and a scale, byte for byte as
    documented, and attention over the pool equals exact attention over code * scale, on every
    path of the kernel (decodes split in parts or not, the per-row passes, prompt tiles at head
    sizes 64 and 128; AVX2 loops at 24, scalar ones at 20). Every sequence goes through the kernel."""
    backend = int8_backend(d)
    assert backend.short_query_max > 100_000
    q, k, v, k_cache, v_cache, meta, contexts = build_case(*INT8_CASES[case], seed=7, hkv=hkv, hq=hq, d=d)
    meta.num_short, meta.num_short_tokens = meta.num_seqs, q.shape[0]
    k_pool, v_pool = int8_pool(k_cache), int8_pool(v_cache)
    expected = dense_oracle(q, dequantized(k), dequantized(v), dequantize_pool(k_pool), dequantize_pool(v_pool),
                            meta, contexts, d ** -0.5)
    out = backend.forward(q, k, v, k_pool, v_pool, meta, d ** -0.5)
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)
    k_cache[meta.slot_block, :, meta.slot_offset] = k  # what the pools should now hold, quantized
    v_cache[meta.slot_block, :, meta.slot_offset] = v
    assert torch.equal(k_pool, int8_pool(k_cache)) and torch.equal(v_pool, int8_pool(v_cache))


@pytest.mark.parametrize("case,d", [("long_decodes", 64), ("mixed", 64), ("long_chunks", 32)])
def test_int8_pool_with_a_window_a_cap_and_sinks_matches_the_oracle(case, d):
    """The kernel's window, soft cap and sinks over an int8 pool: the scales apply before the cap and
    the softmax, and blocks wholly before the window (NaN codes' scales) are never read."""
    backend = int8_backend(d)
    q, k, v, k_cache, v_cache, meta, contexts = build_case(*INT8_CASES[case], seed=9, d=d)
    meta.num_short, meta.num_short_tokens = meta.num_seqs, q.shape[0]
    sinks = torch.linspace(-1.0, 4.0, HQ)
    expected = dense_oracle(q, dequantized(k), dequantized(v), dequantize_pool(int8_pool(k_cache)),
                            dequantize_pool(int8_pool(v_cache)), meta, contexts, 0.5, 16, softcap=1.5, sinks=sinks)
    k_pool, v_pool = (int8_pool(c) for c in poison_outside_window(k_cache, v_cache, meta, 16))
    out = backend.forward(q, k, v, k_pool, v_pool, meta, 0.5, 16, 1.5, sinks)
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5)


def test_int8_rows_of_zeros_and_of_non_finite_values():
    """A row of zeros is stored as scale 0 (its keys score 0, not NaN); a row holding a NaN or an
    infinity gets a NaN scale, so that attention over it gives NaN as a float pool does."""
    backend = int8_backend(64)
    q, k, v, k_cache, v_cache, meta, _ = build_case([1], [5], seed=2, hkv=3, hq=9, d=64)
    k_pool, v_pool = int8_pool(k_cache), int8_pool(v_cache)
    k[0, 0], v[0, 0] = 0.0, 0.0
    out = backend.forward(q, k, v, k_pool, v_pool, meta, 0.125)
    slot = (int(meta.slot_block[0]), int(meta.slot_offset[0]))
    values = dequantize_pool(k_pool)[slot[0], :, slot[1]]
    assert torch.isfinite(out).all() and not values[0].any() and values[1:].abs().sum() > 0
    k[0, 1, 7] = float("inf")
    out = backend.forward(q, k, v, k_pool, v_pool, meta, 0.125)
    assert torch.isnan(dequantize_pool(k_pool)[slot[0], 1, slot[1]]).all()
    assert torch.isnan(out[0, 3:6]).all() and torch.isfinite(out[0, :3]).all() and torch.isfinite(out[0, 6:]).all()


def test_an_int8_pool_is_refused_by_backends_that_cannot_read_it():
    for name, device, dtype in (("torch", "cpu", torch.float32), ("reference", "cpu", torch.float32),
                                ("auto", "cpu", torch.bfloat16)):
        with pytest.raises(ValueError, match="int8.*CPU kernels alone"):
            make_backend(name, torch.device(device), dtype=dtype, kv_dtype=torch.int8)


def test_cpu_write_kv_rejects_an_int8_pool_without_room_for_the_scales():
    kernel = int8_backend(D).kernel
    k_cache, v_cache = torch.zeros(4, HKV, BS, D, dtype=torch.int8), torch.zeros(4, HKV, BS, D, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        kernel.write_kv(torch.ones(1, HKV, D), torch.ones(1, HKV, D), k_cache, v_cache, torch.tensor([0]),
                        torch.tensor([0]))
