"""The engine against Hugging Face transformers on tiny random-weight models.

1. The logits of one ragged step (prompt chunks that continue earlier chunks, a first
   chunk, a decode, a one-token chunk) match transformers' forward of each sequence alone.
2. Greedy generation under chunked prefill and forced preemption equals transformers'
   `generate` on each prompt alone, token for token.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (
    TINY_MOE_CONFIGS,
    build_tiny_model,
    hf_greedy,
    hf_model,
    needs_triton,
    rel_err,
    watch_chunked_prompts,
    write_gguf_from_hf,
)
from transformers import AutoModelForCausalLM

from tokenmill import LLM
from tokenmill.attention import make_backend
from tokenmill.bench.roofline import compute_ceilings
from tokenmill.config import CacheConfig
from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.kv_cache import KVCacheManager
from tokenmill.model_runner import ModelRunner
from tokenmill.models.loader import load_model, open_checkpoint
from tokenmill.models.packed_linear import BF16_FORMAT, PackedLinear
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import ModelWorker

ARCHS = ["llama", "qwen2", "qwen3", "phi3"]


@pytest.mark.parametrize("backend_name, kernels, kv_dtype, tol", [
    ("reference", "torch", torch.float32, 1e-4), ("cpu", "auto", torch.float32, 1e-4),
    ("cpu", "auto", torch.float16, 3e-3), ("cpu", "auto", torch.bfloat16, 2e-2), ("cpu", "auto", torch.int8, 4e-2),
    pytest.param("reference", "triton", torch.float32, 1e-4, marks=needs_triton)])
@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_step_logits_match_hf(tiny_models, arch, backend_name, kernels, kv_dtype, tol):
    """Reference path (SDPA, F.linear, torch ops) and fast path (C++ attention kernel, panel
    GEMM projections, fused C++ ops) both match transformers; with a float16, bfloat16 or int8 KV
    pool, to within what rounding K and V to it costs; and the Triton element-wise kernels of CUDA (on a GPU, or
    under the Triton interpreter without one)."""
    path = tiny_models[arch]
    checkpoint = open_checkpoint(path)
    cfg = checkpoint.config
    # the Triton kernels on CUDA where there is one, else under the interpreter on the CPU
    device = torch.device("cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu")
    model = load_model(checkpoint, 1024, torch.float32, device, kernels="torch" if kernels == "triton" else kernels)
    if kernels == "triton":
        from tokenmill.models.triton_ops import TritonFusedOps
        model.ops = TritonFusedOps()
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_prefix_caching=False)
    backend = make_backend(backend_name, device, kv_dtype=kv_dtype)
    runner = ModelRunner(ModelWorker(model, cfg, CacheConfig(64, 16), backend, device, kv_dtype), seed=0)
    rng = random.Random(arch)
    lengths = {"a": 70, "b": 23, "c": 41, "d": 9}
    reqs = {k: Request(request_id=k, prompt_token_ids=[rng.randrange(2, 384) for _ in range(n)],
                       params=SamplingParams(), max_tokens=8) for k, n in lengths.items()}
    reqs["b"].token_ids.append(rng.randrange(2, 384))  # b has sampled one token: next step decodes it

    def run(chunks: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Compute tokens [start, end) of each request in one step; logits of every token."""
        requests, counts = [], []
        for rid, (start, end) in chunks.items():
            r = reqs[rid]
            r.num_computed_tokens = start
            assert kv.allocate(r, end - start)
            requests.append(r)
            counts.append(end - start)
        inputs = runner.prepare(requests, counts)
        with torch.inference_mode():
            hidden = runner.worker.forward(inputs.input_ids, inputs.positions, inputs.meta)
            logits = model.compute_logits(hidden)
        out, offset = {}, 0
        order = [r.request_id for r in requests]
        short_max = runner.worker.short_query_max
        order = sorted(order, key=lambda rid: (chunks[rid][1] - chunks[rid][0]) > short_max)
        for rid in order:
            n = chunks[rid][1] - chunks[rid][0]
            out[rid] = logits[offset:offset + n].cpu()
            offset += n
        for rid, (start, end) in chunks.items():
            reqs[rid].num_computed_tokens = end
        return out

    run({"a": (0, 30), "b": (0, 23), "c": (0, 40)})
    step = run({"a": (30, 70), "b": (23, 24), "c": (40, 41), "d": (0, 9)})  # the mixed ragged step

    hf = hf_model(path)
    for rid, (start, end) in {"a": (30, 70), "b": (23, 24), "c": (40, 41), "d": (0, 9)}.items():
        with torch.no_grad():
            ref = hf(torch.tensor([reqs[rid].token_ids[:end]])).logits[0, start:end]
        assert rel_err(step[rid], ref) <= tol, f"{arch}/{rid}: {rel_err(step[rid], ref):.2e}"


