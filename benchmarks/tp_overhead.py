"""Tensor parallelism's cost on one CPU: decode step time of the same model with
tensor_parallel_size=2 (two processes, one thread each, gloo on 127.0.0.1) against 1 (one process,
two threads; and one thread, the figure a core held by another process leaves), in one run,
alternated.

    python benchmarks/tp_overhead.py [--batches 1 8 32] [--rounds 3] [--layers 24]

The default model (a GGUF file, and 9 heads) cannot be split in two, so the model is a random-
weight Hugging Face directory written here in Qwen2.5-0.5B's shape (hidden 896, 14 heads, 2 KV
heads of 64, intermediate 4864, 24 layers) with a 32,000-token vocabulary; the weights do not
change the time of a step. On 2 cores TP=2 cannot be faster: the figure is the cost of the
split (49 all-reduces per step: two per layer and the embedding's, the step's broadcast, and
each rank on one core), not a speed-up.

Each batch: B requests with 32-token prompts, 3 steps to warm up, then the median of 20 decode
steps; the engines take turns, `--rounds` times, and the median of the rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))  # the checkout this runs in, not the one the script lies in
from cpu_decode_steps import median_decode_step  # noqa: E402  (benchmarks/, this script's folder)

from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402

WARMUP, STEPS = 3, 20
SHAPE = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, head_dim=64, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0)


def write_model(path: Path, layers: int) -> Path:
    """A random-weight qwen2 directory of SHAPE with `layers` layers and a word-level tokenizer."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    q, kv = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02
    weights = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": torch.ones(h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        weights.update({p + "input_layernorm.weight": torch.ones(h),
                        p + "post_attention_layernorm.weight": torch.ones(h),
                        p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.q_proj.bias": rand(q),
                        p + "self_attn.k_proj.weight": rand(kv, h), p + "self_attn.k_proj.bias": rand(kv),
                        p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.v_proj.bias": rand(kv),
                        p + "self_attn.o_proj.weight": rand(h, q), p + "mlp.gate_proj.weight": rand(i, h),
                        p + "mlp.up_proj.weight": rand(i, h), p + "mlp.down_proj.weight": rand(h, i)})
    save_file(weights, str(path / "model.safetensors"))
    config = dict(SHAPE, model_type="qwen2", num_hidden_layers=layers, tie_word_embeddings=True, bos_token_id=0,
                  eos_token_id=1, hidden_act="silu", torch_dtype="float32")
    (path / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel(vocab={f"w{k}": k for k in range(v)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1").save_pretrained(str(path))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp), args.layers)
        engines = {size: LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=size, num_threads=2 // size,
                                                num_kv_blocks=256))
                   for size in (1, 2)}
        runs = [("TP=1, 2 threads", engines[1], 2), ("TP=1, 1 thread", engines[1], 1),
                ("TP=2, 1 thread each", engines[2], 1)]
        load = os.getloadavg()[0]
        try:
            times: dict[tuple[str, int], list[float]] = {}
            for round_ in range(args.rounds):
                for name, engine, threads in runs:
                    torch.set_num_threads(threads)  # process-wide: rank 0 of TP=2 shares this process
                    for batch in args.batches:
                        step = median_decode_step(engine, batch, f"r{round_}-", WARMUP, STEPS)
                        times.setdefault((name, batch), []).append(step)
        finally:
            for engine in engines.values():
                engine.close()
    print(f"{args.layers} layers; median of {args.rounds} rounds of the median of {STEPS} decode steps; "
          f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    for batch in args.batches:
        figures = [f"{name} {statistics.median(times[(name, batch)]) * 1e3:7.2f} ms" for name, _, _ in runs]
        print(f"batch {batch:3d}: " + "   ".join(figures))


if __name__ == "__main__":
    main()
