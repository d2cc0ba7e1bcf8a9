"""Gemma 2 and Gemma 3 (text) against transformers on tiny random-weight models (conftest's
TINY_GEMMA_CONFIGS: soft caps that bite, query_pre_attn_scalar and head_dim of their own, random
(1 + w) norms, sliding layers beside global ones, Gemma 3's two rope bases), with prompts several
windows long. transformers' eager attention, float32, is the oracle."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import (
    TINY_GEMMA_CONFIGS,
    _save_tokenizer,
    copy_model,
    hf_greedy,
    hf_model,
    rel_err,
    stepwise_logits,
    watch_chunked_prompts,
)
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from tokenmill import LLM, SamplingParams
from tokenmill.attention import make_backend
from tokenmill.models.loader import load_model, open_checkpoint

ARCHS = ["gemma2", "gemma3_text"]
# what each tiny model's oracle loses without its own features: Gemma 2's caps, Gemma 3's local rope base
WITHOUT = {"gemma2": dict(attn_logit_softcapping=None, final_logit_softcapping=None),
           "gemma3_text": dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 10000.0},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})}


def hf_eager(path, **changes):
    """The transformers oracle with eager attention (its SDPA path does not take this model's features)."""
    return hf_model(path, "eager", **changes)


@pytest.mark.parametrize("backend_name, kernels", [("reference", "torch"), ("torch", "auto"), ("auto", "auto")])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_over_several_windows_match_transformers(tiny_gemma_models, arch, backend_name, kernels):
    """A 110-token prompt (over four windows) in chunks of 37, then decodes, one step each: every
    position's logits as transformers', by the torch ops or the packed projections and fused C++ ops,
    through the reference, torch and C++ kernel ("auto") attention backends; and far from the
    oracle's without the model's own features."""
    path = tiny_gemma_models[arch]
    checkpoint = open_checkpoint(path)
    device = torch.device("cpu")
    model = load_model(checkpoint, 256, torch.float32, device, kernels=kernels)
    backend = make_backend(backend_name, device, 16, checkpoint.config.head_dim)
    assert backend.name == {"auto": "cpu"}.get(backend_name, backend_name)
    rng = random.Random(arch)
    tokens = [rng.randrange(2, 384) for _ in range(114)]
    got = stepwise_logits(model, checkpoint.config, backend, tokens, 110,
                          ((0, 37), (37, 74), (74, 110), (110, 111), (111, 112), (112, 113), (113, 114)))
    with torch.no_grad():
        ref = hf_eager(path)(torch.tensor([tokens])).logits[0]
        without = hf_eager(path, **WITHOUT[arch])(torch.tensor([tokens])).logits[0]
    assert rel_err(got, ref) <= 1e-4, f"{rel_err(got, ref):.2e}"
    assert rel_err(without, ref) > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_equals_transformers_with_chunked_prompts_and_a_shared_prefix(tiny_gemma_models, arch):
    """The default CPU path (packed projections, the C++ attention kernel): prompts of up to six
    windows in 32-token chunks, three sharing a 64-token prefix, through a pool too small for all at
    once; every output as transformers' generate."""
    path = tiny_gemma_models[arch]
    rng = random.Random(4)
    shared = [rng.randrange(2, 384) for _ in range(64)]
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (3, 30, 70, 130)]
    prompts += [shared + [rng.randrange(2, 384) for _ in range(n)] for n in (5, 40, 60)]
    llm = LLM(str(path), dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=16, block_size=16,
              long_prefill_token_threshold=0)
    engine = llm.engine
    # the soft-capped scores in the CPU kernel, or in Triton's (TOKENMILL_TEST_DEVICE=cuda)
    assert engine.runner.worker.backend.name == ("triton" if engine.config.device.startswith("cuda") else "cpu")
    chunked = watch_chunked_prompts(engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=20, temperature=0.0),
                        use_tqdm=False)
    assert len(chunked) >= 3 and engine.scheduler.prompt_tokens_hit > 0
    assert sum(len(set(out.outputs[0].token_ids)) for out in outs) > 5 * len(outs)  # not one token repeated
    hf = hf_eager(path)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 20), f"prompt of {len(prompt)} tokens"


def test_an_end_of_turn_id_in_generation_config_ends_the_output(tiny_gemma_models, tmp_path):
    """Gemma's instruction-tuned checkpoints list <end_of_turn> beside <eos> in generation_config.json's
    eos_token_id: generation stops at the first of either, as transformers' generate does with both."""
    path = copy_model(tiny_gemma_models["gemma3_text"], tmp_path / "it")
    prompt = [random.Random(6).randrange(2, 384) for _ in range(12)]
    free = hf_greedy(hf_eager(path), prompt, 12)
    end_of_turn = free[4]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, end_of_turn]}))
    out = LLM(str(path), num_kv_blocks=8).generate([{"prompt_token_ids": prompt}],
                                                   SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == free[:free.index(end_of_turn) + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_two_tensor_parallel_ranks_give_one_ranks_greedy_tokens(tiny_gemma_models):
    """Gemma 2 over two ranks (gloo on 127.0.0.1): each its heads with their capped scores, its MLP
    slice, and its vocabulary rows of the scaled embeddings and of the capped logits."""
    prompts = [list(range(10, 58)) + [60 + i] for i in range(3)] + [list(range(5, 100))]
    tokens = {}
    for size in (1, 2):
        llm = LLM(str(tiny_gemma_models["gemma2"]), tensor_parallel_size=size, max_num_batched_tokens=16,
                  num_kv_blocks=20, block_size=16)
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
        tokens[size] = [o.outputs[0].token_ids for o in outs]
        llm.engine.close()
    assert tokens[2] == tokens[1]


def test_a_multimodal_gemma3_serves_its_language_model_as_transformers_runs_text(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (model_type gemma3: a vision tower beside the language
    model, whose config sits in text_config with most keys left to transformers' defaults): tokenmill
    loads the language model alone and generates from text as transformers' multimodal model does."""
    text = {k: v for k, v in TINY_GEMMA_CONFIGS["gemma3_text"].items() if k != "model_type"}
    text.update(vocab_size=384, hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=2,
                max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, initializer_range=0.2)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=383,
                          boi_token_index=381, eoi_token_index=382)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the tiny text models' norms and embeddings (conftest.build_tiny_model)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "vision" not in name:
                p.normal_(0.0, 0.5)
        model.get_input_embeddings().weight.mul_(0.1)
    model.save_pretrained(str(tmp_path))
    _save_tokenizer(tmp_path)
    rng = random.Random(8)
    prompts = [[rng.randrange(2, 381) for _ in range(n)] for n in (4, 45)]
    llm = LLM(str(tmp_path), num_kv_blocks=16, max_num_batched_tokens=32)
    assert llm.engine.runner.worker.model.config.architecture == "gemma3_text"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, temperature=0.0),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12), f"prompt of {len(prompt)} tokens"
