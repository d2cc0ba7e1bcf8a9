"""Shared fixtures: tiny random-weight models saved as Hugging Face directories.

Each tiny model gets a word-level tokenizer ("w0".."wN") so the engine loads it through
the same path as a real checkpoint, with no hub access.

TOKENMILL_TEST_DEVICE=cuda runs the suite's engines on that device (see `engine_device`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

VOCAB = 384

TINY_CONFIGS = {
    "llama": dict(model_type="llama", tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  rope_theta=500000.0),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=24, rope_theta=1000000.0),
}


def triton_usable() -> bool:
    """Triton runs on CUDA, or on the CPU under its interpreter (TRITON_INTERPRET=1)."""
    import importlib.util
    import os

    import torch
    return importlib.util.find_spec("triton") is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


needs_triton = pytest.mark.skipif(not triton_usable(), reason="needs triton (CUDA or TRITON_INTERPRET=1)")


def random_k_quant_rows(rng, kind: str, n: int, k: int):
    """(n, k / 256 * super-block bytes) uint8 rows of random Q3_K, Q4_K, Q5_K or Q6_K super-blocks
    with small scales (gguf cannot quantize to the K-quants)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    raw = rng.integers(0, 256, (n, k // 256, GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]), dtype=np.uint8)
    scales = (rng.random((n, k // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if kind in ("Q3_K", "Q6_K"):
        raw[..., -2:] = scales[..., :2]      # d, at the end
    else:
        raw[..., 0:4] = scales               # d and dmin, at the start
    return raw.reshape(n, -1)


def _save_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1", unk_token="w0")
    fast.chat_template = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
                          "{% if add_generation_prompt %}w4{% endif %}")
    fast.save_pretrained(str(path))


def save_byte_tokenizer(path: Path, vocab_size: int = VOCAB, special: tuple[str, ...] = ()) -> None:
    """A byte-level BPE tokenizer (GPT-2's kind: every text has a tokenization, and tokens are
    pieces of text), trained here on a few lines of JSON and prose; "<s>" is 0 and "</s>" 1, and
    the `special` tokens (such as Mistral's "[TOOL_CALLS]") 2 on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": true, "none": null}',
              "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
              "yes no maybe red green blue 0123456789 [1, 2, 3] {} () <> -+*/=_:;,.!?'"] * 4
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", *special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=list(special))
    fast.chat_template = ("{% if greeting is defined %}{{ greeting }}{% endif %}"  # a template variable
                          "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
                          "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                          "{% for c in m.get('tool_calls', []) %}<call>{{ c['function'] | tojson }}</call>{% endfor %}"
                          "</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    fast.save_pretrained(str(path))


def build_tiny_model(path: Path, arch: str, seed: int = 0, vocab_size: int = VOCAB, noise: float = 0.0,
                     byte_tokenizer: bool = False, **overrides) -> Path:
    """Save a random tiny model of `arch` (and its tokenizer) to `path`. noise > 0: perturb every
    weight by that relative amount (a draft model that mostly agrees with the seed-`seed` one).
    byte_tokenizer: a byte-level BPE tokenizer instead of the word-level one (tokens that are
    pieces of text, for grammars over the output text)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(TINY_CONFIGS.get(arch, {"model_type": arch}))  # others: transformers defaults
    model_type = extra.pop("model_type")
    options = dict(vocab_size=vocab_size, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                   bos_token_id=0, eos_token_id=1, initializer_range=0.2, **extra)
    options.update(overrides)
    config = AutoConfig.for_model(model_type, **options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if noise:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise * p.std())
    model.save_pretrained(str(path), safe_serialization=True)
    (save_byte_tokenizer if byte_tokenizer else _save_tokenizer)(path, vocab_size)
    return path


def copy_model(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of the model directory `src` at `dst`, with config.json's keys changed as given."""
    import json
    import shutil
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf_from_hf(model, path: Path, qtype: str = "F32") -> None:
    """Write a transformers model as llama.cpp's convert_hf_to_gguf.py does (its metadata, llama's
    q/k rows and biases permuted for interleaved rotary pairs, YaRN rope scaling), matrices in
    `qtype` (F32, F16 or a type gguf quantizes to); then put the dequantized values back into
    `model`, which becomes the oracle for the file."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
    from gguf.quants import dequantize, quantize

    c = model.config
    arch, heads, kv_heads = c.model_type, c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    rope = c.rope_parameters
    w = GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])

    def permute(a, n: int, inverse: bool = False):
        if arch != "llama":
            return a
        shape = (n, a.shape[0] // n // 2, 2) if inverse else (n, 2, a.shape[0] // n // 2)
        return a.reshape(*shape, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    state = model.state_dict()
    for name, tensor in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        parts = name.split(".")
        gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}.get(name)
        if gguf_name is None:
            gguf_name = f"blk.{parts[2]}.{_GGUF_LAYER_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        heads_of = heads if ".q_proj." in name else kv_heads if ".k_proj." in name else 0
        data = tensor.numpy()
        if heads_of:
            data = permute(data, heads_of)
        if data.ndim == 1 or qtype == "F32":
            w.add_tensor(gguf_name, data)
            values = data
        elif qtype == "F16":
            w.add_tensor(gguf_name, data.astype(np.float16))
            values = data.astype(np.float16).astype(np.float32)
        else:
            raw = quantize(data, GGMLQuantizationType[qtype])
            w.add_tensor(gguf_name, raw, raw_dtype=GGMLQuantizationType[qtype])
            values = dequantize(raw, GGMLQuantizationType[qtype])
        if heads_of:
            values = permute(values, heads_of, inverse=True)
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(values)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="session", autouse=True)
def engine_device():
    """With TOKENMILL_TEST_DEVICE=cuda every engine a test builds without naming a device (nor a
    CPU-only option) runs on CUDA, in float32 (the dtype of the transformers oracle), with a 1 GiB
    KV pool unless the test sizes it (CUDA's default takes 85% of the free memory, which the
    engines a module holds would share ever more thinly): the suite, run on a GPU machine, checks
    the CUDA path."""
    device = os.environ.get("TOKENMILL_TEST_DEVICE")
    if not device:
        yield
        return
    from tokenmill.config import EngineConfig
    init = EngineConfig.__init__

    def on_device(self, *args, **kwargs):
        cpu_only = kwargs.get("attention_backend") == "cpu" or kwargs.get("kv_cache_dtype") == "float16"
        if not args and "model" in kwargs and "device" not in kwargs and not cpu_only:
            kwargs.update(device=device, dtype=kwargs.get("dtype", "float32"),
                          kv_cache_memory=kwargs.get("kv_cache_memory", 1 << 30))
        init(self, *args, **kwargs)

    EngineConfig.__init__ = on_device
    yield
    EngineConfig.__init__ = init


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch) for arch in TINY_CONFIGS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_bytes(tmp_path_factory) -> Path:
    """A tiny llama with a byte-level BPE tokenizer (structured outputs: grammars over text)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_bytes") / "llama", "llama", byte_tokenizer=True)


# Let test modules import the fakes helper module beside them.
import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
