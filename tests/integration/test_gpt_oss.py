"""gpt-oss against transformers on a tiny random-weight model: three layers (sliding, full,
sliding, a window of 12 tokens), attention sinks drawn large enough to matter, six experts with
biases and a SwiGLU clamp low enough to bite, YaRN rope without truncation, head size 32 (the C++
kernel's tile products on the full layer). transformers' eager attention, float32, is the oracle.
Its MXFP4 experts, dequantized at load, give the weights their blocks and scales encode."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import _save_tokenizer, copy_model, hf_greedy, hf_model, rel_err, stepwise_logits, watch_chunked_prompts
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig

from tokenmill import LLM, SamplingParams
from tokenmill.attention import make_backend
from tokenmill.models.gpt_oss import FP4_VALUES, dequantize_mxfp4
from tokenmill.models.loader import load_model, open_checkpoint
from tokenmill.models.moe import ClampedSwiGLU, SparseMoeBlock
from tokenmill.models.packed_linear import PackedLinear

TINY_GPT_OSS = dict(vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, num_local_experts=6, num_experts_per_tok=2, sliding_window=12,
                    swiglu_limit=2.0, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
                    initializer_range=0.2,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 256,
                                     "rope_theta": 50000.0})


def hf_eager(path, **changes):
    """The transformers oracle with eager attention (its SDPA path does not take this model's features)."""
    return hf_model(path, "eager", **changes)


def save_tiny_gpt_oss(path, shape: dict):
    """A random gpt-oss of config `shape` and its tokenizer saved at `path`; its sinks drawn from
    N(0, 2), as transformers' init draws them about 0."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**shape), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    model.save_pretrained(str(path))
    _save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    return save_tiny_gpt_oss(tmp_path_factory.mktemp("tiny_gpt_oss") / "gpt_oss", TINY_GPT_OSS)


def test_the_config_reads_as_transformers_builds_the_model(tiny_gpt_oss):
    config = open_checkpoint(tiny_gpt_oss).config
    assert config.layer_windows == (12, None, 12)
    assert config.attention_sinks and config.attention_bias and config.o_proj_bias
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["truncate"] is False
    assert config.rope_theta == 50000.0
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (6, 2, 64)
    assert moe.router_bias and moe.softmax_after_topk and (moe.swiglu_limit, moe.swiglu_alpha) == (2.0, 1.702)
    model = load_model(open_checkpoint(tiny_gpt_oss), 64, torch.float32, torch.device("cpu"), kernels="auto")
    block = model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and all(isinstance(e, ClampedSwiGLU) for e in block.experts)
    # on the CPU kernels' path the experts' projections and the router are packed in panels, biases and all
    packed = [block.gate, block.experts[5].gate_up_proj, block.experts[5].down_proj, model.layers[2].self_attn.o_proj]
    assert all(isinstance(m, PackedLinear) and m.panels is not None and m.bias is not None for m in packed)
    assert model.fused_stack is None  # the one-call C++ layers are dense Llama layers only


@pytest.fixture(scope="module")
def oracle_logits(tiny_gpt_oss) -> tuple[list[int], torch.Tensor]:
    """73 tokens and transformers' logits at each of them, checked to be far from its logits with
    the clamp moved out of reach (the clamp bites in this model)."""
    rng = random.Random(1)
    tokens = [rng.randrange(2, 384) for _ in range(73)]
    with torch.no_grad():
        ref = hf_eager(tiny_gpt_oss)(torch.tensor([tokens])).logits[0]
        unclamped = hf_eager(tiny_gpt_oss, swiglu_limit=1000.0)(torch.tensor([tokens])).logits[0]
    assert rel_err(unclamped, ref) > 1e-2
    return tokens, ref


@pytest.mark.parametrize("backend_name, kernels", [("reference", "torch"), ("torch", "auto"), ("auto", "auto")])
def test_logits_over_several_windows_match_transformers(tiny_gpt_oss, oracle_logits, backend_name, kernels):
    """A 70-token prompt (about six windows) in chunks of 30, 25 and 15, then decodes, one step
    each: every position's logits as transformers', by the torch ops or the packed projections,
    through the reference, torch and C++ kernel ("auto") attention backends."""
    checkpoint = open_checkpoint(tiny_gpt_oss)
    device = torch.device("cpu")
    model = load_model(checkpoint, 256, torch.float32, device, kernels=kernels)
    backend = make_backend(backend_name, device, 16, checkpoint.config.head_dim)
    assert backend.name == {"auto": "cpu"}.get(backend_name, backend_name)
    tokens, ref = oracle_logits
    got = stepwise_logits(model, checkpoint.config, backend, tokens, 70,
                          ((0, 30), (30, 55), (55, 70), (70, 71), (71, 72), (72, 73)))
    assert rel_err(got, ref) <= 1e-4, f"{rel_err(got, ref):.2e}"


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_generation_equals_transformers_with_chunked_prompts_and_a_shared_prefix(tiny_gpt_oss, backend):
    """Prompts of up to five windows in 16-token chunks, two sharing a 32-token prefix that a first
    request cached, on the default CPU path (packed projections, the C++ attention kernel) and on the
    torch backend: every output as transformers' generate."""
    rng = random.Random(4)
    shared = [rng.randrange(2, 384) for _ in range(32)]
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (3, 60)]
    prompts += [shared + [rng.randrange(2, 384) for _ in range(n)] for n in (5, 25)]
    llm = LLM(str(tiny_gpt_oss), max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=24, block_size=16,
              long_prefill_token_threshold=0, attention_backend=backend)
    engine = llm.engine
    assert engine.runner.worker.backend.name == {"auto": "cpu"}.get(backend, backend)
    llm.generate([{"prompt_token_ids": shared + [5]}], SamplingParams(max_tokens=1), use_tqdm=False)  # caches it
    chunked = watch_chunked_prompts(engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, temperature=0.0),
                        use_tqdm=False)
    assert len(chunked) >= 2 and any(out.metrics.num_cached_tokens >= 32 for out in outs)
    assert sum(len(set(out.outputs[0].token_ids)) for out in outs) > 3 * len(outs)  # not one token repeated
    hf = hf_eager(tiny_gpt_oss)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12), f"prompt of {len(prompt)} tokens"


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) float -> MXFP4 blocks (..., K / 32, 16) and scales (..., K / 32): each 32 values'
    scale the power of two that brings their largest to at most 6, each value the nearest code."""
    x = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)   # (..., G)
    table = torch.tensor(FP4_VALUES)
    codes = ((x / torch.exp2(exponent).unsqueeze(-1)).unsqueeze(-1) - table).abs().argmin(-1)      # (..., G, 32)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_codes_decode_low_nibble_first_times_the_block_scale():
    blocks = torch.zeros(2, 16, dtype=torch.uint8)                     # two blocks of 32 values
    blocks[0, 0], blocks[0, 1], blocks[0, 15] = 0x21, 0xF7, 0x9C   # values 0.5, 1.0 | 6.0, -6.0 | -2.0, -0.5
    blocks[1, 3] = 0x0F
    values = dequantize_mxfp4(blocks, torch.tensor([129, 120], dtype=torch.uint8))   # scales 2^2, 2^-7
    assert values.shape == (64,)
    assert values[:4].tolist() == [2.0, 4.0, 24.0, -24.0] and values[30:32].tolist() == [-8.0, -2.0]
    assert values[4:30].abs().sum() == 0
    assert values[32 + 6] == -6.0 * 2.0 ** -7 and values[32 + 7] == 0 and values[32:38].abs().sum() == 0
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks, torch.tensor([1, 2, 3], dtype=torch.uint8))


def test_mxfp4_experts_load_as_the_weights_their_blocks_encode(tiny_gpt_oss, tmp_path):
    """The tiny model's expert matrices written as a released checkpoint has them (MXFP4 blocks and
    scales in the (out, in) layout, quantization_config mxfp4) load as the float checkpoint holding
    the values those codes decode to, every parameter equal; transformers, loading the MXFP4
    directory itself (dequantized, without Triton), holds those values too and generates as we do."""
    tensors = load_file(str(tiny_gpt_oss / "model.safetensors"))
    fused = ("experts.gate_up_proj", "experts.down_proj")
    decoded, quantized = dict(tensors), {k: v for k, v in tensors.items() if not k.endswith(fused)}
    for name, tensor in tensors.items():
        if name.endswith(fused):
            blocks, scales = to_mxfp4(tensor.transpose(1, 2))                  # (E, out, in / 32, 16)
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            decoded[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
            assert rel_err(decoded[name], tensor) < 0.2                      # 4-bit codes of the same weights
    float_dir, fp4_dir = copy_model(tiny_gpt_oss, tmp_path / "float"), copy_model(tiny_gpt_oss, tmp_path / "fp4")
    save_file(decoded, str(float_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(quantized, str(fp4_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp4_dir / "config.json").read_text())
    (fp4_dir / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    cpu = torch.device("cpu")
    want = load_model(open_checkpoint(float_dir), 64, torch.float32, cpu, kernels="torch").state_dict()
    got = load_model(open_checkpoint(fp4_dir), 64, torch.float32, cpu, kernels="torch").state_dict()
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    prompt = [random.Random(9).randrange(2, 384) for _ in range(30)]
    out = LLM(str(fp4_dir), num_kv_blocks=8).generate([{"prompt_token_ids": prompt}],
                                                      SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    hf = hf_eager(fp4_dir)
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(hf.model.layers[1].mlp.experts, name), decoded[f"model.layers.1.mlp.experts.{name}"])
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 8)


def test_rope_left_out_of_config_json_is_transformers_yarn_default(tiny_gpt_oss, tmp_path):
    config = open_checkpoint(copy_model(tiny_gpt_oss, tmp_path / "no_rope", rope_parameters=None)).config
    assert config.rope_theta == 150000.0
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 4096}
    hf = GptOssConfig.from_pretrained(str(tmp_path / "no_rope"))
    assert hf.rope_parameters == {**config.rope_scaling, "rope_theta": config.rope_theta}


@pytest.mark.parametrize("change, named", [
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq' for gpt_oss"),
    ({"attention_bias": False}, "attention_bias"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
])
def test_an_unsupported_variant_is_refused_by_name(tiny_gpt_oss, tmp_path, change, named):
    with pytest.raises(ValueError, match=named):
        open_checkpoint(copy_model(tiny_gpt_oss, tmp_path / "changed", **change))


def test_a_quantized_checkpoint_of_another_model_is_refused_by_name(tiny_gpt_oss, tmp_path):
    path = copy_model(tiny_gpt_oss, tmp_path / "gptq", model_type="llama", quantization_config={"quant_method": "gptq"})
    with pytest.raises(ValueError, match="quant_method 'gptq' for llama"):
        open_checkpoint(path)


def test_tensor_parallelism_is_refused_naming_the_sinks(tiny_gpt_oss):
    with pytest.raises(ValueError, match="tensor_parallel_size 2: gpt_oss's attention sinks and o_proj bias"):
        LLM(str(tiny_gpt_oss), tensor_parallel_size=2)
