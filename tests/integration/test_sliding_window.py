"""Sliding-window models against transformers on tiny random-weight models, with prompts several
windows long: a Mistral (every layer slides) and a Qwen2 with use_sliding_window (layer 0 global,
layer 1 sliding). transformers' eager attention applies the window, and is the oracle."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import build_tiny_model, hf_greedy, hf_model, rel_err, stepwise_logits
from transformers import AutoModelForCausalLM

from tokenmill.attention import make_backend
from tokenmill.config import CacheConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.model_runner import ModelRunner
from tokenmill.models.loader import load_model, open_checkpoint
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import ModelWorker

WINDOWED = {
    "mistral": dict(sliding_window=24, tie_word_embeddings=False),
    "qwen2": dict(sliding_window=20, use_sliding_window=True, max_window_layers=1, tie_word_embeddings=True),
}

GLOBAL = {"mistral": dict(sliding_window=None), "qwen2": dict(layer_types=["full_attention"] * 2)}  # windows off


def hf_eager(path, **changes):
    """The transformers oracle with eager attention (its SDPA path does not take this model's features)."""
    return hf_model(path, "eager", **changes)


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("windowed")
    return {arch: build_tiny_model(root / arch, arch, rope_theta=10000.0, **extra) for arch, extra in WINDOWED.items()}


@pytest.mark.parametrize("backend_name", ["reference", "torch", "cpu"])
@pytest.mark.parametrize("arch", list(WINDOWED))
def test_logits_over_several_windows_match_hfs_eager_attention(windowed_models, arch, backend_name):
    """A 110-token prompt in chunks of 37, then decodes, one step each: every position's logits
    as transformers' with the window applied (and far from those without it)."""
    path = windowed_models[arch]
    checkpoint = open_checkpoint(path)
    device = torch.device("cpu")
    model = load_model(checkpoint, 256, torch.float32, device, kernels="auto" if backend_name == "cpu" else "torch")
    rng = random.Random(arch)
    tokens = [rng.randrange(2, 384) for _ in range(114)]
    got = stepwise_logits(model, checkpoint.config, make_backend(backend_name, device), tokens, 110,
                          ((0, 37), (37, 74), (74, 110), (110, 111), (111, 112), (112, 113), (113, 114)))
    with torch.no_grad():
        ref = hf_eager(path)(torch.tensor([tokens])).logits[0]
        unwindowed = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **GLOBAL[arch]).eval()
        unwindowed = unwindowed(torch.tensor([tokens]), use_cache=False).logits[0]
    assert rel_err(got, ref) <= 1e-4, f"{rel_err(got, ref):.2e}"
    assert rel_err(unwindowed[40:], ref[40:]) > 1e-2  # the window matters past it