PROMPT_LENGTHS = [1, 2, 5, 9, 16, 17, 33, 48, 64, 65, 100, 128, 160, 200, 256, 300]


@pytest.mark.parametrize("arch,backend,threshold", [("llama", "cpu", 0), ("qwen2", "reference", 0),
                                                    ("qwen3", "torch", 0), ("llama", "cpu", None)])
def test_greedy_generation_equals_hf_under_chunking_and_preemption(tiny_models, arch, backend, threshold):
    from tokenmill import LLM

    path = tiny_models[arch]
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in PROMPT_LENGTHS]
    # Threshold 0 (long prompts not held back): whole-budget chunks fill the small pool fast
    # enough to force preemptions. None: the default, long prompts in small chunks beside decodes.
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=40, block_size=16,
              attention_backend=backend, enable_prefix_caching=False, long_prefill_token_threshold=threshold)
    engine = llm.engine
    chunked = watch_chunked_prompts(engine)

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    assert chunked, "no prompt was split into chunks"
    assert threshold is None or engine.scheduler.num_preemptions > 0, "no request was preempted"
    assert engine.scheduler.stats().kv_blocks_used == 0

    hf = hf_model(path)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24), f"prompt of {len(prompt)} tokens"


FUSED = (*ARCHS, "mixtral", "qwen3_moe", "olmoe", "qwen2_moe")


@pytest.mark.parametrize("arch, bf16", [(arch, False) for arch in FUSED]
                         + [(arch, True) for arch in ("qwen3", "qwen3_moe")])
def test_fused_layers_give_the_python_layers_results_bit_for_bit(request, arch, bf16):
    """With the C++ kernels, a step whose attention is all in the kernel runs all the layers in one
    C++ call (fused_stack: the same kernels in the same order, Qwen3's per-head and OLMoE's whole
    q/k norms, the routers and experts of Mixtral, Qwen3-MoE and OLMoE, Qwen2-MoE's shared expert
    and its dense first layer included): its hidden states equal the Python layers', bit for bit,
    with the weights in bfloat16 panels too; a step with a chunk the kernel does not take (over 32
    tokens at head size 16) goes through the Python layers."""
    models = request.getfixturevalue("tiny_moe_models" if arch in TINY_MOE_CONFIGS else "tiny_models")
    checkpoint = open_checkpoint(models[arch])
    if bf16 and not load_cpu_kernels(required=True).bf16:
        pytest.skip("bfloat16 panels need AVX512-BF16")
    model = load_model(checkpoint, 1024, torch.float32, torch.device("cpu"), kernels="auto", bf16_weights=bf16)
    assert all(m.format == (BF16_FORMAT if bf16 else 0) for m in model.modules() if isinstance(m, PackedLinear))
    with torch.no_grad():  # norms of ones would hide a swapped or ignored norm weight
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    stack = model.fused_stack  # its layers hold the same weight tensors
    assert stack is not None and len(model.fused_layers) == len(model.layers)
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_prefix_caching=False)
    backend = make_backend("cpu", torch.device("cpu"), 16, checkpoint.config.head_dim)  # 16: chunks over 32 tokens
    runner = ModelRunner(ModelWorker(model, checkpoint.config, CacheConfig(64, 16), backend,  # go through SDPA
                                     torch.device("cpu"), torch.float32), seed=0)
    rng = random.Random(0)
    reqs = [Request(request_id=str(i), prompt_token_ids=[rng.randrange(2, 384) for _ in range(n)],
                    params=SamplingParams(), max_tokens=8) for i, n in enumerate((20, 45, 7))]

    def forward(requests, counts, use_fused):
        model.fused_stack = stack if use_fused else None
        inputs = runner.prepare(requests, counts)
        assert runner.worker.backend.all_in_kernel(inputs.meta) == all(n <= 32 for n in counts)  # fused or not
        with torch.inference_mode():
            return runner.worker.forward(inputs.input_ids, inputs.positions, inputs.meta)

    for r, n in zip(reqs, (20, 45, 7)):
        assert kv.allocate(r, n)
    for counts, requests in (([20, 7], [reqs[0], reqs[2]]), ([20, 45], reqs[:2])):  # in the kernel; not
        assert torch.equal(forward(requests, counts, True), forward(requests, counts, False))
    reqs[0].num_computed_tokens = 19   # a decode beside a 6-token chunk
    reqs[2].num_computed_tokens = 1
    assert torch.equal(forward([reqs[0], reqs[2]], [1, 6], True), forward([reqs[0], reqs[2]], [1, 6], False))


