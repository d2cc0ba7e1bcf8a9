"""The GGUF loader with projections kept in their blocks, on tiny files written here: which
projections keep blocks, that their float32 copies are never loaded, and that every projection
gives what the same model loaded as float32 panels (gguf_blocks=False) gives, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import copy_model, random_k_quant_rows, write_gguf_from_hf

from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.models.cpu_packing import GGUFEmbedding, use_gguf_embedding
from tokenmill.models.loader import load_model, open_checkpoint
from tokenmill.models.packed_linear import BLOCK_FORMATS, ConcatLinear, PackedLinear

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 256, 4, 2, 64, 512, 80  # K-quant rows need 256s


def write_gguf(path, arch: str, kinds: dict[str, str], tied: bool, bias: bool,
               extra: dict[str, np.ndarray] | None = None, rope_scaling: str | None = None,
               token_ids: dict[str, int] | None = None) -> None:
    """One layer; kinds maps GGUF tensor names (without "blk.0.") to F32, a type gguf quantizes to
    (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ2_0) or a K-quant; extra: more tensors, as they are;
    rope_scaling: a rope.scaling.type, with a factor of 4 over an original context of 32;
    token_ids: tokenizer.ggml.<name>_token_id fields (eos, eot, eom, ...)."""
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
    from gguf.quants import quantize
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.vocab_size", VOCAB)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(1)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_context_length(64)
    for name, token in (token_ids or {}).items():
        getattr(w, f"add_{name}_token_id")(token)
    if rope_scaling is not None:
        w.add_rope_scaling_type(RopeScalingType(rope_scaling))
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32)

    def matrix(name: str, rows: int, cols: int, kind: str) -> None:
        data = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
        if kind == "F32":
            w.add_tensor(name, data)
        elif kind.endswith("_K"):
            w.add_tensor(name, random_k_quant_rows(rng, kind, rows, cols), raw_dtype=GGMLQuantizationType[kind])
        else:
            qtype = GGMLQuantizationType[kind]
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"attn_q": (q, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN), "attn_output": (HIDDEN, q),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    matrix("token_embd.weight", VOCAB, HIDDEN, kinds["token_embd"])
    if not tied:
        matrix("output.weight", VOCAB, HIDDEN, kinds["output"])
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        w.add_tensor(f"{name}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for name, (rows, cols) in shapes.items():
        matrix(f"blk.0.{name}.weight", rows, cols, kinds[name])
    if bias:
        for name in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(f"blk.0.{name}.bias", rng.standard_normal(shapes[name][0]).astype(np.float32))
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


KINDS = {"token_embd": "Q8_0", "output": "Q4_0", "attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1",
         "attn_output": "Q4_0", "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_1"}
ALL_BLOCKS = {"qkv_proj": "Q4_1", "o_proj": "Q4_0", "gate_up_proj": "Q8_0", "down_proj": "Q4_1", "head": "Q4_0"}
# arch, kinds, tied, bias -> the block type each projection should keep (None: float32; a tuple:
# a ConcatLinear of one PackedLinear per run of parts of one type)
CASES = {
    "llama_untied": ("llama", KINDS, False, False, ALL_BLOCKS),
    "llama_tied_mixed": ("llama", {**KINDS, "attn_v": "Q8_0", "ffn_up": "F32"}, True, False,
                         {**ALL_BLOCKS, "qkv_proj": ("Q4_1", "Q8_0"), "gate_up_proj": None, "head": "Q8_0"}),
    "qwen2_bias": ("qwen2", KINDS, False, True, ALL_BLOCKS),
    "llama_q4_k": ("llama", {**KINDS, "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "ffn_gate": "Q4_K",
                             "ffn_up": "Q4_K", "ffn_down": "Q4_K", "output": "Q4_K"}, False, False,
                   {**ALL_BLOCKS, "qkv_proj": "Q4_K", "gate_up_proj": "Q4_K", "down_proj": "Q4_K", "head": "Q4_K"}),
    # as in Q4_K_M / Q5_K_M files: v, ffn_down and the head in Q6_K; the bias split between runs
    "qwen2_k_quants_mixed": ("qwen2", {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K",
                                       "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q5_K", "ffn_up": "Q5_K",
                                       "ffn_down": "Q6_K"}, False, True,
                             {"qkv_proj": ("Q4_K", "Q6_K"), "o_proj": "Q5_K", "gate_up_proj": "Q5_K",
                              "down_proj": "Q6_K", "head": "Q6_K"}),
    # Q3_K_M-like: Q3_K re-cut into Q6F blocks (a scale per 16 weights), beside Q4_K, Q5_K and Q6_K
    "llama_q3_k_mixed": ("llama", {**dict.fromkeys(KINDS, "Q3_K"), "attn_v": "Q5_K", "attn_output": "Q4_K",
                                   "ffn_down": "Q4_K", "output": "Q6_K"}, False, False,
                         {**dict.fromkeys(ALL_BLOCKS, "Q3_K"), "qkv_proj": ("Q3_K", "Q5_K"), "o_proj": "Q4_K",
                          "down_proj": "Q4_K", "head": "Q6_K"}),
    # Q5_0 and Q5_1 re-cut into the kernel's Q5F blocks; the tied head from the embeddings' own
    "llama_tied_q5_0": ("llama", dict.fromkeys(KINDS, "Q5_0"), True, False, dict.fromkeys(ALL_BLOCKS, "Q5_0")),
    "llama_q5_mixed": ("llama", {**dict.fromkeys(KINDS, "Q5_1"), "attn_k": "Q5_0", "ffn_down": "Q5_0"}, False, False,
                       {**dict.fromkeys(ALL_BLOCKS, "Q5_1"), "qkv_proj": ("Q5_1", "Q5_0", "Q5_1"),
                        "down_proj": "Q5_0"}),
    # TQ2_0 has no blocks in the kernel: float32 panels, and the tied head needs the float32 table
    "llama_tied_tq2_0": ("llama", dict.fromkeys(KINDS, "TQ2_0"), True, False,
                         {**dict.fromkeys(ALL_BLOCKS), "float32_embeddings": True}),
}


def written_case(tmp_path, case: str):
    """The GGUF file of CASES[case], written under tmp_path, and the case; skipped without the C++
    kernels' block formats."""
    kernels = load_cpu_kernels(required=False)
    if kernels is None or not kernels.block_formats:
        pytest.skip("needs the C++ kernels with AVX2")
    arch, kinds, tied, bias, _ = CASES[case]
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, arch, kinds, tied, bias)
    return path, CASES[case]


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_projections_keep_their_blocks_and_match_float32(tmp_path, case):
    path, (arch, kinds, tied, bias, expected) = written_case(tmp_path, case)
    cpu = torch.device("cpu")
    blocks = load_model(open_checkpoint(path), 64, torch.float32, cpu, "auto", gguf_blocks=True)
    floats = load_model(open_checkpoint(path), 64, torch.float32, cpu, "auto", gguf_blocks=False)
    pairs = {"head": (blocks.packed_lm_head, floats.packed_lm_head)}
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        pairs[name.split(".")[1]] = (blocks.layers[0].get_submodule(name), floats.layers[0].get_submodule(name))
    for short, (ours, reference) in pairs.items():
        want = expected[short]
        assert isinstance(reference, PackedLinear) and reference.format == 0
        if isinstance(want, tuple):
            assert isinstance(ours, ConcatLinear) and [p.format for p in ours.parts] == [BLOCK_FORMATS[k] for k in want]
        else:
            assert isinstance(ours, PackedLinear) and ours.format == (BLOCK_FORMATS[want] if want else 0), short
        for rows in (1, 7, 20):  # registers, two passes, a decoded buffer
            x = torch.randn(rows, ours.in_features)
            assert torch.equal(ours(x), reference(x)), (short, rows)
    # quantized embeddings are looked up in the file's rows, unless a tied head needs the table
    assert isinstance(blocks.embed_tokens, GGUFEmbedding) != expected.get("float32_embeddings", False)
    tokens = torch.tensor([0, 7, VOCAB - 1, 7])
    assert torch.equal(blocks.embed_tokens(tokens), floats.embed_tokens(tokens))
    # every panel, blocks or float32, packed in place into one arena
    storages = {m.panels.untyped_storage().data_ptr() for m in blocks.modules() if isinstance(m, PackedLinear)}
    assert len(storages) == 1


