"""gpt-oss from GGUF files written as llama.cpp's converter writes them (conftest.write_gguf_from_hf:
GptOssModel's metadata, gate_up de-interleaved into ffn_gate_exps and ffn_up_exps, down transposed,
biases per expert, sinks as attn_sinks.weight) from a tiny random-weight transformers model: three
layers (sliding, full, sliding, a window of 12 tokens), sinks drawn large enough to matter, six
experts whose clamped SwiGLU bites at llama.cpp's limit of 7, YaRN rope. The experts in float32 or
in MXFP4 (quantize_mxfp4, ggml's block layout), the other matrices in float32 or Q8_0; the oracle is
transformers (eager attention, float32) holding the values the file holds.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import (
    assert_short_prompt_logits,
    hf_greedy,
    rel_err,
    stepwise_logits,
    write_gguf_from_hf,
)
from test_gemma_gguf import gemma_vocabulary
from test_gpt_oss import TINY_GPT_OSS, hf_eager, save_tiny_gpt_oss

from tokenmill import LLM, SamplingParams
from tokenmill.attention import make_backend
from tokenmill.chat import render_chat
from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.models.cpu_packing import GGUFEmbedding
from tokenmill.models.gguf_loader import check_mxfp4_scales
from tokenmill.models.gpt_oss import dequantize_ggml_mxfp4
from tokenmill.models.loader import hf_model_config, load_model, load_tokenizer, open_checkpoint
from tokenmill.models.moe import ClampedSwiGLU, SparseMoeBlock
from tokenmill.models.packed_linear import BLOCK_FORMATS, PackedLinear

# the HF tests' shape, with transformers' default swiglu_limit (7, a constant in llama.cpp) and
# weights large enough for it to bite
SHAPE = {**TINY_GPT_OSS, "swiglu_limit": 7.0, "initializer_range": 0.4}
# (matrices, experts) of each file
VARIANTS = {"f32": ("F32", "F32"), "mxfp4": ("F32", "MXFP4"), "q8_0_mxfp4": ("Q8_0", "MXFP4"),
            "q8_0": ("Q8_0", "Q8_0")}
TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss_gguf") / "gpt_oss", SHAPE)


@pytest.fixture(scope="module")
def files(gpt_oss_dir, tmp_path_factory) -> dict:
    """Each variant's file and its oracle, written once."""
    root = tmp_path_factory.mktemp("gpt_oss_files")
    out = {}
    for name, (qtype, expert_qtype) in VARIANTS.items():
        oracle = hf_eager(gpt_oss_dir)
        write_gguf_from_hf(oracle, root / f"{name}.gguf", qtype, expert_qtype=expert_qtype)
        out[name] = root / f"{name}.gguf", oracle
    return out


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 384) for _ in range(n)]


def test_an_mxfp4_block_decodes_low_nibbles_first_then_high_times_the_scale():
    """ggml's block_mxfp4: a scale byte, then byte j's low nibble is value j, its high nibble value
    j + 16; FP4 E2M1 codes times 2^(scale - 127), down to scale 0's 2^-127."""
    rows = np.zeros((1, 3 * 17), np.uint8)                             # a row of three blocks
    rows[0, 0], rows[0, 1], rows[0, 16] = 129, 0x21, 0xF7              # scale 2^2; values 0, 16 | 15, 31
    rows[0, 17], rows[0, 17 + 1 + 3] = 120, 0x0F                       # scale 2^-7; value 3 | 19
    rows[0, 34], rows[0, 34 + 1 + 8] = 0, 0x9A                         # scale 2^-127; value 8 | 24
    values = dequantize_ggml_mxfp4(torch.from_numpy(rows))
    assert values.shape == (1, 96) and values.dtype == torch.float32
    want = torch.zeros(96)
    want[0], want[16], want[15], want[31] = 0.5 * 4, 1.0 * 4, 6.0 * 4, -6.0 * 4
    want[32 + 3] = -6.0 * 2.0 ** -7
    want[64 + 8], want[64 + 24] = -1.0 * 2.0 ** -127, -0.5 * 2.0 ** -127
    assert torch.equal(values[0], want)
    with pytest.raises(ValueError, match="MXFP4 rows"):
        dequantize_ggml_mxfp4(torch.zeros(1, 16, dtype=torch.uint8))


