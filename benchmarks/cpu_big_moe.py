"""A Qwen3-30B-A3B-class MoE GGUF on this machine: loading memory and decode steps (issue 32).

No such file can be downloaded here, so the script writes one: Qwen3-30B-A3B's layers (hidden
2048, 32 query and 4 kv heads of 128, 128 experts of width 768, 8 used a token, q/k norms) with
random super-blocks laid out as llama.cpp's Q4_K_M lays them out (Q4_K, with attn_v and
ffn_down_exps in Q6_K on the layers its rule gives more bits, the head in Q6_K), and the default
model's vocabulary and tokenizer (49,152 tokens). With all 48 layers that is about 29.6 B
weights in about 17.5 GB: more than half of a 24 GiB machine. The weights are random, so the
text is noise; the bytes, shapes and arithmetic are the model's.

    python benchmarks/cpu_big_moe.py [--layers 48] [--path /tmp/tokenmill-moe-30b-a3b.gguf]

Prints the file's size, the load time, the peak resident and anonymous memory while loading,
what stays resident, then median decode steps at batch 1, 4 and 16.
"""

from __future__ import annotations

import argparse
import sys
import time
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

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, USED, EXPERT_FFN = 2048, 32, 4, 128, 128, 8, 768
SUPER_BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for the layers whose attn_v and ffn_down get Q6_K."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


def tensor_list(layers: int, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape in weights as (experts,) rows, cols, type) of every tensor in file order."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = [("token_embd.weight", (vocab, HIDDEN), "Q4_K"), ("output_norm.weight", (HIDDEN,), "F32"),
           ("output.weight", (vocab, HIDDEN), "Q6_K")]
    for i in range(layers):
        more = "Q6_K" if more_bits(i, layers) else "Q4_K"
        out += [(f"blk.{i}.{name}", shape, kind) for name, shape, kind in [
            ("attn_norm.weight", (HIDDEN,), "F32"), ("attn_q.weight", (q, HIDDEN), "Q4_K"),
            ("attn_k.weight", (kv, HIDDEN), "Q4_K"), ("attn_v.weight", (kv, HIDDEN), more),
            ("attn_output.weight", (HIDDEN, q), "Q4_K"), ("attn_q_norm.weight", (HEAD_DIM,), "F32"),
            ("attn_k_norm.weight", (HEAD_DIM,), "F32"), ("ffn_norm.weight", (HIDDEN,), "F32"),
            ("ffn_gate_inp.weight", (EXPERTS, HIDDEN), "F32"),
            ("ffn_gate_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), "Q4_K"),
            ("ffn_up_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), "Q4_K"),
            ("ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FFN), more)]]
    return out


def write_model(path: Path, layers: int) -> None:
    """The file described above, written tensor by tensor (never the whole model in memory)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    source = GGUFReader(str(default_model_path()))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(layers)
    writer.add_context_length(40960)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(USED)
    writer.add_expert_feed_forward_length(EXPERT_FFN)
    writer.add_uint32("qwen3moe.vocab_size", vocab)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)
    tensors = tensor_list(layers, vocab)
    for name, shape, kind in tensors:
        if kind == "F32":
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            raw = (*shape[:-1], shape[-1] * SUPER_BLOCK_BYTES[kind] // 256)
            writer.add_tensor_info(name, raw, np.dtype(np.uint8), int(np.prod(raw)),
                                   raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape, kind in tensors:
        if kind == "F32":  # norms of one, a router of small random logits
            data = (rng.standard_normal(shape) * 0.02).astype(np.float32) if "gate_inp" in name else np.ones(shape,
                                                                                                              np.float32)
        else:
            rows = int(np.prod(shape[:-1]))
            data = random_k_quant_rows(rng, kind, rows, shape[-1]).reshape(*shape[:-1], -1)
        writer.write_tensor_data(data)
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--path", type=Path, default=None)
    args = ap.parse_args()
    path = args.path or Path(f"/tmp/tokenmill-moe-30b-a3b-{args.layers}l.gguf")
    if not path.exists():
        start = time.perf_counter()
        write_model(path, args.layers)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s", flush=True)
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
