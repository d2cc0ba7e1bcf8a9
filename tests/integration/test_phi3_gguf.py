"""Phi-3 and Phi-4-mini from GGUF files written as llama.cpp's converter writes them
(conftest.write_gguf_from_hf: Phi3MiniModel's metadata, the fused attn_qkv and ffn_up, LongRoPE's
factors as tensors) from tiny random-weight transformers models: Phi-3-mini-4k's shape (a window on
every layer, no rope scaling), Phi-3-128k's (LongRoPE) and Phi-4-mini's (LongRoPE over 3/4 of each
head, tied embeddings, no window). The file reads as its Hugging Face directory's config; its
logits are transformers' (eager, float32) inside the original context, and the directory's past
it, where transformers moves every position of a sequence to the long factors and tokenmill only
the positions past the original context (llama.longrope_angles).
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import (
    assert_short_prompt_logits,
    build_tiny_model,
    greedy_in_16_token_chunks,
    stepwise_logits,
    write_gguf_from_hf,
)
from test_gemma import hf_greedy, hf_model, rel_err
from test_gemma_gguf import gemma_vocabulary

from tokenmill import LLM, SamplingParams
from tokenmill.attention import make_backend
from tokenmill.chat import render_chat
from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.models.cpu_packing import GGUFEmbedding
from tokenmill.models.loader import Checkpoint, hf_model_config, load_model, load_tokenizer, open_checkpoint
from tokenmill.models.packed_linear import BLOCK_FORMATS, PackedLinear
from tokenmill.models.parallel import RowParallel, TPShard

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ORIGINAL = 32  # the original context of the LongRoPE variants, of 128 positions


def longrope(pairs: int) -> dict:
    """LongRoPE scaling with factors that float32 holds exactly, as the file stores them."""
    return {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
            "short_factor": [1 + k / 8 for k in range(pairs)], "long_factor": [2 + k / 4 for k in range(pairs)]}


# hidden 96, 6 heads of 16 dims, 2 kv heads
VARIANTS = {
    "phi3_mini_4k": dict(sliding_window=16, max_position_embeddings=128),
    "phi3_128k": dict(max_position_embeddings=128, original_max_position_embeddings=ORIGINAL, rope_scaling=longrope(8)),
    "phi4_mini": dict(max_position_embeddings=128, original_max_position_embeddings=ORIGINAL, rope_scaling=longrope(6),
                      partial_rotary_factor=0.75, tie_word_embeddings=True),
}
# what the file says, as tokenmill reads it: (rotary dims, layer windows, tied)
EXPECTED = {"phi3_mini_4k": (None, (16, 16), False), "phi3_128k": (None, (), False), "phi4_mini": (12, (), True)}


@pytest.fixture(scope="module")
def phi3_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("phi3_gguf")
    return {name: build_tiny_model(root / name, "phi3", **shape) for name, shape in VARIANTS.items()}


def written(hf_dir, path, qtype: str = "F32"):
    """The model in `hf_dir` written to the GGUF file `path`; the oracle holding the file's values."""
    model = hf_model(hf_dir)
    write_gguf_from_hf(model, path, qtype)
    return model


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 384) for _ in range(n)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_f32_file_reads_as_its_directory_and_gives_transformers_logits(phi3_dirs, tmp_path, variant):
    """The file's config is its directory's (rope scaling with every factor, rotary dims, windows);
    a 30-token prompt (inside the original context, two windows) in chunks, then a decode: every
    position's logits as transformers', by the torch ops and by the packed projections and C++ ops."""
    path = tmp_path / f"{variant}.gguf"
    oracle = written(phi3_dirs[variant], path)
    checkpoint = open_checkpoint(path)
    cfg, hf = checkpoint.config, hf_model_config(phi3_dirs[variant])
    assert (cfg.rotary_dim, cfg.layer_windows, cfg.tie_word_embeddings) == EXPECTED[variant]
    for field in ("architecture", "head_dim", "rotary_dim", "rope_theta", "layer_windows",
                  "max_position_embeddings", "intermediate_size", "num_kv_heads", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(hf, field), field
    # transformers 5's rope_parameters also carry the base and the rotary fraction, read apart
    hf_scaling = {k: v for k, v in (hf.rope_scaling or {}).items() if k not in ("rope_theta", "partial_rotary_factor")}
    assert (cfg.rope_scaling or {}) == hf_scaling
    tokens = prompt(31)
    with torch.no_grad():
        ref = oracle(torch.tensor([tokens])).logits[0]
    for backend_name, kernels in (("reference", "torch"), ("auto", "auto")):
        model = load_model(checkpoint, 128, torch.float32, torch.device("cpu"), kernels=kernels)
        backend = make_backend(backend_name, torch.device("cpu"), 16, cfg.head_dim)
        got = stepwise_logits(model, cfg, backend, tokens, 30, ((0, 13), (13, 30), (30, 31)))
        assert rel_err(got, ref) <= 1e-4, f"{kernels}: {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("variant", ["phi3_128k", "phi4_mini"])
def test_past_the_original_context_the_file_gives_its_directorys_logits(phi3_dirs, tmp_path, variant):
    """A 90-token prompt, 58 of it past the original context where the long factors turn, then
    decodes: the file's logits are the directory's, and not those of the short factors alone."""
    path = tmp_path / f"{variant}.gguf"
    written(phi3_dirs[variant], path)
    tokens, steps = prompt(92, 1), ((0, 40), (40, 90), (90, 91), (91, 92))
    checkpoint = open_checkpoint(path)
    scaling = checkpoint.config.rope_scaling
    short_only = replace(checkpoint.config, rope_scaling={**scaling, "long_factor": scaling["short_factor"]})
    logits = {}
    for name, source in (("file", checkpoint), ("directory", open_checkpoint(phi3_dirs[variant])),
                         ("short factors", Checkpoint(path, short_only, checkpoint.gguf_reader))):
        model = load_model(source, 128, torch.float32, torch.device("cpu"), kernels="torch")
        backend = make_backend("reference", torch.device("cpu"), 16, source.config.head_dim)
        logits[name] = stepwise_logits(model, source.config, backend, tokens, 90, steps)
    assert rel_err(logits["file"], logits["directory"]) <= 1e-6
    assert torch.equal(logits["file"][:ORIGINAL], logits["short factors"][:ORIGINAL])
    assert rel_err(logits["file"][ORIGINAL:], logits["short factors"][ORIGINAL:]) > 1e-2
    with torch.no_grad():  # transformers inside the original context: the short factors
        short = hf_model(phi3_dirs[variant])(torch.tensor([tokens[:ORIGINAL]])).logits[0]
    assert rel_err(logits["file"][:ORIGINAL], short) <= 1e-4


@pytest.mark.parametrize("variant", ["phi3_mini_4k", "phi4_mini"])
def test_greedy_tokens_of_the_file_equal_the_directorys_under_chunked_prefill(phi3_dirs, tmp_path, variant):
    """The default CPU path: prompts past the window and the original context in 16-token chunks,
    from the file and from the directory it was written from, token for token the same."""
    path = tmp_path / f"{variant}.gguf"
    written(phi3_dirs[variant], path)
    prompts = [{"prompt_token_ids": prompt(n, n)} for n in (3, 20, 45, 70)]
    outputs = {source: greedy_in_16_token_chunks(source, phi3_dirs[variant], prompts, 32)
               for source in (path, phi3_dirs[variant])}
    assert outputs[path] == outputs[phi3_dirs[variant]]
    assert sum(len(set(tokens)) for tokens in outputs[path]) > 3 * len(prompts)  # not one token repeated


# Phi-4-mini's shape at hidden 256 (4 heads of 64 dims, 48 of them rotating), for the K-quants'
# super-blocks of 256 weights
K_QUANT_SHAPE = dict(VARIANTS["phi4_mini"], hidden_size=256, intermediate_size=256, num_attention_heads=4,
                     rope_scaling=longrope(24))


def quantized_file(phi3_dirs, tmp_path, qtype: str):
    """Phi-4-mini's shape in `qtype` (Q8_0; Q4_K at K_QUANT_SHAPE), and its oracle; skipped without
    the C++ kernels' block formats."""
    kernels = load_cpu_kernels(required=False)
    if kernels is None or not kernels.block_formats:
        pytest.skip("needs the C++ kernels with AVX2")
    hf_dir = (phi3_dirs["phi4_mini"] if qtype == "Q8_0" else
              build_tiny_model(tmp_path / "phi4_mini_256", "phi3", **K_QUANT_SHAPE))
    path = tmp_path / f"phi4_mini_{qtype}.gguf"
    return path, written(hf_dir, path, qtype)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_a_quantized_file_keeps_its_fused_projections_in_blocks_and_gives_its_values_logits(
        phi3_dirs, tmp_path, qtype):
    """q, k and v cut from attn_qkv's blocks, gate and up from ffn_up's, q and k rows reordered for
    the partial rotary: every projection packed from the file's blocks (Q4_K re-cut), the tied head
    from the embeddings' blocks and the embeddings looked up in the file's rows; the logits those
    of transformers holding the dequantized weights."""
    path, oracle = quantized_file(phi3_dirs, tmp_path, qtype)
    checkpoint = open_checkpoint(path)
    model = load_model(checkpoint, 128, torch.float32, torch.device("cpu"), kernels="auto")
    blocks = BLOCK_FORMATS[qtype]
    for layer in model.layers:
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            projection = layer.get_submodule(name)
            assert isinstance(projection, PackedLinear) and projection.format == blocks, name
    assert model.packed_lm_head.format == blocks and isinstance(model.embed_tokens, GGUFEmbedding)
    assert_short_prompt_logits(model, checkpoint.config, oracle, prompt(30, 7))


def test_a_tensor_parallel_ranks_blocks_of_the_fused_projections_are_its_shard(phi3_dirs, tmp_path):
    """Each of 2 ranks keeps its 3 q heads, 1 k and 1 v head and its half of gate and up in the
    file's Q8_0 blocks, giving what its float32 shard gives, bit for bit."""
    path, _ = quantized_file(phi3_dirs, tmp_path, "Q8_0")
    cpu, q8_0 = torch.device("cpu"), BLOCK_FORMATS["Q8_0"]
    for rank in (0, 1):
        shard = TPShard(rank, 2)
        blocks = load_model(open_checkpoint(path), 64, torch.float32, cpu, "auto", True, 0, shard, lambda t: t)
        floats = load_model(open_checkpoint(path), 64, torch.float32, cpu, "auto", False, 0, shard, lambda t: t)
        for name in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj", "self_attn.o_proj"):
            ours, reference = blocks.layers[1].get_submodule(name), floats.layers[1].get_submodule(name)
            if isinstance(ours, RowParallel):
                ours, reference = ours.inner, reference.inner
            assert reference.format == 0 and (ours.out_features, ours.in_features) == (
                reference.out_features, reference.in_features)
            if name != "self_attn.o_proj":  # o_proj's 48 input columns a rank cut its 32-weight blocks
                assert isinstance(ours, PackedLinear) and ours.format == q8_0, name
            x = torch.randn(7, ours.in_features)
            assert torch.equal(ours(x), reference(x)), name
        assert blocks.layers[0].self_attn.qkv_proj.out_features == (3 + 1 + 1) * 16


def test_the_files_chat_template_renders_phi_turns_and_end_ends_generation(phi3_dirs, tmp_path):
    """The file names <eos> as its end; <|end|>, which ends Phi's turns, found in the vocabulary by
    its text as llama.cpp finds it, ends the output too. The tokenizer and its chat template come
    from the file's metadata."""
    hf_dir = phi3_dirs["phi3_mini_4k"]
    tokens = prompt(12, 6)
    free = hf_greedy(hf_model(hf_dir), tokens, 12)
    stop = next(i for i, t in enumerate(free) if i >= 2 and t >= 7 and t not in tokens and t not in free[:i])
    vocabulary = gemma_vocabulary()
    vocabulary[free[stop]] = "<|end|>"
    path = tmp_path / "instruct.gguf"
    write_gguf_from_hf(hf_model(hf_dir), path, tokens=vocabulary, chat_template=TEMPLATE)
    assert open_checkpoint(path).config.eos_token_ids == (1, free[stop])
    llm = LLM(str(path), tokenizer=str(hf_dir), num_kv_blocks=8)
    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=12, temperature=0.0),
                       use_tqdm=False)[0]
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (free[:stop + 1], "stop")
    tokenizer = load_tokenizer(path, cache_dir=tmp_path / "cache")
    assert tokenizer.chat_template == TEMPLATE
    rendered = render_chat(tokenizer, [{"role": "user", "content": "hi"}])
    assert rendered["prompt"] == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert rendered["prompt_token_ids"].count(free[stop]) == 1


