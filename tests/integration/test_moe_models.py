"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against Hugging Face
transformers on tiny random-weight models (conftest.TINY_MOE_CONFIGS: hidden 64, 8 experts,
top-2; Qwen2-MoE with a dense first layer and a shared expert, Qwen3-MoE sparse every second
layer).

1. The logits of a ragged step (a chunk continuing an earlier one, a decode, a first chunk)
   match transformers' forward of each sequence alone, on the reference path, with the experts
   grouped as CUDA runs them, and on the CPU kernels' path (experts packed in panels).
2. Greedy generation under chunked prefill, prefix caching and forced preemption equals
   transformers' `generate` on each prompt alone, token for token.
3. The same models written to GGUF as llama.cpp writes them (merged expert tensors) give
   transformers' logits, each expert's matrices kept in their quantized blocks.
4. What is not implemented is refused by name.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TINY_MOE_CONFIGS, copy_model, hf_greedy, hf_model, rel_err, watch_chunked_prompts
from transformers import AutoModelForCausalLM

from tokenmill.attention import make_backend
from tokenmill.config import CacheConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.model_runner import ModelRunner
from tokenmill.models.loader import load_model, open_checkpoint
from tokenmill.models.moe import SparseMoeBlock, group_experts
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import ModelWorker

MOE_ARCHS = list(TINY_MOE_CONFIGS)


def test_each_layer_is_dense_or_sparse_as_the_config_says(tiny_moe_models):
    """Qwen2-MoE's mlp_only_layers=[0] and Qwen3-MoE's decoder_sparse_step=2 make layer 0 dense;
    Mixtral and OLMoE route in every layer; only Qwen2-MoE has a shared expert."""
    expected = {"mixtral": (True, True), "qwen2_moe": (False, True), "qwen3_moe": (False, True),
                "olmoe": (True, True)}
    for arch, path in tiny_moe_models.items():
        model = load_model(open_checkpoint(path), 64, torch.float32, torch.device("cpu"), kernels="torch")
        assert tuple(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers) == expected[arch], arch
        block = model.layers[1].mlp
        assert len(block.experts) == 8 and block.top_k == 2
        assert (block.shared_expert is not None) == (arch == "qwen2_moe")