def test_mxfp4_scales_the_kernel_cannot_decode_are_refused_naming_the_tensor():
    """The kernel's scale is the float whose bits are e << 23: a block of zeros may have e = 0, a
    block with a nonzero value may not (its values are below float32's normal range), nor any
    block e = 255 (E8M0's NaN)."""
    rows = np.zeros((2, 3 * 17), dtype=np.uint8)
    rows[:, 17 * 1] = 127
    rows[0, 17 * 1 + 5] = 0x9A                   # values -1.0 and 0.5 in a block of scale 2^0
    rows[1, 17 * 2 + 3] = 0x08                   # -0.0 in a block of scale byte 0: still zeros
    check_mxfp4_scales(rows, "blk.0.ffn_up_exps.weight")
    rows[1, 17 * 2 + 3] = 0x01                   # 0.5 in it
    with pytest.raises(ValueError, match=r"blk.0.ffn_up_exps.weight: an MXFP4 block's scale byte is 0"):
        check_mxfp4_scales(rows, "blk.0.ffn_up_exps.weight")
    rows[1, 17 * 2 + 3], rows[0, 0] = 0, 255
    with pytest.raises(ValueError, match="scale byte is 255"):
        check_mxfp4_scales(rows, "blk.0.ffn_up_exps.weight")


def test_mxfp4_experts_load_as_exactly_the_values_their_codes_encode(files):
    """Every expert's gate, up and down matrices and biases, decoded from the file's MXFP4 blocks
    (gate and up from their own tensors), equal the values quantize_mxfp4 chose, bit for bit."""
    path, oracle = files["mxfp4"]
    model = load_model(open_checkpoint(path), 64, torch.float32, torch.device("cpu"), kernels="torch")
    for ours, theirs in zip(model.layers, oracle.model.layers):
        experts = theirs.mlp.experts
        for e, expert in enumerate(ours.mlp.experts):
            gate_up = experts.gate_up_proj[e].T                                  # (2I, hidden), alternating rows
            assert torch.equal(expert.gate_up_proj.weight, torch.cat([gate_up[0::2], gate_up[1::2]]))
            assert torch.equal(expert.down_proj.weight, experts.down_proj[e].T)
            bias = experts.gate_up_proj_bias[e]
            assert torch.equal(expert.gate_up_proj.bias, torch.cat([bias[0::2], bias[1::2]]))
            assert torch.equal(expert.down_proj.bias, experts.down_proj_bias[e])


def test_the_files_config_is_its_directorys(gpt_oss_dir, files):
    """Every field the model runs by, as the Hugging Face directory gives it: the even layers
    sliding, sinks and biases, the experts (router bias, softmax over the top 2, the clamp at 7),
    YaRN without truncation; the experts' widths read from their tensors. The clamp at 7 (not in
    the file) bites in this model: transformers' logits move with it out of reach."""
    cfg, hf = open_checkpoint(files["mxfp4"][0]).config, hf_model_config(gpt_oss_dir)
    assert cfg.layer_windows == (12, None, 12) and cfg.rope_scaling["truncate"] is False
    for field in ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rotary_dim", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings", "attention_bias", "o_proj_bias", "attention_sinks", "layer_windows", "moe",
                  "attention_scale"):
        assert getattr(cfg, field) == getattr(hf, field), field
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)  # float32 in the file
    # transformers 5's rope_parameters also carry the base, read apart
    assert cfg.rope_scaling == {k: v for k, v in hf.rope_scaling.items() if k != "rope_theta"}
    assert cfg.moe.swiglu_limit == 7.0
    tokens = torch.tensor([prompt(73, 1)])
    with torch.no_grad():
        clamped, unclamped = (hf_eager(gpt_oss_dir, swiglu_limit=limit)(tokens).logits[0] for limit in (7.0, 1000.0))
    assert rel_err(unclamped, clamped) > 1e-2