def test_the_defaults_take_bfloat16_weights_exactly_where_the_kernels_have_avx512_bf16(tiny_models):
    """dtype unset on the CPU: every projection and the head in bfloat16 panels, and a bfloat16
    pool, where the kernels have AVX512-BF16 (and `bench roofline` measures bfloat16's ceilings);
    float32 elsewhere, and under dtype="float32" everywhere; dtype="bfloat16" takes the same
    arithmetic there. Greedy tokens then follow
    transformers' float32 ones as vLLM's tests hold a bf16 run to them: equal up to the first
    divergence, where each side's token is in the other's top 5."""
    path = tiny_models["qwen3"]
    kernels = load_cpu_kernels(required=True)
    bf16, amx_rows = kernels.bf16, kernels.amx_min_rows
    cpu = {"device": "cpu", "num_kv_blocks": 32}  # (on the CPU also where the suite's engines run on CUDA)
    exact, auto = LLM(str(path), dtype="float32", **cpu), LLM(str(path), **cpu)
    asked = LLM(str(path), dtype="bfloat16", **cpu)  # as vLLM users ask for bfloat16
    if bf16:  # the same arithmetic as the defaults (torch's own bfloat16 layers elsewhere)
        assert asked.engine.arithmetic == auto.engine.arithmetic
    for llm, expected in ((exact, False), (auto, bf16)):
        model = llm.engine.runner.worker.model
        formats = {m.format for m in model.modules() if isinstance(m, PackedLinear)}
        assert formats == {BF16_FORMAT if expected else 0} and model.packed_lm_head.format in formats
        assert llm.engine.arithmetic["bf16_weights"] is expected
        assert llm.engine.arithmetic["amx_min_rows"] == (amx_rows if expected else 0)
        assert llm.engine.arithmetic["kv_dtype"] == ("bfloat16" if expected else "float32")
        ceilings = {"fp32 GEMM 2048^3", f"{'bf16' if expected else 'fp32'} layer projections, M=512 (engine)"}
        assert set(compute_ceilings(model, min_time=0.01)) == ceilings | ({"bf16 GEMM 2048^3 (torch)"} if expected
                                                                         else set())  # bench roofline's bar
    hf = hf_model(path)
    rng = random.Random(5)
    for prompt in ([rng.randrange(2, 384) for _ in range(n)] for n in (9, 40)):
        ours = auto.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=24, temperature=0.0, logprobs=5),
                             use_tqdm=False)[0].outputs[0]
        theirs = hf_greedy(hf, prompt, 24)
        i = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs)) if a != b), None)
        if i is None:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + theirs[:i]])).logits[0, -1]
        assert ours.token_ids[i] in logits.topk(5).indices.tolist() and theirs[i] in ours.logprobs[i]


@pytest.mark.parametrize("backend, ahead", [("cpu", False), ("reference", False), ("cpu", True)])
def test_prompt_logprobs_equal_hf_under_chunking_prefix_caching_and_preemption(tiny_llama, backend, ahead):
    """prompt_logprobs: each prompt token's logprob given the tokens before it (None for the first),
    with the top-n, and its rank there, equal transformers' log_softmax over the whole prompt, when the prompt is split
    into chunks, when an earlier request left its prefix in the cache (a request that wants prompt
    logprobs computes its whole prompt), and when requests are preempted and recomputed (scored
    once, not twice), with async scheduling too (ahead)."""
    from tokenmill import LLM

    rng = random.Random(3)
    shared = [rng.randrange(2, 384) for _ in range(48)]
    prompts = [shared + [rng.randrange(2, 384) for _ in range(n)] for n in (1, 40, 90, 150)]
    llm = LLM(str(tiny_llama), max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=30, block_size=16,
              dtype="float32", attention_backend=backend, long_prefill_token_threshold=0, async_scheduling=ahead)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False)  # caches `shared`
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=3),
                        use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "no request was preempted"
    plain = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.metrics.num_cached_tokens == 80  # others still hit the cache

    hf = hf_model(tiny_llama)
    for prompt, out in zip(prompts, outs):
        assert out.metrics.num_cached_tokens == 0
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        got, ranks = out.prompt_logprobs, out.prompt_logprob_ranks
        assert len(got) == len(ranks) == len(prompt) and got[0] is None and ranks[0] is None
        for j in range(1, len(prompt)):
            entry, row = got[j], ref[j - 1]
            top = row.topk(3)
            assert set(entry) == {prompt[j]} | set(top.indices.tolist()), f"token {j} of {len(prompt)}"
            for token, lp in entry.items():
                assert lp == pytest.approx(row[token].item(), abs=1e-4)
            own = row[prompt[j]].item()  # its rank: the tokens at least as likely, within float32's reach
            assert (row > own + 1e-4).sum() + 1 <= ranks[j] <= (row >= own - 1e-4).sum(), f"token {j}"