@pytest.mark.parametrize("arch,backend", [("mistral", "cpu"), ("qwen2", "torch"), ("mistral", "reference")])
def test_greedy_generation_equals_hf_under_chunking_prefix_caching_and_preemption(windowed_models, arch, backend):
    """Prompts of up to seven windows, three sharing a 64-token prefix, in 32-token chunks through
    a pool too small for all of them at once, blocks outside the window given back as they go
    (Mistral): every output as transformers' generate."""
    from tokenmill import LLM

    path = windowed_models[arch]
    rng = random.Random(2)
    shared = [rng.randrange(2, 384) for _ in range(64)]
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (3, 30, 70, 130, 170)]
    prompts += [shared + [rng.randrange(2, 384) for _ in range(n)] for n in (5, 40, 90)]
    llm = LLM(str(path), dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=14, block_size=16,
              attention_backend=backend, long_prefill_token_threshold=0)
    engine = llm.engine
    kv, released = engine.scheduler.kv, []
    release = kv.release_outside_window
    kv.release_outside_window = lambda r: released.append(release(r)) or released[-1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    assert (sum(released) > 0) == (arch == "mistral")  # with a global layer (Qwen2) every block stays
    assert engine.scheduler.num_preemptions > 0, "no request was preempted"
    assert engine.scheduler.prompt_tokens_hit > 0, "no prefix was reused"
    assert engine.scheduler.stats().kv_blocks_used == 0

    hf = hf_eager(path)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_a_long_output_holds_only_the_blocks_its_window_spans(windowed_models, arch):
    """A 40-token prompt and 200 output tokens, 16-token blocks: with every layer windowed (Mistral,
    24 tokens) a step that computes c.. holds exactly the blocks from the one with position
    c - 23 on, 2 or 3 of them, and the pool no more; with a global layer (this Qwen2) every block
    stays. The output is transformers' either way. A windowed model's context is not lowered to
    what the pool holds, only to the window and a step."""
    from tokenmill import LLM

    path = windowed_models[arch]
    # a pool of 6 blocks (96 tokens) serves Mistral's whole context: 24 + 32 tokens and two part blocks
    llm = LLM(str(path), max_num_seqs=1, max_num_batched_tokens=32, num_kv_blocks=6 if arch == "mistral" else 16,
              dtype="float32", block_size=16)
    assert llm.engine.max_model_len == (1024 if arch == "mistral" else 256)
    scheduler = llm.engine.scheduler
    held, expected = [], []
    original = scheduler.schedule

    def spy():
        sched = original()
        for r, n in zip(sched.requests, sched.num_scheduled_tokens):
            c, null = r.num_computed_tokens, scheduler.kv.null_block
            first = max(0, c - 23) // 16 if arch == "mistral" else 0
            expected.append(-(-(c + n) // 16) - first)
            held.append(len([b for b in r.block_ids if b != null]))
            assert scheduler.kv.pool.num_used_blocks == held[-1]
        return sched
    scheduler.schedule = spy

    prompt = [random.Random(3).randrange(2, 384) for _ in range(40)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=200, temperature=0.0,
                                                                    ignore_eos=True), use_tqdm=False)
    assert held == expected
    assert max(held) == (3 if arch == "mistral" else 15)
    assert out[0].outputs[0].token_ids == hf_greedy(hf_eager(path), prompt, 200)


def test_fused_layers_apply_the_window_as_the_python_layers_do(windowed_models):
    """The one-call C++ layer stack passes each layer's window to the kernel: a step of a prompt
    chunk and a decode, both past the window, gives the Python layers' hidden states bit for bit."""
    checkpoint = open_checkpoint(windowed_models["mistral"])
    model = load_model(checkpoint, 256, torch.float32, torch.device("cpu"), kernels="auto")
    stack = model.fused_stack
    assert stack is not None and [f.window for f in model.fused_layers] == [24, 24]
    kv = KVCacheManager(num_blocks=32, block_size=16, enable_prefix_caching=False)
    backend = make_backend("cpu", torch.device("cpu"))
    runner = ModelRunner(ModelWorker(model, checkpoint.config, CacheConfig(32, 16), backend, torch.device("cpu"),
                                     torch.float32), seed=0)
    rng = random.Random(5)
    a, b = (Request(request_id=rid, prompt_token_ids=[rng.randrange(2, 384) for _ in range(n)], params=SamplingParams(),
                    max_tokens=8) for rid, n in (("a", 60), ("b", 31)))

    def forward(counts, use_fused):
        model.fused_stack = stack if use_fused else None
        inputs = runner.prepare([b, a], counts)
        with torch.inference_mode():
            return runner.worker.forward(inputs.input_ids, inputs.positions, inputs.meta)

    assert kv.allocate(a, 32) and kv.allocate(b, 30)
    forward([30, 32], False)                                # fills the pool
    a.num_computed_tokens, b.num_computed_tokens = 32, 30   # a: a 28-token chunk; b: its last prompt token
    assert kv.allocate(a, 28) and kv.allocate(b, 1)
    assert torch.equal(forward([1, 28], True), forward([1, 28], False))


def test_a_windowed_draft_model_drafts_to_the_end_of_a_sequence_longer_than_its_pool(windowed_models):
    """Mistral (every layer slides, 24 tokens) drafting for itself, 3 tokens a step, in pools of 6
    blocks (96 tokens) for a 40-token prompt and 200 outputs: the draft gives back its blocks
    outside the window as the target does, so it drafts every step to the last token, each
    draft accepted (it had stopped at 42 drafts, once the sequence passed its pool), and the
    output is transformers'."""
    from tokenmill import LLM

    path = windowed_models["mistral"]
    llm = LLM(str(path), max_num_seqs=1, max_num_batched_tokens=32, num_kv_blocks=6, dtype="float32",
              block_size=16, speculative=f"draft:{path}", num_speculative_tokens=3, speculative_adaptive=False)
    prompt = [random.Random(3).randrange(2, 384) for _ in range(40)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=200, temperature=0.0,
                                                                    ignore_eos=True), use_tqdm=False)
    spec = llm.engine.speculator
    assert spec.num_accepted == spec.num_proposed >= 147  # 3 drafts and a token a step, to the 200th
    assert out[0].outputs[0].token_ids == hf_greedy(hf_eager(path), prompt, 200)