@pytest.mark.parametrize("variant", ["f32", "mxfp4"])
def test_logits_over_several_windows_are_transformers(files, variant):
    """A 70-token prompt (about six windows) in chunks of 30, 25 and 15, then decodes: every
    position's logits as transformers', by the torch ops and by the packed projections and C++
    attention (MXFP4 experts, decoded at load, by the latter); the experts ClampedSwiGLU with
    their biases."""
    path, oracle = files[variant]
    checkpoint = open_checkpoint(path)
    tokens = prompt(73, 1)
    with torch.no_grad():
        ref = oracle(torch.tensor([tokens])).logits[0]
    for backend_name, kernels in (("reference", "torch"), ("auto", "auto"))[0 if variant == "f32" else 1:]:
        model = load_model(checkpoint, 256, torch.float32, torch.device("cpu"), kernels=kernels)
        block = model.layers[0].mlp
        assert isinstance(block, SparseMoeBlock) and all(isinstance(e, ClampedSwiGLU) for e in block.experts)
        backend = make_backend(backend_name, torch.device("cpu"), 16, checkpoint.config.head_dim)
        got = stepwise_logits(model, checkpoint.config, backend, tokens, 70,
                              ((0, 30), (30, 55), (55, 70), (70, 71), (71, 72), (72, 73)))
        assert rel_err(got, ref) <= 1e-4, f"{kernels}: {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("variant", ["f32", "mxfp4"])
def test_greedy_tokens_under_chunked_prefill_are_transformers(files, gpt_oss_dir, variant):
    """The default CPU path, prompts of up to six windows in 16-token chunks, four at a time:
    every output as transformers' generate."""
    path, oracle = files[variant]
    prompts = [prompt(n, n) for n in (3, 20, 45, 70)]
    llm = LLM(str(path), tokenizer=str(gpt_oss_dir), max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=24,
              dtype="float32", block_size=16, long_prefill_token_threshold=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, temperature=0.0),
                        use_tqdm=False)
    assert sum(len(set(out.outputs[0].token_ids)) for out in outs) > 3 * len(outs)  # not one token repeated
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(oracle, p, 12), f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("variant", ["q8_0_mxfp4", "q8_0"])
@pytest.mark.parametrize("gguf_blocks", [True, False])
def test_a_q8_0_file_gives_its_values_logits_with_and_without_its_blocks(files, variant, gguf_blocks):
    """Attention, head and embeddings in Q8_0 (the experts too, or MXFP4): with gguf_blocks, each
    Q8_0 projection packed from the file's blocks (MXFP4 experts from theirs), its bias beside it,
    and the embeddings looked up in the file's rows; without, every matrix in float32. Either way
    the logits are transformers' holding the file's values."""
    kernels = load_cpu_kernels(required=False)
    if kernels is None or not kernels.block_formats:
        pytest.skip("needs the C++ kernels with AVX2")
    path, oracle = files[variant]
    checkpoint = open_checkpoint(path)
    model = load_model(checkpoint, 128, torch.float32, torch.device("cpu"), "auto", gguf_blocks)
    q8_0 = BLOCK_FORMATS["Q8_0"] if gguf_blocks else 0
    experts = BLOCK_FORMATS["MXFP4" if variant == "q8_0_mxfp4" else "Q8_0"] if gguf_blocks else 0
    for layer in model.layers:
        for name, format in (("self_attn.qkv_proj", q8_0), ("self_attn.o_proj", q8_0), ("mlp.gate", 0),
                             ("mlp.experts.5.gate_up_proj", experts), ("mlp.experts.5.down_proj", experts)):
            projection = layer.get_submodule(name)
            assert isinstance(projection, PackedLinear) and projection.format == format, name
            assert projection.bias is not None, name
    assert model.packed_lm_head.format == q8_0 and isinstance(model.embed_tokens, GGUFEmbedding) == gguf_blocks
    assert_short_prompt_logits(model, checkpoint.config, oracle, prompt(30, 7))


def test_return_call_and_endoftext_end_generation_and_end_does_not(gpt_oss_dir, tmp_path):
    """Harmony's <|return|>, <|call|> and <|endoftext|>, found in the vocabulary by their text, end
    the output; <|end|>, which ends a message, does not, even named as the file's end of turn (as
    llama.cpp drops it). The tokenizer and its chat template come from the file's metadata."""
    oracle = hf_eager(gpt_oss_dir)
    tokens = prompt(12, 6)
    free = hf_greedy(oracle, tokens, 12)
    stop = next(i for i, t in enumerate(free) if i >= 2 and t >= 12 and t not in tokens and t not in free[:i])
    vocabulary = gemma_vocabulary()
    ids = {"<|call|>": 7, "<|end|>": 8, "<|endoftext|>": 9, "<|start|>": 10, "<|message|>": 11}
    for text, token in {**ids, "<|return|>": free[stop]}.items():
        vocabulary[token] = text
    path = tmp_path / "harmony.gguf"
    write_gguf_from_hf(oracle, path, tokens=vocabulary, chat_template=TEMPLATE, token_ids={"eot": 8})
    assert open_checkpoint(path).config.eos_token_ids == (1, 7, 9, free[stop])  # vocabulary order
    llm = LLM(str(path), tokenizer=str(gpt_oss_dir), num_kv_blocks=8)
    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=12, temperature=0.0),
                       use_tqdm=False)[0]
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (free[:stop + 1], "stop")
    tokenizer = load_tokenizer(path, cache_dir=tmp_path / "cache")
    assert tokenizer.chat_template == TEMPLATE
    rendered = render_chat(tokenizer, [{"role": "user", "content": "hi"}])
    assert rendered["prompt"] == "<|start|>user<|message|>hi<|end|><|start|>assistant"
    assert [rendered["prompt_token_ids"].count(t) for t in (10, 11, 8)] == [2, 1, 1]


