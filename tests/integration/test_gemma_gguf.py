"""Gemma 2 and Gemma 3 (text) from GGUF files written as llama.cpp's converter writes them
(conftest.write_gguf_from_hf: every norm's w as 1 + w, the tied head left out, the metadata of its
Gemma2Model and Gemma3Model) from tiny random-weight transformers models with 8-token windows:
Gemma 2 a sliding layer beside a global one, its soft caps read from the file; Gemma 3 five sliding
layers in six (llama.cpp's pattern), rotating with their own base (rope.freq_base_swa) beside a
global layer with linear rope scaling. The file has no query_pre_attn_scalar, which llama.cpp takes
to be head_dim, so these models have it so. transformers' eager attention, float32, is the oracle,
and the same model loaded from its Hugging Face directory gives the same tokens.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (
    assert_short_prompt_logits,
    build_tiny_model,
    greedy_in_16_token_chunks,
    hf_greedy,
    rel_err,
    stepwise_logits,
    write_gguf_from_hf,
)
from test_gemma import hf_eager as hf_model

from tokenmill import LLM, SamplingParams
from tokenmill.attention import make_backend
from tokenmill.chat import render_chat
from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.models.cpu_packing import GGUFEmbedding
from tokenmill.models.loader import load_model, load_tokenizer, open_checkpoint
from tokenmill.models.packed_linear import BLOCK_FORMATS, PackedLinear

ARCHS = ["gemma2", "gemma3_text"]
GGUF_SHAPES = {"gemma2": dict(query_pre_attn_scalar=32, sliding_window=8),
               "gemma3_text": dict(query_pre_attn_scalar=32, sliding_window=8, num_hidden_layers=6, layer_types=None)}
# what the file says, as tokenmill reads it: (layer windows, sliding layers' rope base, soft caps)
EXPECTED = {"gemma2": ((8, None), None, 2.0, 4.0),
            "gemma3_text": ((8, 8, 8, 8, 8, None), 100.0, None, None)}
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
            "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gemma_gguf")
    return {arch: build_tiny_model(root / arch, arch, **GGUF_SHAPES[arch]) for arch in ARCHS}


def gemma_vocabulary(end_of_turn: int | None = None, size: int = 384) -> list[str]:
    """A Gemma-like sentencepiece vocabulary: <pad>, <eos>, <bos>, <unk>, <start_of_turn> first,
    <end_of_turn> at `end_of_turn` (None: nowhere, so that only <eos> ends the output), letters and
    word pieces."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n", "▁"] + letters + [f"▁{c}" for c in letters]
    tokens += [f"x{i}" for i in range(size - len(tokens))]
    if end_of_turn is not None:
        tokens[end_of_turn] = "<end_of_turn>"
    return tokens


def written(hf_dir, path, qtype: str = "F32", end_of_turn: int | None = None):
    """The model in `hf_dir` written to the GGUF file `path` with gemma_vocabulary(end_of_turn) and
    TEMPLATE; the oracle holding the file's values."""
    model = hf_model(hf_dir)
    write_gguf_from_hf(model, path, qtype, tokens=gemma_vocabulary(end_of_turn), chat_template=TEMPLATE)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_an_f32_file_gives_transformers_logits_over_several_windows(gemma_dirs, tmp_path, arch):
    """A 40-token prompt (five windows) in chunks of 13, then a decode: every position's logits as
    transformers', by the torch ops and by the packed projections and C++ ops; the config as the
    metadata says, the norms' 1 + w taken as they are."""
    path = tmp_path / f"{arch}.gguf"
    oracle = written(gemma_dirs[arch], path)
    checkpoint = open_checkpoint(path)
    cfg = checkpoint.config
    assert (cfg.layer_windows, cfg.local_rope_theta, cfg.attn_softcap, cfg.final_softcap) == EXPECTED[arch]
    assert (cfg.architecture, cfg.query_pre_attn_scalar, cfg.tie_word_embeddings) == (arch, 32, True)
    rng = random.Random(arch)
    tokens = [rng.randrange(2, 384) for _ in range(41)]
    with torch.no_grad():
        ref = oracle(torch.tensor([tokens])).logits[0]
    for backend_name, kernels in (("reference", "torch"), ("auto", "auto")):
        model = load_model(checkpoint, 128, torch.float32, torch.device("cpu"), kernels=kernels)
        backend = make_backend(backend_name, torch.device("cpu"), 16, cfg.head_dim)
        got = stepwise_logits(model, cfg, backend, tokens, 40, ((0, 13), (13, 26), (26, 40), (40, 41)))
        assert rel_err(got, ref) <= 1e-4, f"{kernels}: {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_of_the_file_equal_the_hf_directorys_under_chunked_prefill(gemma_dirs, tmp_path, arch):
    """The default CPU path: prompts of up to nine windows in 16-token chunks, from the file and from
    the directory it was written from, token for token the same."""
    path = tmp_path / f"{arch}.gguf"
    written(gemma_dirs[arch], path)
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(n)]} for n in (3, 20, 45, 70)]
    outputs = {source: greedy_in_16_token_chunks(source, gemma_dirs[arch], prompts, 24)
               for source in (path, gemma_dirs[arch])}
    assert outputs[path] == outputs[gemma_dirs[arch]]
    assert sum(len(set(tokens)) for tokens in outputs[path]) > 3 * len(prompts)  # not one token repeated