@pytest.mark.parametrize("backend_name, kernels", [("reference", "torch"), ("reference", "grouped"), ("cpu", "auto")])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_ragged_step_logits_match_hf(tiny_moe_models, arch, backend_name, kernels):
    """kernels="grouped": the torch path with the experts stacked for grouped products, as CUDA
    loads them (torch's CPU fallback of _grouped_mm computes them here)."""
    path = tiny_moe_models[arch]
    checkpoint = open_checkpoint(path)
    cpu = torch.device("cpu")
    model = load_model(checkpoint, 256, torch.float32, cpu, kernels="torch" if kernels == "grouped" else kernels)
    if kernels == "grouped":
        assert group_experts(model) == sum(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)
    kv = KVCacheManager(num_blocks=32, block_size=16, enable_prefix_caching=False)
    runner = ModelRunner(ModelWorker(model, checkpoint.config, CacheConfig(32, 16), make_backend(backend_name, cpu),
                                     cpu, torch.float32), seed=0)
    rng = random.Random(arch)
    reqs = {k: Request(request_id=k, prompt_token_ids=[rng.randrange(2, 384) for _ in range(n)],
                       params=SamplingParams(), max_tokens=8) for k, n in {"a": 50, "b": 12, "c": 7}.items()}
    reqs["b"].token_ids.append(rng.randrange(2, 384))  # b has sampled one token: the next step decodes it

    def run(chunks: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Compute tokens [start, end) of each request in one step; the logits of every token."""
        requests, counts = [], []
        for rid, (start, end) in chunks.items():
            reqs[rid].num_computed_tokens = start
            assert kv.allocate(reqs[rid], end - start)
            requests.append(reqs[rid])
            counts.append(end - start)
        inputs = runner.prepare(requests, counts)
        with torch.inference_mode():
            logits = model.compute_logits(runner.worker.forward(inputs.input_ids, inputs.positions, inputs.meta))
        short_max = runner.worker.short_query_max  # short queries come first in the flat batch
        order = sorted(chunks, key=lambda rid: (chunks[rid][1] - chunks[rid][0]) > short_max)
        out, offset = {}, 0
        for rid in order:
            n = chunks[rid][1] - chunks[rid][0]
            out[rid], offset = logits[offset:offset + n], offset + n
        for rid, (_, end) in chunks.items():
            reqs[rid].num_computed_tokens = end
        return out

    run({"a": (0, 20), "b": (0, 12)})
    chunks = {"a": (20, 50), "b": (12, 13), "c": (0, 7)}
    step = run(chunks)
    hf = hf_model(path)
    for rid, (start, end) in chunks.items():
        with torch.no_grad():
            ref = hf(torch.tensor([reqs[rid].token_ids[:end]])).logits[0, start:end]
        assert rel_err(step[rid], ref) <= 1e-4, f"{arch}/{rid}: {rel_err(step[rid], ref):.2e}"


def test_the_loader_groups_the_experts_where_the_cpu_kernels_do_not_run_them(tiny_moe_models):
    """bfloat16 on the CPU (plain torch): grouped products; float32 with the kernels: the C++ call;
    kernels="torch": the reference loop."""
    path = tiny_moe_models["qwen3_moe"]
    for dtype, kernels, grouped in ((torch.bfloat16, "auto", True), (torch.float32, "auto", False),
                                    (torch.float32, "torch", False)):
        model = load_model(open_checkpoint(path), 64, dtype, torch.device("cpu"), kernels=kernels)
        assert (model.layers[1].mlp.grouped is not None) == grouped, (dtype, kernels)


@pytest.mark.parametrize("arch, backend", [("mixtral", "cpu"), ("qwen2_moe", "reference"), ("qwen3_moe", "cpu"),
                                           ("olmoe", "reference")])
def test_greedy_generation_equals_hf_under_chunking_prefix_caching_and_preemption(tiny_moe_models, arch, backend):
    """Prompts sharing a 48-token prefix, cached by a first request; whole-budget chunks (threshold
    0) fill the small pool fast enough to force preemptions."""
    from tokenmill import LLM

    path = tiny_moe_models[arch]
    rng = random.Random(2)
    shared = [rng.randrange(2, 384) for _ in range(48)]
    prompts = [shared + [rng.randrange(2, 384) for _ in range(n)] for n in (1, 9, 40, 70, 100, 130)]
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=16, block_size=16,
              attention_backend=backend, enable_prefix_caching=True, long_prefill_token_threshold=0)
    engine = llm.engine
    llm.generate([{"prompt_token_ids": shared + [5]}], SamplingParams(max_tokens=1), use_tqdm=False)  # caches it
    chunked = watch_chunked_prompts(engine)

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    assert chunked, "no prompt was split into chunks"
    assert engine.scheduler.num_preemptions > 0, "no request was preempted"
    assert any(out.metrics.num_cached_tokens >= 48 for out in outs), "no prompt hit the prefix cache"
    hf = hf_model(path)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("arch, change, named", [
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
    ("qwen3_moe", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ("qwen3_moe", {"hidden_act": "gelu"}, "'gelu'"),
    ("mixtral", {"model_type": "deepseek_v3"}, "'deepseek_v3'"),
])
def test_an_unsupported_variant_is_refused_by_name(tiny_moe_models, tmp_path, arch, change, named):
    path = copy_model(tiny_moe_models[arch], tmp_path / "changed", **change)
    with pytest.raises(ValueError, match=named):
        open_checkpoint(path)


def test_tensor_parallel_refuses_experts_the_ranks_do_not_divide_before_any_rank_starts(tiny_moe_models, tmp_path):
    import time

    from tokenmill import LLM
    odd = copy_model(tiny_moe_models["mixtral"], tmp_path / "odd", num_local_experts=7)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the model's num_experts = 7 \("):
        LLM(str(odd), tensor_parallel_size=2)
    assert time.monotonic() - start < 5  # refused from config.json: no rank started, no weight read


def prompt_logits(path, prompt: list[int], kernels: str) -> tuple[torch.Tensor, torch.nn.Module]:
    """Our logits at every position of `prompt`, computed in one step from an empty cache; and the model."""
    checkpoint = open_checkpoint(path)
    cpu = torch.device("cpu")
    model = load_model(checkpoint, 256, torch.float32, cpu, kernels=kernels)
    runner = ModelRunner(ModelWorker(model, checkpoint.config, CacheConfig(32, 16),
                                     make_backend("cpu" if kernels == "auto" else "reference", cpu), cpu,
                                     torch.float32), seed=0)
    request = Request(request_id="a", prompt_token_ids=prompt, params=SamplingParams(), max_tokens=1)
    assert KVCacheManager(num_blocks=32, block_size=16, enable_prefix_caching=False).allocate(request, len(prompt))
    inputs = runner.prepare([request], [len(prompt)])
    with torch.inference_mode():
        return model.compute_logits(runner.worker.forward(inputs.input_ids, inputs.positions, inputs.meta)), model


@pytest.mark.parametrize("arch, qtype, merged", [("mixtral", "Q4_1", True), ("qwen2_moe", "Q8_0", True),
                                                 ("qwen3_moe", "Q4_1", True), ("olmoe", "Q8_0", True),
                                                 ("mixtral", "Q8_0", False)])
def test_gguf_written_as_llama_cpp_does_gives_hfs_logits_with_experts_in_their_blocks(tmp_path, arch, qtype, merged):
    """A tiny MoE model written to GGUF as llama.cpp's converter writes it (merged expert tensors
    ffn_{gate,up,down}_exps, or one tensor per expert as older Mixtral files have them; the router
    ffn_gate_inp in float32, Qwen2-MoE's *_shexp tensors, Mixtral as a llama with permuted q/k)
    gives the logits of the same model holding the file's dequantized weights; on the CPU kernels'
    path each expert keeps its blocks."""
    from conftest import _TINY_MOE_SHAPE, write_gguf_from_hf
    from transformers import AutoConfig

    from tokenmill.cpu_kernels import load_cpu_kernels
    from tokenmill.models.packed_linear import BLOCK_FORMATS, PackedLinear
    options = {**_TINY_MOE_SHAPE, **TINY_MOE_CONFIGS[arch]}
    config = AutoConfig.for_model(options.pop("model_type"), vocab_size=96, num_hidden_layers=2,
                                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, **options)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path / f"{arch}.gguf"
    write_gguf_from_hf(hf, path, qtype, merged_experts=merged)
    prompt = [random.Random(0).randrange(96) for _ in range(40)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    kernels = load_cpu_kernels(required=False)
    for name in ("torch", "auto"):
        got, model = prompt_logits(path, prompt, name)
        assert rel_err(got, ref) <= 1e-4, f"{name}: {rel_err(got, ref):.2e}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1)), name
    if kernels is not None and kernels.block_formats:
        experts = model.layers[1].mlp.experts
        assert all(isinstance(e.gate_up_proj, PackedLinear) and e.gate_up_proj.format == BLOCK_FORMATS[qtype]
                   and e.down_proj.format == BLOCK_FORMATS[qtype] for e in experts)
        assert model.layers[1].mlp.fused_experts is not None  # the layer's experts in one C++ call


def test_an_olmoe_gguf_brings_its_own_tokenizer_though_transformers_cannot_read_its_config(tmp_path):
    """transformers' GGUF reader refuses the olmoe architecture when AutoTokenizer reads the
    model's config; the tokenizer comes from the file's vocabulary all the same."""
    from conftest import _TINY_MOE_SHAPE, write_gguf_from_hf
    from test_gemma_gguf import gemma_vocabulary
    from transformers import AutoConfig

    from tokenmill.models.loader import load_tokenizer
    options = {**_TINY_MOE_SHAPE, **TINY_MOE_CONFIGS["olmoe"]}
    config = AutoConfig.for_model(options.pop("model_type"), vocab_size=96, num_hidden_layers=1,
                                  num_key_value_heads=2, max_position_embeddings=128, **options)
    path = tmp_path / "olmoe.gguf"
    write_gguf_from_hf(AutoModelForCausalLM.from_config(config), path, tokens=gemma_vocabulary(size=96))
    tokenizer = load_tokenizer(path, cache_dir=tmp_path / "cache")
    ids = tokenizer.encode("ab", add_special_tokens=False)
    assert tokenizer.vocab_size == 96 and tokenizer.convert_ids_to_tokens(ids) == ["▁a", "b"]


def test_a_gguf_with_another_expert_gating_function_is_refused_naming_it(tmp_path):
    """llama.cpp's expert_gating_func 2 is a sigmoid over the router's logits (DeepSeek-V3's kind)."""
    from gguf import GGUFWriter
    path = tmp_path / "sigmoid.gguf"
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(1)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_uint32("qwen3moe.expert_gating_func", 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF expert_gating_func 2"):
        open_checkpoint(path)
