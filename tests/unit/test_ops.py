"""The fast paths against their torch references: fused C++ element-wise ops, oneDNN-packed
projections, and the Triton element-wise kernels (CUDA, or the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_triton, random_k_quant_rows

from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.models.gpt_oss import dequantize_ggml_mxfp4
from tokenmill.models.llama import RMSNorm
from tokenmill.models.ops import CpuFusedOps, TorchOps
from tokenmill.models.packed_linear import PackedLinear, onednn_available


@pytest.fixture(scope="module")
def fused():
    return CpuFusedOps(load_cpu_kernels(required=True))


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_rms_norm(fused, rows):
    norm = RMSNorm(40, 1e-6)
    norm.weight.data = torch.randn(40)
    x, res = torch.randn(rows, 40), torch.randn(rows, 40)
    ref_out, ref_res = TorchOps().add_rms_norm(x, res.clone(), norm)
    out, new_res = fused.add_rms_norm(x, res, norm)       # updates res in place
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(new_res, ref_res) and new_res is res
    first, stream = fused.add_rms_norm(x, None, norm)     # first layer: no residual yet
    assert stream is x and torch.allclose(first, TorchOps().add_rms_norm(x, None, norm)[0], atol=1e-5)


def _qk_norms(kind: str, heads: int, kv_heads: int, dim: int):
    """No q/k norms, Qwen3's on each head, or OLMoE's over all of q and all of k."""
    sizes = {"none": None, "heads": (dim, dim), "whole": (heads * dim, kv_heads * dim)}[kind]
    return (None, None) if sizes is None else (_norm(sizes[0]), _norm(sizes[1]))


@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 16), (9, 3, 64), (4, 4, 24)])
@pytest.mark.parametrize("qk_norm", ["none", "heads", "whole"])
def test_rotary_qkv_rotates_q_and_k_after_their_norms_and_leaves_v(fused, heads, kv_heads, dim, qk_norm):
    t = 11
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim) * 3
    angles = torch.rand(t, dim // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    norms = tuple(n if n is None else n.cpu() for n in _qk_norms(qk_norm, heads, kv_heads, dim))
    ref = TorchOps().rotary_qkv(qkv.clone(), cos, sin, heads, kv_heads, dim, *norms)
    v = qkv[:, (heads + kv_heads) * dim:].clone()
    out = fused.rotary_qkv(qkv, cos, sin, heads, kv_heads, dim, *norms)
    for a, b in zip(out, ref):
        assert torch.allclose(a, b, atol=1e-5)
    assert torch.equal(out[2].reshape(t, -1), v)
    with pytest.raises(RuntimeError, match="q and k norms go together"):
        fused.kernels.rotary_qkv_(qkv, cos, sin, heads, kv_heads, dim, torch.ones(dim), None)
    with pytest.raises(RuntimeError, match="head_dim long each or num_q_heads"):
        fused.kernels.rotary_qkv_(qkv, cos, sin, heads, kv_heads, dim, torch.ones(heads * dim), torch.ones(dim))


def test_silu_mul(fused):
    gate_up = torch.randn(33, 2 * 100) * 5
    assert torch.allclose(fused.silu_mul(gate_up), TorchOps().silu_mul(gate_up), rtol=1e-5, atol=1e-6)


def test_norm_silu_and_attention_write_into_a_given_out_and_refuse_a_wrong_one(fused):
    """The decoder stack hands these kernels buffers it reuses layer after layer: the result is the
    same bits as a new tensor's, in the buffer itself."""
    k = fused.kernels
    x, res, norm, gate_up = torch.randn(3, 40), torch.randn(3, 40), torch.rand(40), torch.randn(3, 2 * 24)
    q, pool = torch.randn(3, 4, 16), torch.randn(2, 2, 16, 16)  # 2 blocks of 16, 2 kv heads, head size 16
    meta = [torch.tensor(v, dtype=torch.int32) for v in ([[1, 0]], [0, 3], [20])]  # tables, starts, lengths
    calls = {"norm": (lambda out: k.add_rms_norm(x, res.clone(), norm, 1e-6, out), (3, 40)),
             "silu_mul": (lambda out: k.silu_mul(gate_up, out), (3, 24)),
             "attention": (lambda out: k.paged_attention(q, pool, pool, *meta, 0.25, out=out), (3, 4, 16))}
    for name, (call, shape) in calls.items():
        out = torch.full(shape, float("nan"))
        assert call(out).data_ptr() == out.data_ptr() and torch.equal(out, call(None)), name
        for bad in (torch.empty(*shape[:-1], shape[-1] + 1), torch.empty(shape, dtype=torch.float64),
                    torch.empty(*reversed(shape)).transpose(0, -1)):
            with pytest.raises(RuntimeError, match="out must be a contiguous float32 tensor of the result's shape"):
                call(bad)