def prompt_logits(path, prompt: list[int], kernels: str) -> torch.Tensor:
    """Our logits at every position of `prompt`, computed in one step from an empty cache."""
    checkpoint = open_checkpoint(path)
    model = load_model(checkpoint, 256, torch.float32, torch.device("cpu"), kernels=kernels)
    backend = make_backend("cpu" if kernels == "auto" else "reference", torch.device("cpu"))
    runner = ModelRunner(ModelWorker(model, checkpoint.config, CacheConfig(32, 16), backend, torch.device("cpu"),
                                     torch.float32), seed=0)
    request = Request(request_id="a", prompt_token_ids=prompt, params=SamplingParams(), max_tokens=1)
    assert KVCacheManager(num_blocks=32, block_size=16, enable_prefix_caching=False).allocate(request, len(prompt))
    inputs = runner.prepare([request], [len(prompt)])
    with torch.inference_mode():
        return model.compute_logits(runner.worker.forward(inputs.input_ids, inputs.positions, inputs.meta))


def assert_prompt_logits_match_hf(path, prompt: list[int]) -> None:
    """Our logits of `prompt` in one step, on the torch path and the C++ one, within 1e-5 (relative)
    of transformers' forward of the checkpoint at `path`."""
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([prompt])).logits[0]
    for kernels in ("torch", "auto"):
        got = prompt_logits(path, prompt, kernels)
        assert rel_err(got, ref) <= 1e-5, f"{kernels}: {rel_err(got, ref):.2e}"


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
GGUF_MODELS = {  # llama: biases on q, k, v and o; q's and k's permuted as llama.cpp does their weights
    "llama_qk_bias": dict(model_type="llama", attention_bias=True, rope_theta=500000.0),
    "qwen2_yarn": dict(model_type="qwen2", tie_word_embeddings=True, rope_scaling=YARN, rope_theta=1e6),
    "qwen3_head_dim": dict(model_type="qwen3", head_dim=32, rope_theta=1e6),
}


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("case", list(GGUF_MODELS))
def test_gguf_written_as_llama_cpp_does_gives_hfs_logits(tmp_path, case, qtype):
    """A tiny transformers model written to GGUF as llama.cpp's converter writes it (its metadata,
    llama's permuted q/k rows and biases, YaRN scaling) gives, with float32 and with block panels,
    the logits of the same model holding the file's dequantized weights."""
    from transformers import AutoConfig
    options = dict(GGUF_MODELS[case])
    config = AutoConfig.for_model(options.pop("model_type"), vocab_size=96, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, initializer_range=0.2, **options)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for bias in ("q_proj", "k_proj", "v_proj", "o_proj"):  # transformers starts them at zero
                if getattr(layer.self_attn, bias).bias is not None:
                    getattr(layer.self_attn, bias).bias.normal_(0, 0.5)
    path = tmp_path / f"{case}.gguf"
    write_gguf_from_hf(hf, path, qtype)
    rng = random.Random(0)
    prompt = [rng.randrange(96) for _ in range(80)]  # past YaRN's original 32 positions
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    for kernels in ("torch", "auto"):
        got = prompt_logits(path, prompt, kernels)
        assert rel_err(got, ref) <= 1e-5, f"{kernels}: {rel_err(got, ref):.2e}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1)), kernels


@pytest.mark.parametrize("extra", [{"beta_fast": 16.0}, {"factor": None}], ids=["factor", "factor_from_lengths"])
def test_yarn_rope_scaling_gives_hfs_logits(tmp_path, extra):
    """Qwen's long-context YaRN scaling (rope_scaling in config.json): frequencies and the
    attention factor as transformers computes them, inside and past the original context; with no
    factor, transformers takes the ratio of max_position_embeddings to the original context."""
    path = build_tiny_model(tmp_path / "qwen3_yarn", "qwen3", max_position_embeddings=128,
                            rope_scaling={**YARN, **extra}, rope_theta=1e6)
    rng = random.Random(1)
    prompt = [rng.randrange(2, 384) for _ in range(100)]
    assert_prompt_logits_match_hf(path, prompt)