@pytest.mark.parametrize("case", [c for c in CASES if c != "llama_tied_tq2_0"])
def test_a_tensor_parallel_ranks_gguf_blocks_are_its_shard_of_the_float32_weights(tmp_path, case, caplog):
    """Each of 2 ranks keeps its shard of every projection in the file's blocks (rows for q/k/v,
    gate/up and the head, whole heads of llama's un-permuted q/k; input columns for o and down),
    giving what the float32 shard cut from the dequantized tensor gives, bit for bit; o_proj's 128
    input columns a rank cut a K-quant's 256-weight super-blocks, so it is float32 on each rank, named
    in a warning, while down_proj's 256 keep theirs."""
    from tokenmill.models.parallel import RowParallel, TPShard
    path, (arch, kinds, tied, bias, expected) = written_case(tmp_path, case)
    cpu, k_quant_o = torch.device("cpu"), kinds["attn_output"].endswith("_K")
    for rank in (0, 1):
        shard = TPShard(rank, 2)
        caplog.clear()
        blocks = load_model(open_checkpoint(path), 64, torch.float32, cpu, "auto", True, 0, shard, lambda t: t)
        floats = load_model(open_checkpoint(path), 64, torch.float32, cpu, "auto", False, 0, shard, lambda t: t)
        warned = [r.getMessage() for r in caplog.records if "dequantized to float32" in r.getMessage()]
        assert warned == ([f"tensor_parallel_size 2, rank {rank}: 1 GGUF matrix dequantized to float32 "
                           f"(input-column shards that would cut quantized blocks): blk.0.attn_output.weight "
                           f"({kinds['attn_output']}, blocks of 256 weights, 128 columns a rank)"]
                          if k_quant_o else [])
        pairs = {"head": (blocks.packed_lm_head, floats.packed_lm_head)}
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            ours, reference = (blocks.layers[0].get_submodule(name), floats.layers[0].get_submodule(name))
            if isinstance(ours, RowParallel):
                ours, reference = ours.inner, reference.inner
            pairs[name.split(".")[1]] = (ours, reference)
        for short, (ours, reference) in pairs.items():
            want = None if short == "o_proj" and k_quant_o else expected[short]
            assert reference.format == 0
            if isinstance(want, tuple):
                assert [p.format for p in ours.parts] == [BLOCK_FORMATS[k] for k in want]
            else:
                assert isinstance(ours, PackedLinear) and ours.format == (BLOCK_FORMATS[want] if want else 0), short
            assert (ours.out_features, ours.in_features) == (reference.out_features, reference.in_features)
            x = torch.randn(7, ours.in_features)
            assert torch.equal(ours(x), reference(x)), short
        assert blocks.packed_lm_head.out_features == VOCAB // 2
        ids = torch.arange(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)  # the rows the float32 rank holds
        assert torch.equal(blocks.embed_tokens(ids), floats.embed_tokens(ids))


