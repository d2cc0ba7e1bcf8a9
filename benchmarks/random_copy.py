"""A Hugging Face model directory's shape with random weights, for benchmarks on a machine the
real weights cannot reach (a lent device machine takes 64 MiB per call; SmolLM2-135M's
safetensors are 538 MB):

    python benchmarks/random_copy.py SOURCE DEST [--dtype bfloat16]

SOURCE needs only config.json and the tokenizer's files; DEST gets the same files and weights
drawn as transformers initializes them. Throughput with such weights is that of the real model
when outputs run to a set length (the benchmarks ignore EOS); what they write is noise.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.source)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.dest, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (args.source / name).exists():
            shutil.copy(args.source / name, args.dest / name)
    print(f"{args.dest}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters in {args.dtype}")


if __name__ == "__main__":
    main()
