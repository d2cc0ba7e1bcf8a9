"""Memory of a gpt-oss Hugging Face directory once loaded: its MXFP4 experts in MXF panels
against the same experts decoded to float32 (gguf_blocks off).

No gpt-oss-20b can be downloaded here, so the script writes a directory of its shape: hidden
2880, 64 query and 8 kv heads of 64, 32 experts of width 2880 (4 used a token), the experts as
released checkpoints store them (MXFP4 blocks and E8M0 scales, random codes, scales 2^-9 to
2^-3), everything else random in bfloat16, over a few layers and a small vocabulary (the
embeddings and head are not what this compares). Each way loads in a fresh process.

    python benchmarks/gpt_oss_hf_memory.py [--layers 2] [--path /tmp/tokenmill-gpt-oss-hf]

Prints, for each way: the load time, the peak resident and anonymous memory while loading, and
what stays resident once loaded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_big_gguf import MemorySampler  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, USED, EXPERT_FFN, VOCAB = 2880, 64, 8, 64, 32, 4, 2880, 4096


def write_model(path: Path, layers: int) -> None:
    """A gpt-oss-20b-shaped directory of `layers` layers at `path` (config.json, model.safetensors)."""
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(0)

    def bf16(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": bf16(VOCAB, HIDDEN), "lm_head.weight": bf16(VOCAB, HIDDEN),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, rows, cols in (("q_proj", HEADS * HEAD_DIM, HIDDEN), ("k_proj", KV_HEADS * HEAD_DIM, HIDDEN),
                                 ("v_proj", KV_HEADS * HEAD_DIM, HIDDEN), ("o_proj", HIDDEN, HEADS * HEAD_DIM)):
            tensors[f"{p}self_attn.{name}.weight"], tensors[f"{p}self_attn.{name}.bias"] = bf16(rows, cols), bf16(rows)
        tensors[f"{p}self_attn.sinks"] = bf16(HEADS)
        tensors[f"{p}input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        tensors[f"{p}post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        tensors[f"{p}mlp.router.weight"], tensors[f"{p}mlp.router.bias"] = bf16(EXPERTS, HIDDEN), bf16(EXPERTS)
        for name, rows, cols in (("gate_up_proj", 2 * EXPERT_FFN, HIDDEN), ("down_proj", HIDDEN, EXPERT_FFN)):
            e = f"{p}mlp.experts.{name}"
            tensors[f"{e}_blocks"] = torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16), dtype=torch.uint8,
                                                   generator=gen)
            tensors[f"{e}_scales"] = torch.randint(118, 125, (EXPERTS, rows, cols // 32), dtype=torch.uint8,
                                                   generator=gen)
            tensors[f"{e}_bias"] = bf16(EXPERTS, rows)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": VOCAB,
              "hidden_size": HIDDEN, "intermediate_size": EXPERT_FFN, "num_hidden_layers": layers,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "num_local_experts": EXPERTS, "num_experts_per_tok": USED, "sliding_window": 128,
              "max_position_embeddings": 131072, "tie_word_embeddings": False, "eos_token_id": 1,
              "quantization_config": {"quant_method": "mxfp4"}}
    (path / "config.json").write_text(json.dumps(config))


def load_once(path: Path, blocks: bool) -> dict:
    """Load the directory in this process; its figures (bytes, seconds)."""
    from tokenmill.models.loader import load_model, open_checkpoint
    sampler = MemorySampler()
    start = time.perf_counter()
    model = load_model(open_checkpoint(path), 256, torch.float32, torch.device("cpu"), kernels="auto",
                       gguf_blocks=blocks)
    seconds = time.perf_counter() - start
    peak = sampler.stop()
    expert = model.layers[0].mlp.experts[0].gate_up_proj
    return {"format": expert.format, "seconds": seconds, "peak": peak, "after": MemorySampler.now()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--path", type=Path, default=Path("/tmp/tokenmill-gpt-oss-hf"))
    ap.add_argument("--load", choices=["panels", "float32"], help=argparse.SUPPRESS)  # one way, in this process
    args = ap.parse_args()
    if args.load:
        print(json.dumps(load_once(args.path, args.load == "panels")))
        return
    if not (args.path / "config.json").exists():
        write_model(args.path, args.layers)
    size = (args.path / "model.safetensors").stat().st_size
    print(f"{args.path}: {json.loads((args.path / 'config.json').read_text())['num_hidden_layers']} layers, "
          f"{size / 2**30:.2f} GiB")
    gib = 2**30
    for way in ("panels", "float32"):
        out = subprocess.run([sys.executable, __file__, "--path", str(args.path), "--load", way], check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{way:8s} (expert format {r['format']}): load {r['seconds']:.1f} s, peak RSS "
              f"{r['peak']['VmRSS'] / gib:.2f} GiB (anonymous {r['peak']['RssAnon'] / gib:.2f}), after load RSS "
              f"{r['after']['VmRSS'] / gib:.2f} GiB (anonymous {r['after']['RssAnon'] / gib:.2f})")


if __name__ == "__main__":
    main()