def rewritten(src, out, fields: dict | None = None, drop: tuple[str, ...] = (), raw: dict | None = None,
              renamed: dict | None = None):
    """A float32 gpt-oss file `src` written again to `out`: its gpt-oss. metadata with `fields`
    (name -> uint32 or float32, or None: left out) set, tensors `drop` left out, `raw` (name ->
    (bytes, type name)) in place of those tensors, `renamed` (name -> new name) written as named."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    reader, fields, raw = GGUFReader(str(src)), fields or {}, raw or {}
    w = GGUFWriter(str(out), "gpt-oss")
    for field in reader.fields.values():
        if field.name.startswith("gpt-oss.") and field.name not in fields:
            w.add_key_value(field.name, field.contents(), field.types[0])
    for key, value in fields.items():
        if value is not None:
            w.add_key_value(key, value, GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32)
    for t in reader.tensors:
        if t.name in raw:
            w.add_tensor(t.name, raw[t.name][0], raw_dtype=GGMLQuantizationType[raw[t.name][1]])
        elif t.name not in drop:
            w.add_tensor((renamed or {}).get(t.name, t.name), np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_unsupported_gpt_oss_files_are_refused_by_name(files, tmp_path):
    """Sliding layers with a rope base of their own or without a window, q/k/v without biases, a
    tensor of a name not read here (a fused attn_qkv), experts in a type nothing here decodes
    (Q8_1), and tensor parallelism (the sinks and o_proj bias are not split): ValueErrors naming
    what is wrong, where the file as written loads."""
    src = files["f32"][0]
    assert open_checkpoint(src).config.architecture == "gpt_oss"
    swa = rewritten(src, tmp_path / "swa.gguf", {"gpt-oss.rope.freq_base_swa": 10000.0})
    with pytest.raises(ValueError, match="rope.freq_base_swa 10000.0 beside rope.freq_base 50000.0"):
        open_checkpoint(swa)
    with pytest.raises(ValueError, match="without attention.sliding_window"):
        open_checkpoint(rewritten(src, tmp_path / "no_window.gguf", {"gpt-oss.attention.sliding_window": None}))
    biases = tuple(f"blk.{i}.attn_{p}.bias" for i in range(3) for p in "qkv")
    with pytest.raises(ValueError, match="unsupported gpt_oss variant: attention_bias = False"):
        open_checkpoint(rewritten(src, tmp_path / "no_bias.gguf", drop=biases))
    fused = {"blk.0.attn_q.weight": "blk.0.attn_qkv.weight"}
    with pytest.raises(ValueError, match="unsupported GGUF tensor blk.0.attn_qkv.weight in a gpt_oss file"):
        load_model(open_checkpoint(rewritten(src, tmp_path / "qkv.gguf", renamed=fused)), 64, torch.float32,
                   torch.device("cpu"), kernels="torch")
    q8_1 = np.zeros((6, 64, 2 * 40), np.uint8)                         # (E, I, hidden / 32 blocks of 40 bytes)
    bad = open_checkpoint(rewritten(src, tmp_path / "q8_1.gguf", raw={"blk.0.ffn_gate_exps.weight": (q8_1, "Q8_1")}))
    with pytest.raises(ValueError, match="unsupported GGUF tensor type Q8_1 of blk.0.ffn_gate_exps.weight"):
        load_model(bad, 64, torch.float32, torch.device("cpu"), kernels="torch")
    with pytest.raises(ValueError, match="tensor_parallel_size 2: this gpt_oss model's attention sinks and o_proj"):
        LLM(str(src), tensor_parallel_size=2)
