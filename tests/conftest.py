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

    extra = dict(TINY_CONFIGS[arch])
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
