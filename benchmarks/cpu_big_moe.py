"""A big MoE GGUF on this machine: loading memory and decode steps (issue 32).

No such file can be downloaded here, so the script writes one of a real model's shape with
random super-blocks laid out as llama.cpp's Q4_K_M lays them out (Q4_K, with attn_v and
ffn_down_exps in Q6_K on the layers its rule gives more bits, the head in Q6_K) and the default
model's tokenizer (49,152 tokens; padded with unused tokens where the shape's vocabulary is
larger, as llama.cpp's converter pads one). Shapes (`--shape`):

    qwen3-30b-a3b  48 layers, hidden 2048, 32 query and 4 kv heads of 128, 128 experts of width 768,
                   8 used a token, a q/k RMSNorm on each head; all 48 layers: about 29.6 B weights
                   in about 17.5 GB, more than half of a 24 GiB machine
    olmoe-1b-7b    16 layers, hidden 2048, 16 query and 16 kv heads of 128, 64 experts of width 1024,
                   8 used a token, one RMSNorm over all of q and one over all of k, vocabulary 50,304

The weights are random, so the text is noise; the bytes, shapes and arithmetic are the model's.

    python benchmarks/cpu_big_moe.py [--shape qwen3-30b-a3b] [--layers N] [--path FILE] [--write-only]

Prints the file's size, the load time, the peak resident and anonymous memory while loading,
what stays resident, then median decode steps at batch 1, 4 and 16 (--write-only: writes the
file and stops, for benchmarks/moe_vs_llamacpp.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import random_k_quant_rows  # noqa: E402
from cpu_big_gguf import MemorySampler, start_batch  # noqa: E402
from cpu_gguf_blocks import median_step  # noqa: E402

from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402
from tokenmill.models.loader import default_model_path  # noqa: E402

SUPER_BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}
UNUSED_TOKEN = 5  # gguf's TokenType.UNUSED, what llama.cpp's converter gives the padding tokens


@dataclass(frozen=True)
class MoeShape:
    arch: str           # GGUF general.architecture
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    used: int           # experts a token takes
    expert_ffn: int     # an expert's intermediate width
    vocab: int | None   # None: the default model's tokenizer's
    whole_qk_norms: bool  # one q norm over all heads (OLMoE), else one per head (Qwen3)
    eps: float
    rope_base: float
    context: int


SHAPES = {
    "qwen3-30b-a3b": MoeShape("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, None, False, 1e-6, 1000000.0, 40960),
    "olmoe-1b-7b": MoeShape("olmoe", 16, 2048, 16, 16, 128, 64, 8, 1024, 50304, True, 1e-5, 10000.0, 4096),
}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for the layers whose attn_v and ffn_down get Q6_K."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


def tensor_list(shape: MoeShape, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape in weights as (experts,) rows, cols, type) of every tensor in file order."""
    hidden, ffn, experts = shape.hidden, shape.expert_ffn, shape.experts
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    q_norm, k_norm = (q, kv) if shape.whole_qk_norms else (shape.head_dim, shape.head_dim)
    out = [("token_embd.weight", (vocab, hidden), "Q4_K"), ("output_norm.weight", (hidden,), "F32"),
           ("output.weight", (vocab, hidden), "Q6_K")]
    for i in range(layers):
        more = "Q6_K" if more_bits(i, layers) else "Q4_K"
        out += [(f"blk.{i}.{name}", dims, kind) for name, dims, kind in [
            ("attn_norm.weight", (hidden,), "F32"), ("attn_q.weight", (q, hidden), "Q4_K"),
            ("attn_k.weight", (kv, hidden), "Q4_K"), ("attn_v.weight", (kv, hidden), more),
            ("attn_output.weight", (hidden, q), "Q4_K"), ("attn_q_norm.weight", (q_norm,), "F32"),
            ("attn_k_norm.weight", (k_norm,), "F32"), ("ffn_norm.weight", (hidden,), "F32"),
            ("ffn_gate_inp.weight", (experts, hidden), "F32"),
            ("ffn_gate_exps.weight", (experts, ffn, hidden), "Q4_K"),
            ("ffn_up_exps.weight", (experts, ffn, hidden), "Q4_K"),
            ("ffn_down_exps.weight", (experts, hidden, ffn), more)]]
    return out