def test_unsupported_phi3_files_are_refused_by_name(phi3_dirs, tmp_path):
    """Rope factors of the wrong length, one set of them alone, experts in a phi3 file, and partial
    rotary in an architecture that is read without it: ValueErrors naming what is wrong."""
    from gguf import GGUFReader, GGUFWriter

    from tokenmill.models.gguf_loader import gguf_model_config
    path = tmp_path / "phi4.gguf"
    written(phi3_dirs["phi4_mini"], path)
    reader = GGUFReader(str(path))

    def rewritten(name: str, fields: dict, drop: tuple[str, ...] = (), arch: str = "phi3", factors=None):
        """The file with metadata `fields` added, tensors `drop` left out, its factors replaced."""
        out = tmp_path / f"{name}.gguf"
        w = GGUFWriter(str(out), arch)
        for key, value in fields.items():
            w.add_uint32(key, value)
        for field in reader.fields.values():
            if field.name.startswith("phi3.") and field.name not in fields:
                key = field.name.replace("phi3.", f"{arch}.", 1)
                w.add_key_value(key, field.contents(), field.types[0])
        for t in reader.tensors:
            if t.name in drop:
                continue
            data = factors if factors is not None and t.name.startswith("rope_factors_") else np.asarray(t.data)
            w.add_tensor(t.name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return GGUFReader(str(out))

    cases = [
        (rewritten("short", {}, factors=np.ones(5, np.float32)), "5 long and 5 short for 6 rotary frequencies"),
        (rewritten("alone", {}, drop=("rope_factors_short.weight",)), "rope factors rope_factors_long.weight"),
        (rewritten("experts", {"phi3.expert_count": 4}), "unsupported GGUF phi3 variant: expert_count 4"),
        (rewritten("qwen2", {}, arch="qwen2"), "rope.dimension_count 12 of head_dim 16"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            gguf_model_config(bad)