@pytest.mark.parametrize("partial, scaling", [
    (1.0, None), (0.5, None), (1.0, "longrope"), (0.75, "longrope")],
    ids=["phi3", "partial_rotary", "longrope", "phi4_mini_like"])
def test_phi3_gives_hfs_logits_with_fused_checkpoint_weights_partial_rotary_and_longrope(tmp_path, partial, scaling):
    """Phi-3's fused qkv_proj and gate_up_proj, split at load; heads that rotate only part of their
    dims (Phi-4-mini: 3/4); LongRoPE's short factors and attention factor inside the original
    context (64 of 256 positions here; the prompt stays inside it: past it transformers turns every
    position of the sequence to the long factors, this engine only the positions past it)."""
    head_dim = 16  # hidden 96 / 6 heads
    rotary_pairs = int(head_dim * partial) // 2
    extra = {"partial_rotary_factor": partial, "max_position_embeddings": 256, "original_max_position_embeddings": 64}
    if scaling:  # factor 256 / 64: attention factor sqrt(1 + ln 4 / ln 64)
        rng = random.Random(3)
        extra["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": 64,
                                 "short_factor": [1 + rng.random() for _ in range(rotary_pairs)],
                                 "long_factor": [2 + 4 * rng.random() for _ in range(rotary_pairs)]}
    path = build_tiny_model(tmp_path / "phi3", "phi3", **extra)
    rng = random.Random(1)
    prompt = [rng.randrange(2, 384) for _ in range(50)]
    assert_prompt_logits_match_hf(path, prompt)


def randomize_biases(path) -> None:
    """Give every bias of the checkpoint at `path` random values (transformers' init makes them 0,
    where a missing or misplaced bias would not show in the logits)."""
    model = hf_model(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(path), safe_serialization=True)


@pytest.mark.parametrize("arch, config", [
    ("llama", {"attention_bias": True}), ("qwen3", {"attention_bias": True}),
    ("qwen2", {"attention_bias": False}), ("phi3", {"attention_bias": True}),
    ("olmoe", {"attention_bias": True}), ("gemma2", {"attention_bias": True}),
    ("mistral", {"sliding_window": 8, "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"]}),
    ("ministral", {"sliding_window": 8, "head_dim": 16, "layer_types": ["full_attention", "sliding_attention"]}),
], ids=["llama_attention_bias", "qwen3_attention_bias", "qwen2_attention_bias_false", "phi3_attention_bias",
        "olmoe_attention_bias", "gemma2_attention_bias", "mistral_layer_types", "ministral"])
def test_config_keys_are_read_as_each_transformers_model_reads_them(tmp_path, arch, config):
    """Llama's, Qwen3's, OLMoE's and Gemma's attention_bias puts biases on q, k, v and o_proj; Qwen2 has q, k and v
    biases whatever it says and Phi-3 none; a Mistral config with layer_types runs as Ministral,
    each layer with the attention its type names (the prompt of 40 tokens is past the window of 8)."""
    path = build_tiny_model(tmp_path / arch, arch, **config)
    randomize_biases(path)
    rng = random.Random(2)
    assert_prompt_logits_match_hf(path, [rng.randrange(2, 384) for _ in range(40)])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma3_text"])
def test_an_int8_pool_keeps_greedy_tokens_within_the_float32_pools_top_5(tmp_path, arch):
    """kv_cache_dtype="int8" on each kind of attention the tiny families have (head size 24 on the
    kernel's per-row path, Gemma 2's soft cap and windows, Gemma 3's windows): greedy tokens equal
    the float32 pool's up to the first divergence, and there each side's token is in the other's
    top 5, as vLLM's tests check lower-precision runs. (A tiny random Mixtral diverged at a token of
    rank 6 in a flat distribution, its top 6 within 0.51 nats: a routing flip moves a MoE's logits
    more than the pool's rounding moves a dense model's.)"""
    rng = random.Random(arch)
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (5, 40, 90)]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True)
    path = build_tiny_model(tmp_path / arch, arch)
    runs = [LLM(str(path), dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=32)
            .generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False) for kv in ("auto", "int8")]
    for exact, int8 in zip(*runs):
        a, b = exact.outputs[0], int8.outputs[0]
        diverged = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if diverged is not None:
            assert b.token_ids[diverged] in a.logprobs[diverged] and a.token_ids[diverged] in b.logprobs[diverged]