@pytest.mark.parametrize("arch", ARCHS)
def test_a_q8_0_file_keeps_its_projections_in_blocks_and_gives_its_values_logits(gemma_dirs, tmp_path, arch):
    """Every projection packed from the file's Q8_0 blocks, the tied head from the embeddings' blocks
    and the embeddings looked up in the file's rows; the logits those of transformers holding the
    dequantized weights."""
    kernels = load_cpu_kernels(required=False)
    if kernels is None or not kernels.block_formats:
        pytest.skip("needs the C++ kernels with AVX2")
    path = tmp_path / f"{arch}.gguf"
    oracle = written(gemma_dirs[arch], path, "Q8_0")
    checkpoint = open_checkpoint(path)
    model = load_model(checkpoint, 128, torch.float32, torch.device("cpu"), kernels="auto")
    q8_0 = BLOCK_FORMATS["Q8_0"]
    for layer in model.layers:
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            projection = layer.get_submodule(name)
            assert isinstance(projection, PackedLinear) and projection.format == q8_0, name
    assert model.packed_lm_head.format == q8_0 and isinstance(model.embed_tokens, GGUFEmbedding)
    tokens = [random.Random(7).randrange(2, 384) for _ in range(30)]
    assert_short_prompt_logits(model, checkpoint.config, oracle, tokens)


def test_the_files_chat_template_renders_gemma_turns_and_end_of_turn_ends_generation(gemma_dirs, tmp_path):
    """The converter names only <eos> as the end of generation; <end_of_turn>, found in the
    vocabulary by its text as llama.cpp finds it, ends the output too. The tokenizer and its chat
    template come from the file's metadata."""
    hf_dir = gemma_dirs["gemma3_text"]
    prompt = [random.Random(6).randrange(7, 384) for _ in range(12)]
    free = hf_greedy(hf_model(hf_dir), prompt, 12)
    stop = next(i for i, t in enumerate(free) if i >= 2 and t >= 7 and t not in prompt and t not in free[:i])
    path = tmp_path / "it.gguf"
    written(hf_dir, path, end_of_turn=free[stop])
    assert open_checkpoint(path).config.eos_token_ids == (1, free[stop])
    llm = LLM(str(path), tokenizer=str(hf_dir), num_kv_blocks=8)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, temperature=0.0),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == free[:stop + 1]
    assert out.outputs[0].finish_reason == "stop"
    tokenizer = load_tokenizer(path, cache_dir=tmp_path / "cache")
    assert tokenizer.chat_template == TEMPLATE
    rendered = render_chat(tokenizer, [{"role": "user", "content": "hi"}])
    assert rendered["prompt"] == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    ids = rendered["prompt_token_ids"]
    assert (ids[:2], ids.count(4), ids.count(free[stop])) == ([2, 4], 2, 1)