def test_gguf_embedding_checks_its_shape_at_load_and_takes_no_ids():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from tokenmill.config import ModelConfig
    from tokenmill.models.llama import LlamaForCausalLM
    cfg = ModelConfig(architecture="llama", vocab_size=80, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    table = np.random.default_rng(0).standard_normal((80, 64)).astype(np.float32)
    rows = quantize(table, GGMLQuantizationType.Q8_0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_len=64)
    for bad in (rows[:79], quantize(table[:, :32], GGMLQuantizationType.Q8_0)):  # vocab, width
        with pytest.raises(ValueError, match="token embeddings of"):
            use_gguf_embedding(model, bad, GGMLQuantizationType.Q8_0)
    assert use_gguf_embedding(model, rows, GGMLQuantizationType.Q8_0) == "model.embed_tokens.weight"
    full = dequantize(rows, GGMLQuantizationType.Q8_0)
    assert torch.equal(model.embed_tokens(torch.tensor([3, 79])), torch.from_numpy(full[[3, 79]]))
    assert model.embed_tokens(torch.tensor([], dtype=torch.long)).shape == (0, 64)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_kernel_embedding_lookup_is_ggufs_dequantization(kind):
    """The CPU kernels' embed_rows gives gguf's dequantized rows bit for bit (GGUFEmbedding's
    lookup for these types), empty and repeated ids included."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    kernels = load_cpu_kernels(required=False)
    if kernels is None:
        pytest.skip("no C++ compiler")
    qtype = GGMLQuantizationType[kind]
    rng = np.random.default_rng(1)
    if kind.endswith("_K"):  # random super-blocks, 512 values a row: gguf cannot quantize to these
        rows, width = random_k_quant_rows(rng, kind, 50, 512), 512
    else:
        table = (rng.standard_normal((50, 96)) * [[1e-3], [1.0], [300.0], *[[1.0]] * 47])
        rows, width = quantize(table.astype(np.float32), qtype), 96
    embedding = GGUFEmbedding(rows, qtype, width, kernels)
    assert embedding.kernels is not None
    ids = torch.tensor([0, 1, 2, 49, 7, 7])
    assert torch.equal(embedding(ids), torch.from_numpy(dequantize(rows, qtype)[ids.numpy()]))
    assert embedding(torch.tensor([], dtype=torch.long)).shape == (0, width)
    with pytest.raises(RuntimeError, match="out of range"):
        embedding(torch.tensor([50]))


def test_gguf_rope_freqs_give_llama3_scaling(tmp_path):
    """Llama 3.1+ GGUF files carry their rope scaling as rope_freqs.weight, one divisor per
    frequency (as llama.cpp's converter computes them); the model's frequencies must be the ones
    the Hugging Face config's llama3 scaling gives."""
    from tokenmill.models.llama import rope_inv_freq
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    plain = rope_inv_freq(HEAD_DIM, 10000.0, None)
    factors = (plain / rope_inv_freq(HEAD_DIM, 10000.0, llama3)).numpy().astype(np.float32)
    assert factors.min() == 1.0 and factors.max() == 8.0  # some frequencies scaled, some not, some between
    path = tmp_path / "llama3.gguf"
    write_gguf(path, "llama", dict.fromkeys(KINDS, "F32"), False, False, extra={"rope_freqs.weight": factors})
    model = load_model(open_checkpoint(path), 64, torch.float32, torch.device("cpu"), kernels="torch")
    assert model.config.rope_scaling["rope_type"] == "freq_factors"
    got = rope_inv_freq(HEAD_DIM, model.config.rope_theta, model.config.rope_scaling)
    assert torch.allclose(got, rope_inv_freq(HEAD_DIM, 10000.0, llama3), rtol=1e-6)
    cos, _ = model.rotary(torch.tensor([40]), torch.float32)
    assert torch.allclose(cos.double().flatten()[:HEAD_DIM // 2], torch.cos(40 * got), atol=1e-6)


def test_hf_weights_read_the_models_shards_not_mistrals_consolidated_file(tiny_llama, tmp_path):
    """Mistral snapshots ship consolidated.safetensors (the same weights under Mistral's names)
    beside the HF shards; the loader reads the shards the index names, or model*.safetensors."""
    import json

    from safetensors.torch import save_file

    from tokenmill.models.loader import hf_weights
    expected = {name for name, _ in hf_weights(tiny_llama)}
    for sharded in (False, True):
        model_dir = copy_model(tiny_llama, tmp_path / f"sharded_{sharded}")
        save_file({"layers.0.attention.wk.weight": torch.zeros(2, 2)}, str(model_dir / "consolidated.safetensors"))
        if sharded:  # an index naming the one shard
            (model_dir / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": dict.fromkeys(expected, "model.safetensors")}))
        assert {name for name, _ in hf_weights(model_dir)} == expected


WINDOW_CASES = [  # config.json changes -> each layer's window (2 layers), as transformers applies them
    ({"model_type": "mistral", "sliding_window": 32}, (32, 32)),
    ({"model_type": "mistral", "sliding_window": None}, ()),
    ({"model_type": "qwen2", "sliding_window": 32}, ()),                   # use_sliding_window off
    ({"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 1}, (None, 32)),
    ({"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 0}, (32, 32)),
    ({"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 2}, ()),
    ({"model_type": "qwen3", "sliding_window": 8, "use_sliding_window": True,
      "layer_types": ["sliding_attention", "full_attention"]}, (8, None)),
    ({"model_type": "llama", "sliding_window": 32}, ()),                   # transformers' Llama has no window
    ({"model_type": "mistral", "sliding_window": 32, "layer_types": ["full_attention", "sliding_attention"]},
     (None, 32)),                                                         # as Ministral, in transformers
    ({"model_type": "ministral", "sliding_window": 32}, (32, 32)),
]
# architectures this branch's loader does not take yet, whose windows it reads as transformers does
OTHER_WINDOW_CASES = [
    ({"model_type": "phi3", "sliding_window": 2047}, (2047, 2047)),
    ({"model_type": "mixtral", "sliding_window": None}, ()),
    ({"model_type": "qwen3_moe", "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}, (8, 8)),
    ({"model_type": "qwen2_moe", "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2}, (8, None)),
    ({"model_type": "qwen2_moe", "sliding_window": 8, "use_sliding_window": False}, ()),
]


@pytest.mark.parametrize("changes,windows", WINDOW_CASES)
def test_layer_windows_are_read_as_transformers_applies_them(tiny_llama, tmp_path, changes, windows):
    """Mistral slides every layer; Qwen2/3 only with use_sliding_window, from max_window_layers on
    or as layer_types says; the context is the model's whole context either way."""
    from tokenmill.models.loader import hf_model_config
    cfg = hf_model_config(copy_model(tiny_llama, tmp_path / "m", **changes))
    assert cfg.layer_windows == windows
    assert cfg.max_position_embeddings == 1024
    assert cfg.kv_window == (None if not windows or None in windows else max(windows))


@pytest.mark.parametrize("cfg,windows", OTHER_WINDOW_CASES)
def test_layer_windows_of_other_architectures_follow_transformers(cfg, windows):
    from tokenmill.models.loader import hf_layer_windows
    assert hf_layer_windows({"num_hidden_layers": 2, **cfg}) == windows


@pytest.mark.parametrize("changes,match", [
    ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
      "layer_types": ["chunked_attention", "full_attention"]}, r"unsupported layer_types \['chunked_attention'\]"),
    ({"attention_chunk_size": 8192}, "unsupported attention variant attention_chunk_size=8192"),
])
def test_other_local_attention_variants_are_refused_by_name(tiny_llama, tmp_path, changes, match):
    from tokenmill.models.loader import hf_model_config
    with pytest.raises(ValueError, match=match):
        hf_model_config(copy_model(tiny_llama, tmp_path / "m", **changes))


def test_building_a_model_does_not_import_torch_dynamo():
    """Random init and table building on the meta device go through torch's Python reference
    ops, whose first use imports torch._dynamo: a second of every start, for nothing."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "from tokenmill.config import ModelConfig\n"
            "from tokenmill.models.llama import LlamaForCausalLM\n"
            "cfg = ModelConfig(architecture='llama', vocab_size=80, hidden_size=64, intermediate_size=96,\n"
            "                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,\n"
            "                  rope_scaling={'rope_type': 'freq_factors', 'factors': [1.0] * 8})\n"
            "with torch.device('meta'):\n"
            "    model = LlamaForCausalLM(cfg, max_len=64)\n"
            "model.to_empty(device='cpu').rotary.build()\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_gguf_reader_through_a_plain_view_reads_what_ggufs_own_does(tmp_path):
    """open_gguf's reader (slices through an ndarray view of the map: 3.3x faster on the default
    model's metadata) gives the same fields and tensors; a gguf whose private reader method has
    changed would make it fall back to the stock reader, which this notices."""
    from gguf import GGUFReader

    from tokenmill.models.gguf_loader import open_gguf
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", KINDS, tied=False, bias=True)
    from gguf import GGUFWriter  # plus the string arrays and scalars a tokenizer brings
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_token_list([f"tok{i}" for i in range(300)] + ["é", "東京", ""])
    w.add_token_scores([float(i) for i in range(303)])
    w.add_eos_token_id(7)
    w.add_tensor("x", np.arange(12, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, tmp_path / "t.gguf"):
        ours, stock = open_gguf(p), GGUFReader(str(p))
        assert type(ours).__name__ == "PlainViewReader"
        assert list(ours.fields) == list(stock.fields)
        for key, field in stock.fields.items():
            assert ours.fields[key].data == field.data and ours.fields[key].types == field.types
            assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(ours.fields[key].parts, field.parts))
        assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == [
            (t.name, t.tensor_type, list(t.shape)) for t in stock.tensors]
        assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, stock.tensors))


@pytest.mark.parametrize("where", ["empty", "inside the metadata", "inside the tensors"])
def test_a_truncated_gguf_is_a_value_error_naming_the_file(tiny_llama, tmp_path, where):
    """Cut short anywhere, not an IndexError from inside gguf's reader or a bare numpy reshape
    error (the whole file loads)."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from tokenmill.config import EngineConfig
    from tokenmill.engine import LLMEngine
    whole = tmp_path / "whole.gguf"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"▁w{i}" for i in range(hf.config.vocab_size - 4)]
    write_gguf_from_hf(hf, whole, "Q8_0", tokens=tokens)
    LLMEngine(EngineConfig(model=str(whole), num_kv_blocks=16))
    data = whole.read_bytes()
    tensors_at = GGUFReader(str(whole)).data_offset
    keep = {"empty": 0, "inside the metadata": tensors_at // 2, "inside the tensors": (tensors_at + len(data)) // 2}
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep[where]])
    with pytest.raises((ValueError, OSError), match="cut.gguf"):
        LLMEngine(EngineConfig(model=str(cut)))


def test_a_gguf_without_a_required_key_is_refused_by_the_keys_name(tmp_path, monkeypatch):
    """As llama.cpp names it; it used to be a TypeError about None from the config's arithmetic."""
    from gguf import GGUFWriter
    monkeypatch.setattr(GGUFWriter, "add_block_count", lambda self, n: None)
    path, experts = tmp_path / "m.gguf", tmp_path / "experts.gguf"
    write_gguf(path, "llama", dict.fromkeys(KINDS, "F32"), True, False)
    with pytest.raises(ValueError, match=f"^{path}: missing required key llama.block_count$"):
        open_checkpoint(path)
    w = GGUFWriter(str(experts), "qwen2moe")  # (its experts are read per layer)
    w.add_expert_count(4)
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    with pytest.raises(ValueError, match=f"^{experts}: missing required key qwen2moe.block_count$"):
        open_checkpoint(experts)


def test_a_gguf_tensor_type_the_gguf_package_does_not_know_is_named_not_taken_for_a_broken_file(tmp_path):
    """llama.cpp writes types newer than gguf's enum (Q2_0 is 42): refused by its number, with the
    package's version, not as 'a truncated or corrupt file'."""
    import importlib.metadata
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", dict.fromkeys(KINDS, "F32"), True, False)
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    end = data.index(name) + len(name)  # then n_dims (uint32), the dims (uint64 each), the type (uint32)
    where = end + 4 + 8 * int.from_bytes(data[end:end + 4], "little")
    data[where:where + 4] = (42).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    version = importlib.metadata.version("gguf")
    from tokenmill.config import UnsupportedModel
    with pytest.raises(UnsupportedModel, match=f"^{path}: a tensor of GGML type 42, which this install's gguf "
                                               rf"package \({version}\) does not know"):
        open_checkpoint(path)


def test_a_tokenizer_that_cannot_be_built_is_one_error_naming_the_model(tiny_llama, tmp_path):
    """A GGUF whose eos id is past its vocabulary, and a directory without tokenizer files: one
    ValueError with the path (the command line prints it as one line), not an IndexError's
    traceback or transformers' lines about sentencepiece."""
    from transformers import AutoModelForCausalLM

    from tokenmill.models.loader import load_tokenizer
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"▁w{i}" for i in range(hf.config.vocab_size - 4)]
    path = tmp_path / "eos.gguf"
    write_gguf_from_hf(hf, path, "F32", tokens=tokens, token_ids={"eos": 999999})
    with pytest.raises(ValueError, match=f"^{path}: cannot build its tokenizer from the file's tokenizer.ggml.* keys"):
        load_tokenizer(path, cache_dir=tmp_path / "cache")
    bare = copy_model(tiny_llama, tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=f"^{bare}: cannot load its tokenizer .*give --tokenizer DIR$"):
        load_tokenizer(bare)


@pytest.mark.parametrize("changes,match", [
    ({"mlp_bias": True}, "unsupported llama variant: mlp_bias = True"),
    ({"partial_rotary_factor": 0.5}, "unsupported partial_rotary_factor 0.5 for llama"),
    ({"model_type": "falcon"}, "unsupported model_type 'falcon'"),
])
def test_what_tokenmill_does_not_run_is_named_not_taken_for_a_broken_file(tiny_llama, tmp_path, changes, match):
    """A config asking for what the model code lacks is refused by that key, with the path, and
    without the words a broken file gets."""
    from tokenmill.config import UnsupportedModel
    from tokenmill.models.loader import open_checkpoint
    path = copy_model(tiny_llama, tmp_path / "m", **changes)
    with pytest.raises(UnsupportedModel, match=match) as info:
        open_checkpoint(path)
    assert str(info.value).startswith(f"{path}: ") and "corrupt" not in str(info.value)


def test_an_activation_other_than_silu_is_refused(tiny_llama, tmp_path):
    """The MLP is SwiGLU: a config.json with another hidden_act ran as SiLU, logits off by 0.6."""
    from tokenmill.models.loader import hf_model_config
    assert hf_model_config(copy_model(tiny_llama, tmp_path / "swish", hidden_act="swish")).architecture == "llama"
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        hf_model_config(copy_model(tiny_llama, tmp_path / "gelu", hidden_act="gelu"))


@pytest.mark.parametrize("kind", ["none", "linear", "yarn", "longrope"])
def test_gguf_rope_scaling_is_applied_as_transformers_does_or_refused(tmp_path, kind):
    """llama.cpp applies the file's rope.scaling.type (converted Qwen long-context models carry
    YaRN's): cos and sin are transformers' for the same scaling, or the model refuses the type by
    name. All but linear were read as no scaling at all."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, "qwen2", dict.fromkeys(KINDS, "F32"), True, True, rope_scaling=kind)
    checkpoint = open_checkpoint(path)
    if kind == "longrope":
        with pytest.raises(ValueError, match="unsupported rope scaling: longrope without short_factor"):
            load_model(checkpoint, 64, torch.float32, torch.device("cpu"), kernels="torch")
        return
    model = load_model(checkpoint, 64, torch.float32, torch.device("cpu"), kernels="torch")
    rope = {"rope_type": "default"} if kind == "none" else {"rope_type": kind, "factor": 4.0}
    if kind == "yarn":
        rope["original_max_position_embeddings"] = 32
    hf = AutoConfig.for_model("qwen2", hidden_size=HIDDEN, num_attention_heads=HEADS, max_position_embeddings=64,
                              rope_theta=10000.0, rope_scaling=rope)
    inv_freq, attention_factor = (ROPE_INIT_FUNCTIONS[kind](hf, "cpu") if kind != "none" else
                                  (1 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM), 1.0))
    positions = torch.arange(64)
    cos, sin = model.rotary(positions, torch.float32)
    angles = positions[:, None].double() * inv_freq.double()
    assert torch.allclose(cos.double(), angles.cos() * attention_factor, atol=1e-5)
    assert torch.allclose(sin.double(), angles.sin() * attention_factor, atol=1e-5)


@pytest.mark.parametrize("ids, expected", [({"eos": 7}, (7,)), ({"eos": 7, "eot": 9, "eom": 11}, (7, 9, 11)),
                                           ({"eos": 7, "eot": 7}, (7,)), ({}, ())])
def test_gguf_end_of_turn_and_message_tokens_end_generation(tmp_path, ids, expected):
    """A Llama 3 GGUF may name <|end_of_text|> its eos and <|eot_id|> (<|eom_id|>) its eot (eom):
    llama.cpp stops on each of them, and so must a chat answer here, not run past its turn."""
    from tokenmill.models.gguf_loader import gguf_model_config, open_gguf
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", dict.fromkeys(KINDS, "F32"), True, False, token_ids=ids)
    assert tuple(gguf_model_config(open_gguf(path)).eos_token_ids) == expected


def test_a_missing_weight_is_named_as_the_checkpoint_names_it():
    """k_proj and up_proj are loaded into fused parameters (qkv_proj, gate_up_proj); the error
    names the tensors the checkpoint lacks, not the fused parameters."""
    from tokenmill.config import ModelConfig
    from tokenmill.models.llama import LlamaForCausalLM
    cfg = ModelConfig(architecture="llama", vocab_size=80, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.v_proj": (32, 64), "self_attn.o_proj": (64, 64),
              "mlp.gate_proj": (96, 64), "mlp.down_proj": (64, 96)}  # no k_proj, no up_proj
    weights = [(f"model.layers.0.{name}.weight", torch.randn(shape)) for name, shape in shapes.items()]
    weights += [("model.embed_tokens.weight", torch.randn(80, 64))]
    weights += [(f"model.{n}.weight", torch.ones(64))
                for n in ("layers.0.input_layernorm", "layers.0.post_attention_layernorm", "norm")]
    with pytest.raises(ValueError, match="missing") as error:
        LlamaForCausalLM(cfg, max_len=64).load_weights(weights)
    message = str(error.value)
    assert "layers.0.self_attn.k_proj.weight" in message and "layers.0.mlp.up_proj.weight" in message
    assert "qkv_proj" not in message and "gate_up_proj" not in message


def test_longrope_angles_use_the_short_factors_inside_the_original_context_and_the_long_ones_past_it():
    from tokenmill.models.llama import longrope_angles
    scaling = {"original_max_position_embeddings": 4, "short_factor": [1.0, 2.0], "long_factor": [4.0, 8.0]}
    angles = longrope_angles(torch.arange(6, dtype=torch.float64), 4, 100.0, scaling)
    inv_freq = torch.tensor([1.0, 0.1], dtype=torch.float64)  # 1 / 100 ** (0 / 4), 1 / 100 ** (2 / 4)
    assert torch.allclose(angles[3], 3 * inv_freq / torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert torch.allclose(angles[4], 4 * inv_freq / torch.tensor([4.0, 8.0], dtype=torch.float64))


def test_partial_rotary_order_puts_the_checkpoints_rotated_pairs_on_ours_and_the_rest_after():
    from tokenmill.models.llama import partial_rotary_order
    # head 8, 4 rotate: the checkpoint pairs (0, 2), (1, 3); ours pair (j, j + 4)
    assert partial_rotary_order(8, 4).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


@pytest.mark.parametrize("case", ["qwen2_k_quants_mixed", "llama_tied_mixed", "llama_untied", "llama_tied_tq2_0"])
def test_the_memory_a_model_is_checked_against_is_what_its_loaded_weights_take(tmp_path, case, caplog):
    """The figure checked before loading (GGUF blocks as panels, the rest in float32) is the bytes
    the loaded model holds, and a model that needs more than is available is refused with both
    figures before any of it is allocated."""
    import logging

    import tokenmill.models.loader as loader
    path, (arch, kinds, tied, bias, _) = written_case(tmp_path, case)
    caplog.set_level(logging.INFO, logger="tokenmill.models.loader")
    model = load_model(open_checkpoint(path), 64, torch.float32, torch.device("cpu"), "auto")
    held = {id(t): t.nbytes for t in [*model.parameters(), *model.buffers()] if t.device.type == "cpu"}
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    held.update({id(m.panels): m.panels.nbytes for m in packed})
    held.update({id(m.bias): m.bias.nbytes for m in packed if m.bias is not None})  # a plain attribute
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights loaded:"))
    assert line.startswith(f"weights loaded: {sum(held.values()) / 2**20:.1f} MiB in memory")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "memory_available", lambda: 4096)
        with pytest.raises(ValueError, match=r"the weights need [\d.]+ MiB of memory once loaded \([\d.]+ MiB of "
                                             r"GGUF blocks, [\d.]+ MiB of torch.float32 tensors\), and 0.0 MiB is "
                                             "available"):
            load_model(open_checkpoint(path), 64, torch.float32, torch.device("cpu"), "auto")
