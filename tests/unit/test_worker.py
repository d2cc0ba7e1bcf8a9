"""The worker: the pool's shape, swaps between the device and host pools, and a forward pass that
is the model's own over the pool."""

from __future__ import annotations

import torch

from tokenmill.attention import make_backend
from tokenmill.config import CacheConfig, ModelConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.model_runner import ModelRunner
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import ModelWorker

CFG = ModelConfig(architecture="llama", vocab_size=80, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)


def make_worker(num_host_blocks: int = 0) -> ModelWorker:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG, max_len=64)
    with torch.no_grad():
        for p in model.parameters():  # (built with empty tensors)
            p.uniform_(-0.2, 0.2)
    return ModelWorker(model, CFG, CacheConfig(6, 16), make_backend("cpu", torch.device("cpu")), torch.device("cpu"),
                       torch.float32, num_host_blocks)


def test_the_pool_holds_one_scratch_block_past_those_handed_out() -> None:
    worker = make_worker()
    assert worker.kv_cache.shape == (2, 2, 7, 2, 16, 16)  # (layers, K|V, blocks + 1, kv_heads, block, head_dim)
    assert worker.null_block == 6 and len(worker.kv_caches) == 2
    assert worker.vocab_size == 80 and worker.host_kv_cache is None


def test_swap_copies_blocks_out_to_the_host_pool_and_back_into_other_blocks() -> None:
    worker = make_worker(num_host_blocks=3)
    worker.kv_cache.copy_(torch.randn(worker.kv_cache.shape))
    before = worker.kv_cache.clone()
    worker.swap(swap_out=[(1, 0), (4, 2)], swap_in=[])
    assert torch.equal(worker.host_kv_cache[:, :, 0], before[:, :, 1])
    assert torch.equal(worker.host_kv_cache[:, :, 2], before[:, :, 4])
    worker.swap(swap_out=[], swap_in=[(2, 5), (0, 3)])
    assert torch.equal(worker.kv_cache[:, :, 5], before[:, :, 4])
    assert torch.equal(worker.kv_cache[:, :, 3], before[:, :, 1])
    assert torch.equal(worker.kv_cache[:, :, :3], before[:, :, :3])  # untouched blocks stay


def test_forward_is_the_model_over_the_pool_and_writes_the_step_keys_and_values() -> None:
    worker = make_worker()
    runner = ModelRunner(worker, seed=0)
    request = Request(request_id="r", prompt_token_ids=list(range(2, 21)), params=SamplingParams(), max_tokens=1)
    assert KVCacheManager(6, 16, enable_prefix_caching=False).allocate(request, 19)
    inputs = runner.prepare([request], [19])
    with torch.inference_mode():
        hidden = worker.forward(inputs.input_ids, inputs.positions, inputs.meta)
        written = worker.kv_cache.clone()
        worker.kv_cache.zero_()
        expected = worker.model(inputs.input_ids, inputs.positions, inputs.meta, worker.kv_caches, worker.backend)
        logits = worker.compute_logits(hidden)
    assert hidden.shape == (19, 64) and torch.isfinite(hidden).all() and torch.equal(hidden, expected)
    assert torch.equal(written, worker.kv_cache)
    assert written[:, :, request.block_ids].abs().sum() > 0
    assert logits.shape == (19, 80)
