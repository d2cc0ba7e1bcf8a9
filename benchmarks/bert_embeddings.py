"""Embedding throughput of a BERT encoder: tokenmill's engine against sentence-transformers on the
same directory, on the CPU.

The model is all-MiniLM-L6-v2's shape (hidden 384, 6 layers, 12 heads, intermediate 1536, 512
positions) with random weights and a WordPiece vocabulary of made-up words, saved with its
sentence-transformers modules (mean pooling, Normalize): the work per token is MiniLM's, nothing is
downloaded. Two workloads of `--texts` texts: passages of 8 to 40 words (10 to 42 tokens with [CLS]
and [SEP]) and queries of 2 to 8 words (4 to 10 tokens). Each side embeds all texts once to warm
up, then `--repeats` times, the two alternating; the best run of each counts.
Both run on `--threads` threads (default: every usable core), fixed.

    python benchmarks/bert_embeddings.py [--texts 512] [--repeats 3] [--budget 512 2048] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_minilm_shaped(path: Path, num_words: int = 2000) -> list[str]:
    """Save the random model, its tokenizer and modules to `path`; returns its words."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = [f"w{i}" for i in range(num_words)]
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                      cls_token="[CLS]", mask_token="[MASK]").save_pretrained(str(path))
    config = BertConfig(vocab_size=len(vocab), hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(str(path))
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (path / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": where, "type": f"sentence_transformers.models.{kind}"}
        for i, (where, kind) in enumerate(kinds)]))
    for where in ("1_Pooling", "2_Normalize"):
        (path / where).mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384,
                                                                  "pooling_mode_mean_tokens": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    return words


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, nargs="+", default=[512, 2048],
                        help="tokenmill's max_num_batched_tokens, one engine each")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from tokenmill import LLM
    from tokenmill.cpu_kernels import this_cpu

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "minilm-shaped"
        words = build_minilm_shaped(path)
        st = SentenceTransformer(str(path), device="cpu")
        engines = {budget: LLM(str(path), max_num_batched_tokens=budget, num_threads=args.threads)
                   for budget in args.budget}
        torch.set_num_threads(args.threads)
        rng = random.Random(0)
        results = {}
        for workload, (low, high) in (("passages", (8, 40)), ("queries", (2, 8))):
            texts = [" ".join(rng.choice(words) for _ in range(rng.randrange(low, high + 1)))
                     for _ in range(args.texts)]
            results[workload] = run_workload(texts, st, engines, args.repeats)
    print(f"CPU: {this_cpu().as_dict()}; torch {torch.__version__}, {args.threads} threads; best of {args.repeats}")
    for workload, (tokens, times) in results.items():
        print(f"{workload}: {args.texts} texts, {tokens} tokens")
        for name, runs in times.items():
            print(f"  {name:42s} {min(runs):6.2f} s  {tokens / min(runs):7.0f} tokens/s")


def run_workload(texts: list[str], st, engines: dict, repeats: int) -> tuple[int, dict[str, list[float]]]:
    """(tokens, seconds of each run by side), after checking that the sides' vectors agree."""
    tokens = sum(len(ids) for ids in st.tokenizer(texts)["input_ids"])
    times: dict[str, list[float]] = {"sentence-transformers (batch 32)": []}
    times.update({f"tokenmill (max_num_batched_tokens {b})": [] for b in engines})
    reference = st.encode(texts, batch_size=32)
    for budget, llm in engines.items():
        error = np.abs(np.asarray(llm.embed(texts, use_tqdm=False)) - reference).max()
        print(f"tokenmill (max_num_batched_tokens {budget}): max |difference| from sentence-transformers {error:.1e}")
    for _ in range(repeats):
        start = time.perf_counter()
        st.encode(texts, batch_size=32)
        times["sentence-transformers (batch 32)"].append(time.perf_counter() - start)
        for budget, llm in engines.items():
            start = time.perf_counter()
            llm.embed(texts, use_tqdm=False)
            times[f"tokenmill (max_num_batched_tokens {budget})"].append(time.perf_counter() - start)
    return tokens, times


if __name__ == "__main__":
    main()
