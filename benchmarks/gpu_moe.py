"""A Qwen3-30B-A3B-shaped mixture of experts in bfloat16 on CUDA (issue 32): decode tokens/s at
batch 1 and 64, with the experts as grouped products (the default on CUDA, moe.group_experts)
and as the per-expert loop (what ran before: one product per active expert, and inside a
captured CUDA graph every expert over every row), alternated in one run. A captured graph of one
token runs every expert over it either way (SparseMoeBlock.forward), so batch 1's two figures
measure the same path.

    python benchmarks/gpu_moe.py [--layers 4] [--rounds 2] [--batches 1 64] [--tiny --device cpu]

Random weights (no hub access needed), saved once as a Hugging Face directory in $OUT: the
model's shape (hidden 2048, 32 query and 4 kv heads of 128, 128 experts of width 768, 8 a token,
vocabulary 151,936) with --layers of its 48, each about 1.2 GB of experts in bfloat16. Each
measurement is a fresh engine (CUDA graphs on): `batch` requests of 32-token prompts decoding
128 tokens each, EOS ignored; output tokens over the wall time of the decode steps. --tiny
--device cpu runs the same script on a tiny shape, to check it without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

OUT = Path(os.environ.get("OUT", "/tmp"))
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def build(path: Path, layers: int, shape: dict) -> Path:
    """The shape with random weights in bfloat16, saved with a word-level tokenizer of its vocabulary."""
    from conftest import _save_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM
    if (path / "config.json").exists():
        return path
    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, norm_topk_prob=True, decoder_sparse_step=1,
                                  mlp_only_layers=[], max_position_embeddings=4096, rope_theta=1000000.0,
                                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    _save_tokenizer(path, shape["vocab_size"])
    return path


def decode_tok_s(model: Path, device: str, batch: int, grouped: bool) -> float:
    """Output tokens/s of `batch` requests decoding together (their prompts computed first)."""
    import tokenmill.models.loader as loader
    from tokenmill.config import EngineConfig
    from tokenmill.engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    group_experts = loader.group_experts
    if not grouped:  # the loop, as before group_experts existed
        loader.group_experts = lambda model: 0
    try:
        engine = LLMEngine(EngineConfig(model=str(model), device=device, dtype="bfloat16" if device != "cpu" else None,
                                        max_num_seqs=max(batch, 1), max_model_len=512, enable_prefix_caching=False,
                                        kv_cache_memory="4GiB"))
    finally:
        loader.group_experts = group_experts
    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(str(i), [2 + (i * 7 + j) % 300 for j in range(32)], params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                          for r in engine.scheduler.running):
        engine.step()  # the prompts, and the first decode steps while the last prompts finish
    if device != "cpu":
        torch.cuda.synchronize()
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del engine
    if device != "cpu":
        torch.cuda.empty_cache()
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape instead of Qwen3-30B-A3B's")
    args = parser.parse_args()
    shape = TINY if args.tiny else QWEN3_30B_A3B
    model = build(OUT / f"qwen3_moe_{'tiny' if args.tiny else '30b_a3b'}_{args.layers}l", args.layers, shape)
    if args.device != "cpu":
        print(torch.cuda.get_device_name(), f"torch {torch.__version__}", flush=True)
    print(f"{model.name}: {args.layers} layers; output tok/s", flush=True)
    for round_ in range(args.rounds):
        for batch in args.batches:
            for grouped in (True, False) if round_ % 2 == 0 else (False, True):
                rate = decode_tok_s(model, args.device, batch, grouped)
                print(f"round {round_ + 1} batch {batch:>3} {'grouped' if grouped else 'loop':>8}: {rate:9.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