@pytest.mark.parametrize("vocab", [1, 7, 8, 49152, 1003])
def test_argmax_rows_answers_as_torch_argmax(fused, vocab):
    """Ties go to the first maximum, a row with NaN to its first NaN, an all -inf row to 0; rows
    may sit further apart than their length."""
    torch.manual_seed(0)
    x = torch.randn(12, vocab + 5)[:, :vocab]  # a strided view
    x[1] = float("-inf")
    x[2, vocab // 2:] = float("nan")
    x[3] = 0.5  # all tied
    x[4, -1] = x[4].max() + 1  # the last element (in the scalar tail when vocab % 8)
    x[5, vocab // 3] = x[6, vocab // 3] = float("inf")
    x[6, -1] = float("inf")
    x[7] = x[7].round()  # many ties below the max
    x[8, 0] = float("nan")
    x[9] = -1.0
    x[9, vocab // 2], x[9, -1] = -0.0, 0.0  # equal: the first wins
    x[10, -1] = float("nan")  # the only NaN, last
    out = fused.kernels.argmax_rows(x)
    assert out.dtype == torch.int64 and torch.equal(out, x.argmax(dim=-1))
    empty = fused.kernels.argmax_rows(torch.randn(0, vocab))
    assert empty.shape == (0,) and empty.dtype == torch.int64


@pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32), reason="torch without oneDNN")
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    w, b = torch.randn(96, 48), torch.randn(96)
    x = torch.randn(rows, 48)
    assert torch.allclose(PackedLinear(w, b)(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 48])
@pytest.mark.parametrize("n", [37, 48])  # 37: a partly filled last panel
def test_panel_kernel_matches_f_linear(fused, rows, n):
    w, b, x = torch.randn(n, 50), torch.randn(n), torch.randn(rows, 50)
    panels = fused.kernels.pack_panels(w)
    assert panels.shape == (-(-n // 16), 50, 16)
    assert torch.allclose(fused.kernels.panel_linear(x, panels, b, n), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert torch.allclose(fused.kernels.panel_linear(x, panels, None, n), F.linear(x, w), rtol=1e-5, atol=1e-4)


def _gguf_rows(kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows as a GGUF file stores them, K-quants re-cut as the loader does, and the float32
    weights gguf dequantizes them to)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from tokenmill.models.gguf_loader import k_quant_rows, q5_as_blocks_of_32
    qtype, rng = GGMLQuantizationType[kind], np.random.default_rng(0)
    if kind.endswith("_K"):
        raw = random_k_quant_rows(rng, kind, n, k)
        rows = k_quant_rows(raw, kind)
    elif kind == "MXFP4":  # random codes, scales 2^-27 to 2^12 (gguf cannot quantize to it)
        raw = rows = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
        raw[..., 0] = rng.integers(100, 140, (n, k // 32))
        raw = rows = raw.reshape(n, -1)
        weights = dequantize_ggml_mxfp4(torch.from_numpy(raw)).numpy()
        return torch.from_numpy(rows.copy()), torch.from_numpy(weights.copy())
    elif kind in ("Q5_0", "Q5_1"):
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
        rows = q5_as_blocks_of_32(raw, kind)
    else:
        raw = rows = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    weights = dequantize(raw, qtype).astype(np.float32).reshape(n, k)
    return torch.from_numpy(rows.copy()), torch.from_numpy(weights.copy())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
def test_block_panels_give_the_float32_panels_result_bit_for_bit(fused, kind):
    """The kernel decodes GGUF blocks with gguf's own arithmetic (MXFP4: FP4 times 2^(e - 127),
    exact) and sums in the float32 panels' order, so the two products must be identical, not just
    close."""
    if not fused.kernels.block_formats:
        pytest.skip("block formats need AVX2")
    from tokenmill.models.packed_linear import BLOCK_FORMATS
    n, k = 37, 512 if kind.endswith("_K") else 96  # 37: a partly filled last panel; 96: three blocks of 32
    raw, w = _gguf_rows(kind, n, k)
    blocks = fused.kernels.pack_block_panels(raw, BLOCK_FORMATS[kind], k)
    panels, b = fused.kernels.pack_panels(w), torch.randn(n)
    # 7, 13: two and three tiles of up to six rows (one and two of up to 12 with AVX-512VL); 20,
    # 21, 25: around the widest tiles' limit; 513, 517, 525: a one-row tile after the first 512
    # rows in one path and not the other, if they cut the rows differently
    for rows in (1, 2, 3, 5, 6, 7, 13, 20, 21, 25, 513, 517, 525):
        x = torch.randn(rows, k)
        assert torch.equal(fused.kernels.panel_linear(x, blocks, b, n, BLOCK_FORMATS[kind]),
                           fused.kernels.panel_linear(x, panels, b, n))
    with pytest.raises(RuntimeError, match="block panels"):
        fused.kernels.panel_linear(torch.randn(1, k), blocks, b, n, BLOCK_FORMATS["Q8_0" if kind != "Q8_0" else "Q4_0"])


def _int8_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What the 8-bit path computes, in float64: each block of 32 values of x rounded to
    dx * round(x / dx), dx = max |x| / 127 (in float32, as the kernel does), times the weights."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=2, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    xq = (torch.round(blocks * inv).double() * d.double()).reshape(x.shape)
    return (xq @ w.double().T + b.double()).float()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_int8_rows_compute_the_product_with_x_in_8_bit_blocks(fused, kind):
    """Up to `int8_rows` rows, x goes to 8 bits per block of 32 and the codes are multiplied as
    integers: the result is that of the dequantized weights with x so rounded (to float32
    rounding), and within 2% of the float32 product. Above it, the float path as before."""
    if not fused.kernels.block_formats:
        pytest.skip("block formats need AVX2")
    from tokenmill.models.packed_linear import BLOCK_FORMATS
    n, k = 37, 512 if kind.endswith("_K") else 96
    raw, w = _gguf_rows(kind, n, k)
    blocks, panels = fused.kernels.pack_block_panels(raw, BLOCK_FORMATS[kind], k), fused.kernels.pack_panels(w)
    gen = torch.Generator().manual_seed(0)
    b = torch.randn(n, generator=gen)
    for rows in (1, 2, 3, 4, 5, 8, 9, 12, 13, 17, 25):  # passes of up to 4, 8 or 12 rows, shared out evenly
        x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 10
        x[0, 32:64] = 0  # a block of zeros: its scale is 0
        y = fused.kernels.panel_linear(x, blocks, b, n, BLOCK_FORMATS[kind], None, rows)
        assert torch.allclose(y, _int8_reference(x, w, b), rtol=1e-5, atol=1e-4 * float(y.abs().max()))
        exact = x @ w.T + b
        # x's rounding (half a step of max |x| / 127 per block) is ~0.5% of a product of 37
        # outputs; a single row's has come to 1.3%
        assert float((y - exact).norm() / exact.norm()) < 0.02
        above = fused.kernels.panel_linear(x, blocks, b, n, BLOCK_FORMATS[kind], None, rows - 1)
        assert torch.equal(above, fused.kernels.panel_linear(x, panels, b, n))
    x = torch.randn(2, k)
    x[1, 40] = float("nan")  # as in float32: NaN in, NaN out (every output of that row)
    y = fused.kernels.panel_linear(x, blocks, b, n, BLOCK_FORMATS[kind], None, 2)
    assert y[1].isnan().all() and not y[0].isnan().any()


def test_bf16_panels_hold_each_pair_of_k_of_16_features_side_by_side(fused):
    """pack_panels of a bfloat16 matrix: panels (ceil(N / 16), K / 2, 64 bytes), where pair i of
    panel p holds, feature by feature, W[16 p + j, 2 i] then W[16 p + j, 2 i + 1], the last panel
    padded with zeros; an odd K has no pairs and is refused, and panels of another shape or format
    are refused by panel_linear."""
    if not fused.kernels.bf16:
        pytest.skip("bfloat16 panels need AVX512-BF16")
    w = torch.randn(37, 10).bfloat16()
    panels = fused.kernels.pack_panels(w)
    assert panels.dtype == torch.uint8 and panels.shape == (3, 5, 64)
    padded = torch.cat([w, torch.zeros(48 - 37, 10, dtype=torch.bfloat16)])
    expected = padded.view(3, 16, 5, 2).permute(0, 2, 1, 3).contiguous()
    assert torch.equal(panels.view(torch.int16).view(3, 5, 16, 2), expected.view(torch.int16))
    with pytest.raises(RuntimeError, match="even number of columns"):
        fused.kernels.pack_panels(torch.randn(16, 9).bfloat16())
    for wrong in (fused.kernels.pack_panels(w.float()), panels[:2], fused.kernels.pack_panels(w[:, :8])):
        with pytest.raises(RuntimeError, match="in format 9 expected"):
            fused.kernels.panel_linear(torch.randn(1, 10), wrong, None, 37, 9, None, 0)


def test_bf16_panels_multiply_x_and_w_rounded_to_bfloat16_with_float32_sums(fused):
    """Format 9: W rounded to bfloat16 once (by torch, to nearest even), x rounded the same way
    in each product, the sums float32: the result is that of the rounded operands (to float32
    rounding), for passes of 16 rows and their remainders, a partly filled last panel and K not a
    multiple of 16 (x's last values rounded one at a time); NaN in a row gives NaN in that row."""
    if not fused.kernels.bf16:
        pytest.skip("bfloat16 panels need AVX512-BF16")
    gen = torch.Generator().manual_seed(0)
    n, k = 37, 98
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    panels = fused.kernels.pack_panels(w.bfloat16())
    for rows in (1, 2, 15, 16, 17, 33):
        x = torch.randn(rows, k, generator=gen) * 3
        y = fused.kernels.panel_linear(x, panels, b, n, 9, None, 0)
        rounded = x.bfloat16().double() @ w.bfloat16().double().T + b.double()
        assert torch.allclose(y.double(), rounded, rtol=1e-5, atol=1e-5 * float(rounded.abs().max()))
        exact = x @ w.T + b
        assert float((y - exact).norm() / exact.norm()) < 0.01  # bfloat16's 8 bits, twice
    x = torch.randn(2, k, generator=gen)
    x[1, 40] = float("nan")
    y = fused.kernels.panel_linear(x, panels, b, n, 9, None, 0)
    assert y[1].isnan().all() and not y[0].isnan().any()


@pytest.mark.parametrize("k", [64, 98, 576])
def test_bf16_panels_on_amx_tiles_multiply_the_rounded_operands_at_any_row_count(fused, k):
    """Where the kernels are built for AMX, steps of amx_min_rows rows or more multiply bf16 panels
    on the tiles, 32 rows a pass padded with zero rows, the pairs of k past the last 32 by vdpbf16ps
    (k = 98): the result is still that of the rounded operands, at every pass shape, with NaN kept to
    its row; and a step one row short takes vdpbf16ps's tiles to the same result."""
    least = fused.kernels.amx_min_rows
    if not least:
        pytest.skip("AMX tiles need a CPU with AMX-BF16 (and a build for it)")
    gen = torch.Generator().manual_seed(1)
    n = 37
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    panels = fused.kernels.pack_panels(w.bfloat16())
    for rows in (least - 1, least, 15, 16, 17, 31, 32, 33, 48, 100):
        x = torch.randn(rows, k, generator=gen) * 3
        x[rows // 2, k // 3] = float("nan")
        y = fused.kernels.panel_linear(x, panels, b, n, 9, None, 0)
        rounded = x.bfloat16().double() @ w.bfloat16().double().T + b.double()
        fine = torch.ones(rows, dtype=torch.bool)
        fine[rows // 2] = False
        assert y[rows // 2].isnan().all() and not y[fine].isnan().any()
        assert torch.allclose(y[fine].double(), rounded[fine], rtol=1e-5, atol=1e-5 * float(rounded[fine].abs().max()))


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_panel_products_are_the_same_with_any_thread_count(fused, threads):
    """Threads share panels out with stealing (csrc/parallel.h): which thread computes a panel
    must not change it, and every panel must be computed, with 8 threads on 2 cores too (little
    work each, much stealing). Outputs start as NaN, so that a panel left out shows."""
    if not fused.kernels.block_formats:
        pytest.skip("block formats need AVX2")
    from tokenmill.models.packed_linear import BLOCK_FORMATS
    n, k = 16 * 41 + 5, 96  # 42 panels, the last partly filled
    raw, w = _gguf_rows("Q4_1", n, k)
    blocks, panels = fused.kernels.pack_block_panels(raw, BLOCK_FORMATS["Q4_1"], k), fused.kernels.pack_panels(w)
    gen = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    for rows in (1, 7, 13, 64):  # registers, two passes, a decoded panel, many tiles
        x = torch.randn(rows, k, generator=gen)
        def products() -> list[torch.Tensor]:  # blocks, float32 panels, blocks with 8-bit x
            outs = [torch.full((rows, n), float("nan")) for _ in range(3)]
            fused.kernels.panel_linear(x, blocks, None, n, BLOCK_FORMATS["Q4_1"], outs[0])
            fused.kernels.panel_linear(x, panels, None, n, 0, outs[1])
            fused.kernels.panel_linear(x, blocks, None, n, BLOCK_FORMATS["Q4_1"], outs[2], rows)
            return outs

        torch.set_num_threads(1)
        try:
            alone = products()
            assert not any(out.isnan().any() for out in alone)
            torch.set_num_threads(threads)
            for _ in range(20):  # which thread takes what changes from run to run
                assert all(torch.equal(out, ref) for out, ref in zip(products(), alone))
        finally:
            torch.set_num_threads(before)


def test_panel_linear_writes_into_a_column_range_and_checks_it(fused):
    """ConcatLinear's parts write their columns of one output through `out`."""
    panels, x = fused.kernels.pack_panels(torch.randn(37, 64)), torch.randn(5, 64)
    y = torch.zeros(5, 50)
    fused.kernels.panel_linear(x, panels, None, 37, 0, y[:, 3:40])
    assert torch.equal(y[:, 3:40], fused.kernels.panel_linear(x, panels, None, 37, 0))
    assert not y[:, :3].any() and not y[:, 40:].any()
    for bad in (torch.empty(37).expand(5, 37), torch.empty(5, 36), torch.empty(37, 5).t()):  # rows overlap, N, stride
        with pytest.raises(RuntimeError, match="out must be"):
            fused.kernels.panel_linear(x, panels, None, 37, 0, bad)


def test_release_threads_lets_this_threads_openmp_workers_exit(fused):
    """The workers a thread's parallel kernels started stay for its next kernels until
    release_threads; the next kernel starts them again, with the same result."""
    import os
    if not os.path.isdir("/proc/self/task") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux's /proc and two CPUs")
    import time
    before = torch.get_num_threads()  # (an engine's thread governor may have set one thread)
    torch.set_num_threads(2)
    try:
        def threads() -> set[str]:  # ids, not a count: another test's thread may end meanwhile
            return set(os.listdir("/proc/self/task"))
        workers = torch.get_num_threads() - 1
        panels, x = fused.kernels.pack_panels(torch.randn(256, 64)), torch.randn(8, 64)
        y = fused.kernels.panel_linear(x, panels, None, 256)  # a parallel kernel: this thread's team exists
        with_team = threads()
        fused.kernels.release_threads()
        deadline = time.monotonic() + 5
        while len(with_team - threads()) < workers and time.monotonic() < deadline:  # a worker may take a moment
            time.sleep(0.01)
        without = threads()
        assert len(with_team - without) >= workers
        assert torch.equal(fused.kernels.panel_linear(x, panels, None, 256), y)
        assert len(threads() - without) >= workers  # started again
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_recut_in_cpp_gives_numpys_bytes(fused, kind):
    """The loader re-cuts K-quant super-blocks in C++; numpy's version is the readable reference."""
    if not fused.kernels.block_formats:
        pytest.skip("block formats need AVX2")
    import numpy as np

    from tokenmill.models.gguf_loader import k_quant_rows
    from tokenmill.models.packed_linear import BLOCK_FORMATS
    raw = random_k_quant_rows(np.random.default_rng(1), kind, 9, 768)
    supers = raw.reshape(9, 3, -1)
    supers[1::2, :, 209 if kind == "Q6_K" else 1] |= 0x80  # negative d on every other row
    ours = fused.kernels.recut_k_quant(torch.from_numpy(raw), BLOCK_FORMATS[kind])
    assert torch.equal(ours, torch.from_numpy(k_quant_rows(raw, kind)))


def test_packed_linear_with_blocks_gives_the_float32_panels_result(fused):
    if not fused.kernels.block_formats:
        pytest.skip("block formats need AVX2")
    raw, w = _gguf_rows("Q4_1", 48, 64)
    with_blocks, with_floats = PackedLinear(w, None, fused.kernels, ("Q4_1", raw)), PackedLinear(w, None, fused.kernels)
    assert with_blocks.format == 2 and with_blocks.panels.dtype == torch.uint8 and "Q4_1 blocks" in repr(with_blocks)
    assert with_floats.format == 0 and with_floats.panels.dtype == torch.float32
    for rows in (1, 12, 13, 20, 21, 64, 600):  # registers up to 12 rows (20 in AVX-512VL's tiles), a buffer above
        x = torch.randn(rows, 64)
        assert torch.equal(with_blocks(x), with_floats(x))


def test_pack_for_cpu_keeps_blocks_where_every_part_has_blocks(fused):
    """q/k/v (and gate/up) fuse into one projection: it keeps blocks when all its parts came in
    blocks, one PackedLinear per run of one type when the types differ, else float32 panels; the
    products stay bit-identical to float32 panels of the dequantized weights."""
    if not fused.kernels.block_formats:
        pytest.skip("block formats need AVX2")
    from tokenmill.config import ModelConfig
    from tokenmill.models.cpu_packing import drop_block_weights, fuse_layers, pack_for_cpu
    from tokenmill.models.llama import LlamaForCausalLM
    from tokenmill.models.packed_linear import ConcatLinear, GGUFMatrix
    cfg = ModelConfig(architecture="llama", vocab_size=80, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg, max_len=64)
    kinds = {"q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q4_0", "gate_proj": "Q8_0",
             "up_proj": None, "down_proj": "Q4_1", "embed_tokens": "Q8_0"}  # None: float32 in the file
    hf = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
          "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
          "down_proj": "mlp.down_proj"}
    sizes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
             "gate_proj": (96, 64), "up_proj": (96, 64), "down_proj": (64, 96), "embed_tokens": (80, 64)}
    weights, blocks = [], {}
    for short, kind in kinds.items():
        name = "model.embed_tokens.weight" if short == "embed_tokens" else f"model.layers.0.{hf[short]}.weight"
        raw, w = _gguf_rows(kind, *sizes[short]) if kind else (None, torch.randn(sizes[short]))
        weights.append((name, w))
        if kind:
            blocks[name] = GGUFMatrix(kind, raw.shape[0], lambda raw=raw: raw, sizes[short][1])
    for norm in ("layers.0.input_layernorm", "layers.0.post_attention_layernorm", "norm"):
        weights.append((f"model.{norm}.weight", torch.rand(64) + 0.5))
    model.load_weights(weights)
    pack_for_cpu(model, fused.kernels, blocks)
    layer = model.layers[0]
    qkv = layer.self_attn.qkv_proj                                 # Q4_1, Q4_1, Q8_0: two runs
    assert isinstance(qkv, ConcatLinear) and [part.format for part in qkv.parts] == [2, 3]
    assert layer.mlp.gate_up_proj.format == 0                      # up came in float32
    assert layer.self_attn.o_proj.format == 1 and layer.mlp.down_proj.format == 2
    assert model.packed_lm_head.format == 3                        # the tied embeddings' blocks
    dequantized = dict(weights)
    qkv_floats = fused.kernels.pack_panels(torch.cat([dequantized[f"model.layers.0.self_attn.{p}.weight"]
                                                      for p in ("q_proj", "k_proj", "v_proj")]))
    for rows in (1, 7, 20):
        x = torch.randn(rows, 64)
        assert torch.equal(qkv(x), fused.kernels.panel_linear(x, qkv_floats, None, 128))
    hidden = torch.randn(3, 64)
    floats = fused.kernels.pack_panels(dequantized["model.embed_tokens.weight"])
    assert torch.equal(model.compute_logits(hidden), fused.kernels.panel_linear(hidden, floats, None, 80))

    # the loader's way: the float32 weights of projections packed from blocks are never loaded
    with torch.device("meta"):
        lean = LlamaForCausalLM(cfg, max_len=64)
    skip = drop_block_weights(lean, blocks)
    assert skip == {f"model.layers.0.{hf[p]}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")}
    lean = lean.to_empty(device="cpu")
    lean.rotary.build()
    lean.load_weights([(name, w) for name, w in weights if name not in skip])
    pack_for_cpu(lean, fused.kernels, blocks)
    for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        ours, theirs = lean.layers[0].get_submodule(proj), layer.get_submodule(proj)
        x = torch.randn(5, ours.in_features)
        assert type(ours) is type(theirs) and torch.equal(ours(x), theirs(x))

    # the one-call C++ layer takes the ConcatLinear too, with the same result as the Python layer
    from tokenmill.attention import make_backend
    from tokenmill.config import CacheConfig
    from tokenmill.model_runner import ModelRunner
    from tokenmill.request import Request
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker import ModelWorker
    model.ops = fused
    fuse_layers(model, fused.kernels)
    assert model.fused_stack is not None
    worker = ModelWorker(model, cfg, CacheConfig(8, 16), make_backend("cpu", torch.device("cpu")), torch.device("cpu"),
                         torch.float32)
    runner = ModelRunner(worker, seed=0)
    request = Request(request_id="r", prompt_token_ids=list(range(2, 9)), params=SamplingParams(), max_tokens=4)
    request.block_ids = [3]
    inputs = runner.prepare([request], [7])
    with torch.inference_mode():
        one_call = worker.forward(inputs.input_ids, inputs.positions, inputs.meta)
        model.fused_stack = None
        python = worker.forward(inputs.input_ids, inputs.positions, inputs.meta)
    assert torch.equal(one_call, python)


def test_the_one_call_decoder_stack_lets_other_python_threads_run_during_its_pass(fused):
    """The stack's pass runs without the GIL: a thread that wants it (the server's event loop with
    a step's tokens to send) gets it during the pass. With a switch interval of 1000 s no thread
    is ever asked to let go of the GIL, so the waiting thread runs during the pass only if the
    pass released it. One layer: a pass that held the GIL and let it go only between layers
    would never let it go here (with several, the waiter may win one of those races)."""
    import sys
    import threading

    from tokenmill.attention import make_backend
    from tokenmill.config import CacheConfig, ModelConfig
    from tokenmill.model_runner import ModelRunner
    from tokenmill.models.cpu_packing import fuse_layers, pack_for_cpu
    from tokenmill.models.llama import LlamaForCausalLM
    from tokenmill.request import Request
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker import ModelWorker
    cfg = ModelConfig(architecture="llama", vocab_size=80, hidden_size=512, intermediate_size=2048, num_layers=1,
                      num_heads=8, num_kv_heads=4, head_dim=64)  # a pass of some 20 ms at 512 tokens
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, max_len=512)
    pack_for_cpu(model, fused.kernels, {})
    model.ops = fused
    fuse_layers(model, fused.kernels)
    assert model.fused_stack is not None
    worker = ModelWorker(model, cfg, CacheConfig(32, 16), make_backend("cpu", torch.device("cpu")),
                         torch.device("cpu"), torch.float32)
    tokens = [2 + i % 70 for i in range(512)]
    request = Request(request_id="r", prompt_token_ids=tokens, params=SamplingParams(), max_tokens=4)
    request.block_ids = list(range(32))
    meta = ModelRunner(worker, seed=0).prepare([request], [512]).meta
    with torch.inference_mode():
        x = model.embed_tokens(torch.tensor(tokens))
        cos, sin = model.rotary(torch.arange(512), x.dtype)
    args = (x, cos, sin, [k for k, _ in worker.kv_caches], [v for _, v in worker.kv_caches], meta.slot_block,
            meta.slot_offset, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    go, in_pass, seen = threading.Event(), [False], []

    def waiter() -> None:
        go.wait()
        seen.append(in_pass[0])  # needs the GIL: taken while the pass runs, or only after it
    thread = threading.Thread(target=waiter)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        thread.start()
        with torch.inference_mode():
            go.set()  # the waiter wakes, then waits for the GIL, which this thread keeps ...
            in_pass[0] = True
            model.fused_stack.forward(*args)  # ... until the pass lets go of it
            in_pass[0] = False
    finally:
        sys.setswitchinterval(interval)
        thread.join()
    assert seen == [True]


def test_packed_linear_with_panels_matches_for_every_row_count(fused):
    w = torch.randn(96, 48)
    layer = PackedLinear(w, None, fused.kernels)
    assert layer.packed is None and layer.panels is not None
    for rows in (1, 8, 64, 300, 1100):  # 1100: three blocks of rows
        x = torch.randn(rows, 48)
        assert torch.allclose(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-4)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def triton_ops():
    from tokenmill.models.triton_ops import TritonFusedOps
    return TritonFusedOps()


def _norm(dim: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6).to(DEVICE)
    norm.weight.data = torch.randn(dim, device=DEVICE)
    return norm


@needs_triton
@pytest.mark.parametrize("rows, dim", [(1, 40), (7, 576), (33, 96)])
def test_triton_add_rms_norm(triton_ops, rows, dim):
    norm = _norm(dim)
    x, res = torch.randn(rows, dim, device=DEVICE), torch.randn(rows, dim, device=DEVICE)
    ref_out, ref_res = TorchOps().add_rms_norm(x, res.clone(), norm)
    out, new_res = triton_ops.add_rms_norm(x, res, norm)    # updates res in place
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(new_res, ref_res) and new_res is res
    first, stream = triton_ops.add_rms_norm(x, None, norm)  # first layer: the stream is x itself
    assert stream is x and torch.allclose(first, TorchOps().add_rms_norm(x, None, norm)[0], atol=1e-5)


@needs_triton
@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 16), (9, 3, 64), (4, 4, 24), (16, 8, 128)])
@pytest.mark.parametrize("qk_norm", ["none", "heads", "whole"])
def test_triton_rotary_qkv(triton_ops, heads, kv_heads, dim, qk_norm):
    """Rotation, with Qwen3's per-head norms or OLMoE's whole ones first; v untouched. dim 24: a
    half of 12 that the kernel pads to 16."""
    t = 11
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device=DEVICE)
    angles = torch.rand(t, dim // 2, device=DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    norms = _qk_norms(qk_norm, heads, kv_heads, dim)
    ref = TorchOps().rotary_qkv(qkv.clone(), cos, sin, heads, kv_heads, dim, *norms)
    out = triton_ops.rotary_qkv(qkv, cos, sin, heads, kv_heads, dim, *norms)
    for a, b in zip(out, ref):
        assert torch.allclose(a, b, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("n", [100, 3000])  # 3000: three tiles, the last one partial
def test_triton_silu_mul(triton_ops, n):
    gate_up = torch.randn(5, 2 * n, device=DEVICE) * 5
    assert torch.allclose(triton_ops.silu_mul(gate_up), TorchOps().silu_mul(gate_up), rtol=1e-5, atol=1e-5)