def copy_tokenizer(writer, vocab: int | None) -> int:
    """The default model's tokenizer fields into `writer`, its token list padded with unused
    "[PAD{id}]" tokens up to `vocab` (None: as it is); returns the vocabulary's size."""
    from gguf import GGUFReader
    source = GGUFReader(str(default_model_path()))
    tokens = source.fields["tokenizer.ggml.tokens"].contents()
    size = vocab or len(tokens)
    padding = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(len(tokens), size)],
               "tokenizer.ggml.token_type": [UNUSED_TOKEN] * (size - len(tokens))}
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents() + padding[key] if key in padding else field.contents()
            writer.add_key_value(key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    return size


def write_model(path: Path, shape: MoeShape, layers: int) -> None:
    """The file described above, written tensor by tensor (never the whole model in memory)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    writer = GGUFWriter(str(path), shape.arch)
    writer.add_block_count(layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.expert_ffn)  # OLMoE's experts' width in llama.cpp
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.used)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    vocab = copy_tokenizer(writer, shape.vocab)
    writer.add_uint32(f"{shape.arch}.vocab_size", vocab)
    tensors = tensor_list(shape, layers, vocab)
    for name, dims, kind in tensors:
        if kind == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            raw = (*dims[:-1], dims[-1] * SUPER_BLOCK_BYTES[kind] // 256)
            writer.add_tensor_info(name, raw, np.dtype(np.uint8), int(np.prod(raw)),
                                   raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, dims, kind in tensors:
        if kind == "F32":  # norms of one, a router of small random logits
            data = (rng.standard_normal(dims) * 0.02).astype(np.float32) if "gate_inp" in name else np.ones(dims,
                                                                                                            np.float32)
        else:
            rows = int(np.prod(dims[:-1]))
            data = random_k_quant_rows(rng, kind, rows, dims[-1]).reshape(*dims[:-1], -1)
        writer.write_tensor_data(data)
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's")
    ap.add_argument("--path", type=Path, default=None)
    ap.add_argument("--write-only", action="store_true")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    layers = args.layers or shape.layers
    path = args.path or Path(f"/tmp/tokenmill-moe-{args.shape}-{layers}l.gguf")
    if not path.exists():
        start = time.perf_counter()
        write_model(path, shape, layers)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s", flush=True)
    if args.write_only:
        return
    available = int(next(line for line in open("/proc/meminfo") if line.startswith("MemAvailable")).split()[1]) * 1024
    print(f"file {path.stat().st_size / 1e9:.2f} GB; memory available before loading {available / 1e9:.2f} GB",
          flush=True)
    sampler = MemorySampler()
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="1GiB", max_model_len=4096))
    load = time.perf_counter() - start
    peak, after = sampler.stop(), MemorySampler.now()
    print(f"loaded in {load:.0f} s; while loading: peak resident {peak['VmRSS'] / 1e9:.2f} GB, of it anonymous "
          f"{peak['RssAnon'] / 1e9:.2f} GB; after: {after['VmRSS'] / 1e9:.2f} GB, anonymous "
          f"{after['RssAnon'] / 1e9:.2f} GB", flush=True)
    for batch in (1, 4, 16):
        ids = start_batch(engine, batch)
        step = median_step(engine, 5)
        print(f"batch {batch:>2}: step {step * 1e3:.0f} ms, {batch / step:.1f} tok/s", flush=True)
        for rid in ids:
            engine.abort(rid)


if __name__ == "__main__":
    main()
