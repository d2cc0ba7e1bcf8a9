"""An 8B-class GGUF on this machine: loading memory and decode steps.

No such file can be downloaded here, so the script writes one: Llama-3-8B's layers (32 of
hidden 4096, FFN 14336, 32 query and 8 kv heads) with random super-blocks laid out as llama.cpp's
Q4_K_M lays them out (Q4_K everywhere but attn_v and ffn_down in Q6_K on half of the layers,
the head in Q6_K), and the default model's vocabulary and tokenizer (49,152 tokens, copied from
its file), about 7.2 B weights in 4.5 GB. The weights are random, so the
text is noise; the bytes, shapes and arithmetic are an 8B model's.

    python benchmarks/cpu_big_gguf.py [PATH]      (default: /tmp/tokenmill-8b-q4_k_m.gguf)

Prints the load time, the peak resident and anonymous memory while loading (sampled every
10 ms), what stays resident, then median decode steps at batch 1, 4 and 16, the batch-1 step
against the time to stream the projections' bytes at a read bandwidth measured beside it.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import random_k_quant_rows  # noqa: E402
from cpu_gguf_blocks import median_step  # noqa: E402

from tokenmill.bench.roofline import read_bandwidth  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402
from tokenmill.models.loader import default_model_path  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 32, 4096, 14336, 32, 8, 128


def more_bits(layer: int) -> bool:
    """llama.cpp's Q4_K_M rule for the layers whose attn_v and ffn_down get Q6_K."""
    eighth = LAYERS // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


def write_model(path: Path) -> None:
    """The file described above, written tensor by tensor (never the whole model in memory)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    source = GGUFReader(str(default_model_path()))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_context_length(8192)
    writer.add_uint32("llama.vocab_size", vocab)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)
    tensors: list[tuple[str, tuple[int, int], str]] = [("token_embd.weight", (vocab, HIDDEN), "Q4_K"),
                                                       ("output.weight", (vocab, HIDDEN), "Q6_K")]
    for i in range(LAYERS):
        v_down = "Q6_K" if more_bits(i) else "Q4_K"
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        layer = {"attn_q": ((q, HIDDEN), "Q4_K"), "attn_k": ((kv, HIDDEN), "Q4_K"), "attn_v": ((kv, HIDDEN), v_down),
                 "attn_output": ((HIDDEN, q), "Q4_K"), "ffn_gate": ((FFN, HIDDEN), "Q4_K"),
                 "ffn_up": ((FFN, HIDDEN), "Q4_K"), "ffn_down": ((HIDDEN, FFN), v_down)}
        tensors += [(f"blk.{i}.{name}.weight", shape, kind) for name, (shape, kind) in layer.items()]
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(LAYERS) for n in ("attn_norm", "ffn_norm")]
    per_block = {"Q4_K": 144, "Q6_K": 210}
    for name, (rows, cols), kind in tensors:
        writer.add_tensor_info(name, (rows, cols * per_block[kind] // 256), np.dtype(np.uint8),
                               rows * cols * per_block[kind] // 256, raw_dtype=GGMLQuantizationType[kind])
    for name in norms:
        writer.add_tensor_info(name, (HIDDEN,), np.dtype(np.float32), HIDDEN * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _, (rows, cols), kind in tensors:
        writer.write_tensor_data(random_k_quant_rows(rng, kind, rows, cols))
    for _ in norms:
        writer.write_tensor_data(np.ones(HIDDEN, np.float32))
    writer.close()


class MemorySampler:
    """Peak VmRSS and RssAnon of this process, sampled every 10 ms on a thread."""

    def __init__(self) -> None:
        self.peak = {"VmRSS": 0, "RssAnon": 0}
        self.running = True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    @staticmethod
    def now() -> dict[str, int]:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "RssAnon")}

    def run(self) -> None:
        while self.running:
            for key, value in self.now().items():
                self.peak[key] = max(self.peak[key], value)
            time.sleep(0.01)

    def stop(self) -> dict[str, int]:
        self.running = False
        self.thread.join()
        return self.peak


def start_batch(engine: LLMEngine, batch: int) -> list[str]:
    """`batch` greedy requests of 32-token prompts, their prompts run: the engine then decodes them."""
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, list(range(100 + i, 132 + i)),
                           SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0))
    engine.step()  # the prompts
    return ids


def main(path: Path) -> None:
    from tokenmill.models.packed_linear import PackedLinear
    if not path.exists():
        start = time.perf_counter()
        write_model(path)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s")
    sampler = MemorySampler()
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="2GiB"))
    load = time.perf_counter() - start
    peak, after = sampler.stop(), MemorySampler.now()
    panels = sum(m.panels.nbytes for m in engine.runner.worker.model.modules() if isinstance(m, PackedLinear))
    print(f"file {path.stat().st_size / 1e9:.2f} GB; loaded in {load:.0f} s; "
          f"projections in blocks {panels / 1e9:.2f} GB")
    print(f"while loading: peak resident {peak['VmRSS'] / 1e9:.2f} GB, of it anonymous {peak['RssAnon'] / 1e9:.2f} GB; "
          f"after: {after['VmRSS'] / 1e9:.2f} GB, anonymous {after['RssAnon'] / 1e9:.2f} GB")
    for batch in (1, 4, 16):
        ids = start_batch(engine, batch)
        bandwidth = read_bandwidth(min_time=0.5, trials=2) if batch == 1 else 0.0
        step = median_step(engine, 5)
        line = f"batch {batch:>2}: step {step * 1e3:.0f} ms, {batch / step:.1f} tok/s"
        if batch == 1:
            floor = panels / (bandwidth * 1e9)
            line += f"; streaming the blocks at {bandwidth:.1f} GB/s takes {floor * 1e3:.0f} ms: {step / floor:.2f}x"
        print(line)
        for rid in ids:
            engine.abort(rid)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/tokenmill-8b-q4_k_m.gguf"))
