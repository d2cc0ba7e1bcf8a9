"""gpt-oss against transformers on a tiny random-weight model: three layers (sliding, full,
sliding, a window of 12 tokens), attention sinks drawn large enough to matter, six experts with
biases and a SwiGLU clamp low enough to bite, YaRN rope without truncation, head size 32 (the C++
kernel's tile products on the full layer). transformers' eager attention, float32, is the oracle.
Its MXFP4 experts, dequantized at load, give the weights their blocks and scales encode."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import _save_tokenizer, copy_model, hf_greedy, hf_model, rel_err, stepwise_logits, watch_chunked_prompts
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig

from tokenmill import LLM, SamplingParams
from tokenmill.attention import make_backend
from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.models.gpt_oss import FP4_VALUES, dequantize_ggml_mxfp4, dequantize_mxfp4, ggml_mxfp4_rows
from tokenmill.models.loader import load_model, open_checkpoint
from tokenmill.models.moe import ClampedSwiGLU, SparseMoeBlock
from tokenmill.models.packed_linear import BLOCK_FORMATS, PackedLinear

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
              dtype="float32", long_prefill_token_threshold=0, attention_backend=backend)
    engine = llm.engine
    # auto: the CPU kernel, or Triton's on CUDA (TOKENMILL_TEST_DEVICE=cuda)
    auto = "triton" if engine.config.device.startswith("cuda") else "cpu"
    assert engine.runner.worker.backend.name == {"auto": auto}.get(backend, backend)
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


def test_checkpoint_blocks_reordered_into_ggml_rows_decode_to_the_same_floats():
    """Byte i of a checkpoint block holds values 2i and 2i + 1, byte j of ggml's values j and j + 16:
    ggml_mxfp4_rows moves every code to its place and puts the scale first, so that ggml's decoder
    gives dequantize_mxfp4's floats bit for bit, over every byte value and scale the kernel takes."""
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0], blocks[0, 8], blocks[0, 15] = 0x21, 0x9C, 0x7F   # values 0, 1 | 16, 17 | 30, 31
    rows = torch.from_numpy(ggml_mxfp4_rows(blocks.numpy(), np.array([130], np.uint8)))
    want = torch.zeros(17, dtype=torch.uint8)
    want[0], want[1 + 0], want[1 + 1], want[1 + 14], want[1 + 15] = 130, 0xC1, 0x92, 0xF0, 0x70  # byte j: j, j + 16
    assert torch.equal(rows, want)
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 7, 16), dtype=torch.uint8, generator=gen)       # (E, N, G, 16)
    scales = torch.randint(1, 255, (3, 5, 7), dtype=torch.uint8, generator=gen)
    rows = torch.from_numpy(ggml_mxfp4_rows(blocks.numpy(), scales.numpy()))
    assert rows.shape == (3, 5, 7 * 17)
    assert torch.equal(dequantize_ggml_mxfp4(rows), dequantize_mxfp4(blocks, scales))
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        ggml_mxfp4_rows(blocks.numpy(), scales[..., :6].numpy())


@pytest.fixture(scope="module")
def mxfp4_dirs(tiny_gpt_oss, tmp_path_factory) -> tuple:
    """The tiny model with its expert matrices as a released checkpoint has them (MXFP4 blocks and
    scales in the (out, in) layout, quantization_config mxfp4), and as a float checkpoint holding
    the values those codes decode to: (float directory, MXFP4 directory, the decoded tensors)."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors = load_file(str(tiny_gpt_oss / "model.safetensors"))
    fused = ("experts.gate_up_proj", "experts.down_proj")
    decoded, quantized = dict(tensors), {k: v for k, v in tensors.items() if not k.endswith(fused)}
    for name, tensor in tensors.items():
        if name.endswith(fused):
            blocks, scales = to_mxfp4(tensor.transpose(1, 2))                  # (E, out, in / 32, 16)
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            decoded[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
            assert rel_err(decoded[name], tensor) < 0.2                      # 4-bit codes of the same weights
    float_dir, fp4_dir = copy_model(tiny_gpt_oss, root / "float"), copy_model(tiny_gpt_oss, root / "fp4")
    save_file(decoded, str(float_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(quantized, str(fp4_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp4_dir / "config.json").read_text())
    (fp4_dir / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    return float_dir, fp4_dir, decoded


def test_mxfp4_experts_load_as_the_weights_their_blocks_encode(mxfp4_dirs):
    """Decoded at load (the torch path), the MXFP4 directory's experts are the float checkpoint's
    values, every parameter equal; transformers, loading the MXFP4 directory itself (dequantized,
    without Triton), holds those values too and generates as we do on the CPU kernels' path."""
    float_dir, fp4_dir, decoded = mxfp4_dirs
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


