"""Decode graphs (cuda_graphs.py): padding to the captured batch sizes must change nothing.

Without a GPU nothing is captured, but `DecodeGraphs.run` runs the same forward on the same
static buffers with the same padding rows, which is what these tests check; on a GPU,
benchmarks/gpu_bench.py check compares the captured graphs with transformers.
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.attention import make_backend
from tokenmill.config import CacheConfig
from tokenmill.cuda_graphs import DecodeGraphs, capture_sizes
from tokenmill.kv_cache import KVCacheManager
from tokenmill.model_runner import ModelRunner
from tokenmill.models.loader import load_model, open_checkpoint
from tokenmill.request import Request
from tokenmill.worker import ModelWorker


@pytest.mark.parametrize("max_batch", [1, 3, 8, 9, 16, 17, 256, 300, 2048])
def test_capture_sizes_cover_every_batch_with_little_padding(max_batch):
    sizes = capture_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] >= min(max_batch, 512)
    assert sizes[-1] <= 512
    for b in range(1, min(max_batch, 512) + 1):
        n = min(s for s in sizes if s >= b)
        assert n - b <= max(15, b - 1)


def test_padded_decode_equals_eager_and_touches_only_its_slots(tiny_llama):
    """Steps of 7, then 5, then 2 sequences (graphs of 8, 8 and 2 rows): the hidden states equal an
    eager step's, and the pool changes only at the step's own slots and in the scratch block,
    even where rows of the earlier, larger step are left over in the buffers."""
    checkpoint = open_checkpoint(tiny_llama)
    model = load_model(checkpoint, 1024, torch.float32, torch.device("cpu"), kernels="auto")
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_prefix_caching=False)
    worker = ModelWorker(model, checkpoint.config, CacheConfig(64, 16), make_backend("cpu", torch.device("cpu")),
                         torch.device("cpu"), torch.float32)
    runner = ModelRunner(worker, seed=0)
    graphs = DecodeGraphs(model, worker.kv_caches, worker.backend, 16, max_batch=16, max_model_len=1024,
                          null_block=worker.null_block, device=torch.device("cpu"))
    rng = random.Random(0)
    reqs = [Request(request_id=str(i), prompt_token_ids=[rng.randrange(2, 384) for _ in range(rng.randint(3, 60))],
                    params=SamplingParams(), max_tokens=8) for i in range(7)]
    with torch.inference_mode():
        for r in reqs:  # prefill each prompt but its last token, which the decode steps bring
            assert kv.allocate(r, r.num_tokens)
            inputs = runner.prepare([r], [r.num_tokens - 1])
            worker.forward(inputs.input_ids, inputs.positions, inputs.meta)
            r.num_computed_tokens = r.num_tokens - 1
        for batch in (reqs, reqs[2:], reqs[5:]):
            inputs = runner.prepare(batch, [1] * len(batch))
            before = worker.kv_cache.clone()
            padded = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            assert padded.shape[0] == min(s for s in graphs.sizes if s >= len(batch))
            after_graph = worker.kv_cache.clone()
            eager = worker.forward(inputs.input_ids, inputs.positions, inputs.meta)  # no graphs in the worker
            torch.testing.assert_close(padded[:len(batch)], eager, rtol=1e-5, atol=1e-5)
            # the eager step rewrites the same slots with the same values
            torch.testing.assert_close(after_graph[:, :, :worker.null_block], worker.kv_cache[:, :, :worker.null_block])
            changed = (after_graph != before).flatten(3).any(-1).any(-1).any(0).any(0)  # per block
            step_blocks = {r.block_ids[(r.num_tokens - 1) // 16] for r in batch}
            assert set(changed.nonzero().flatten().tolist()) <= step_blocks | {worker.null_block}


def test_generation_through_padded_graphs_equals_eager(tiny_llama):
    """The engine with decode graphs (run uncaptured on a CPU) gives the same greedy tokens as
    without, and its decode steps went through them."""
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(n)]} for n in (3, 17, 40, 5, 90, 33)]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = LLM(str(tiny_llama), max_num_seqs=6, max_num_batched_tokens=64)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(str(tiny_llama), max_num_seqs=6, max_num_batched_tokens=64)
    worker = llm.engine.runner.worker
    worker.capture_graphs(6, llm.engine.max_model_len)
    calls = []
    run = worker.graphs.run
    worker.graphs.run = lambda *args: calls.append(args[2].num_seqs) or run(*args)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == expected
    assert len(calls) >= 15 and any(b not in worker.graphs.sizes for b in calls)