def needs_block_formats():
    kernels = load_cpu_kernels(required=False)
    if kernels is None or not kernels.block_formats:
        pytest.skip("needs the C++ kernels with AVX2")


def test_mxfp4_experts_stay_in_mxf_panels_and_give_the_decoded_models_logits_bit_for_bit(mxfp4_dirs):
    """On the CPU kernels' path every expert's gate_up and down are packed from the checkpoint's
    blocks (format MXF, biases beside them; the router in float32 panels), the blocks never read
    as weights; over a prompt in chunks and decodes the logits equal, bit for bit, those of the
    same directory with its experts decoded to float32 (gguf_blocks off), and transformers'."""
    needs_block_formats()
    fp4_dir, cpu = mxfp4_dirs[1], torch.device("cpu")
    checkpoint = open_checkpoint(fp4_dir)
    blocks = checkpoint.weight_blocks(load_cpu_kernels(required=True))
    assert len(blocks) == 3 * 6 * 3 and {m.kind for m in blocks.values()} == {"MXFP4"}
    gate = blocks["model.layers.2.mlp.experts.5.gate_proj.weight"]
    assert (gate.rows, gate.cols, tuple(gate.read().shape)) == (64, 64, (64, 2 * 17))
    assert not {name for name, _ in checkpoint.weights(frozenset(blocks))} & set(blocks)
    panels = load_model(checkpoint, 256, torch.float32, cpu, kernels="auto")
    floats = load_model(checkpoint, 256, torch.float32, cpu, kernels="auto", gguf_blocks=False)
    for layer, float_layer in zip(panels.layers, floats.layers):
        assert layer.mlp.gate.format == 0
        for e in range(6):
            for name in ("gate_up_proj", "down_proj"):
                projection = getattr(layer.mlp.experts[e], name)
                assert projection.format == BLOCK_FORMATS["MXFP4"] and projection.panels.dtype == torch.uint8, name
                assert torch.equal(projection.bias, getattr(float_layer.mlp.experts[e], name).bias), name
                assert getattr(float_layer.mlp.experts[e], name).format == 0
    backend = make_backend("auto", cpu, 16, checkpoint.config.head_dim)
    tokens = [random.Random(3).randrange(2, 384) for _ in range(40)]
    steps = ((0, 20), (20, 37), (37, 38), (38, 39), (39, 40))
    got = stepwise_logits(panels, checkpoint.config, backend, tokens, 37, steps)
    assert torch.equal(got, stepwise_logits(floats, checkpoint.config, backend, tokens, 37, steps))
    with torch.no_grad():
        ref = hf_eager(fp4_dir)(torch.tensor([tokens])).logits[0]
    assert rel_err(got, ref) <= 1e-4, f"{rel_err(got, ref):.2e}"


def test_greedy_output_with_the_mxf_panels_is_the_decoded_models(mxfp4_dirs):
    needs_block_formats()
    fp4_dir = str(mxfp4_dirs[1])
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(n)]} for n in (4, 33)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    outs = [[o.outputs[0].token_ids for o in LLM(fp4_dir, num_kv_blocks=16, gguf_blocks=blocks).generate(
        prompts, params, use_tqdm=False)] for blocks in (True, False)]
    assert outs[0] == outs[1] and sum(len(set(t)) for t in outs[0]) > 6


def test_an_mxfp4_scale_the_kernel_cannot_decode_is_refused_naming_the_expert(mxfp4_dirs, tmp_path):
    needs_block_formats()
    path = copy_model(mxfp4_dirs[1], tmp_path / "nan_scale")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.down_proj_scales"][4, 7, 1] = 255       # E8M0's NaN
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.4.down_proj.weight: an MXFP4 block's scale "
                                         r"byte is 255"):
        load_model(open_checkpoint(path), 64, torch.float32, torch.device("cpu"), kernels="auto")


def test_mxfp4_experts_of_another_shape_than_the_config_are_refused_naming_them(mxfp4_dirs, tmp_path):
    path = copy_model(mxfp4_dirs[1], tmp_path / "narrow", intermediate_size=32)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.down_proj: MXFP4 blocks \(6, 64, 2, 16\) "
                                         r"and scales \(6, 64, 2\), expected \(6, 64, 1, 16\)"):
        open_checkpoint(path).weight_blocks(None)


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
    with pytest.raises(ValueError, match="tensor_parallel_size 2: this gpt_oss model's attention sinks and o_proj"):
        LLM(str(tiny_gpt_oss), tensor_parallel_size=2)
