"""Validation: every bad value raises ValueError naming the field."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineConfig, ModelConfig, parse_size
from tokenmill.sampling_params import SamplingParams


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("max_tokens", 0), ("max_tokens", 1.5), ("min_tokens", -1), ("temperature", -0.1),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0), ("repetition_penalty", 0.0),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("seed", "x"), ("logprobs", 21),
    ("stop", [""]), ("stop_token_ids", [-1]), ("temperature", float("nan")), ("seed", 2 ** 63),
    ("seed", -(2 ** 63) - 1), ("n", 129), ("logit_bias", {5: 101}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}), ("logit_bias", [5]), ("allowed_token_ids", []), ("allowed_token_ids", [-1]),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("bad_words", [" "]), ("bad_words", [3]),
    ("structured_outputs", "json"),
    ("temperature", 2.01), ("temperature", 1e308),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("bias, message", [
    ({5: 1.0, -1: 2.0}, r"^logit_bias keys must be token ids \(integers >= 0\), got -1$"),
    ({5: 101}, r"^logit_bias values must be numbers in \[-100, 100\], got 101 for token 5$"),
])
def test_a_bad_logit_bias_entry_is_named_by_itself(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_sampling_params_normalise():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-5).greedy
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


@pytest.mark.parametrize("field, value", [
    ("max_num_seqs", 0), ("max_num_batched_tokens", -1), ("block_size", 0), ("max_model_len", 1),
    ("num_kv_blocks", 0), ("dtype", "int8"), ("device", "tpu"), ("scheduling_policy", "random"),
    ("kv_watermark", 1.0), ("kv_cache_memory", "lots"), ("attention_backend", "magic"),
    ("kv_cache_dtype", "fp8"), ("gguf_int8_rows", -1), ("gguf_int8_rows", True), ("device", "cpu:abc"),
    ("device", "cuda:-1"), ("tensor_parallel_size", 0), ("tensor_parallel_size", True),
    ("distributed_timeout", 0),
])
def test_invalid_engine_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_tensor_parallelism_flags_reach_the_config_and_a_draft_model_is_refused_with_it():
    from tokenmill.cli import build_parser
    from tokenmill.cli_args import engine_config_from_args
    for command in (["generate", "hi"], ["serve"], ["bench", "throughput"]):
        args = build_parser().parse_args([*command, "--tensor-parallel-size", "2", "--distributed-timeout", "5"])
        config = engine_config_from_args(args)
        assert (config.tensor_parallel_size, config.distributed_timeout) == (2, 5.0)
    assert EngineConfig().tensor_parallel_size == 1
    with pytest.raises(ValueError, match="draft model .* does not combine with tensor_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2, speculative="draft:/some/model")


def test_two_byte_and_int8_kv_caches_are_for_the_cpu():
    assert EngineConfig(kv_cache_dtype="float16").kv_dtype_name == "float16"
    assert EngineConfig(kv_cache_dtype="bfloat16").kv_dtype_name == "bfloat16"
    assert EngineConfig(kv_cache_dtype="int8").kv_dtype_name == "int8"
    assert EngineConfig(device="cuda").kv_dtype_name == "bfloat16"
    for kv in ("float16", "bfloat16", "int8"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype='{kv}' is for the CPU"):
            EngineConfig(device="cuda", kv_cache_dtype=kv)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_vllm_fp8_kv_cache_names_are_refused_with_int8_offered(name):
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{name}': there is no fp8 pool; on the CPU 'int8'"):
        EngineConfig(kv_cache_dtype=name)


def test_parse_size():
    assert parse_size("2GiB", "kv_cache_memory") == 2 * 1024**3
    assert parse_size("512 MB", "kv_cache_memory") == 512 * 1000**2
    assert parse_size(1234, "kv_cache_memory") == 1234
    assert EngineConfig(device="cuda").torch_dtype_name == "bfloat16"
    assert EngineConfig().torch_dtype_name == "float32"


@pytest.mark.parametrize("flags", [["--block-size", "0"], ["--kv-cache-dtype", "fp8"],
                                   ["--long-prefill-token-threshold", "-1"], ["--gguf-int8-rows", "-1"],
                                   ["--swap-space", "-1"]])
def test_cli_reports_bad_engine_options_as_usage_errors(flags, capsys):
    from tokenmill.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hello", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and flags[0][2:].replace("-", "_") in err and "Traceback" not in err


def test_cli_reports_a_model_it_cannot_load_without_a_traceback(tmp_path, capsys):
    from tokenmill.cli import main
    assert main(["generate", "hello", "--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tokenmill: ") and "missing" in err and "Traceback" not in err


def test_cpu_models_in_other_dtypes_take_the_torch_attention(tiny_llama):
    """The C++ attention kernel takes float32 queries only: a float16 model on the CPU runs (torch's
    attention), and asking for the kernel with it is an error at construction, not at the first step.
    (bfloat16 where the kernels have AVX512-BF16 runs float32 between the products: test_device.)"""
    from tokenmill import LLM, SamplingParams
    llm = LLM(str(tiny_llama), dtype="float16")
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        LLM(str(tiny_llama), dtype="float16", attention_backend="cpu")


@pytest.mark.parametrize("flags", [["--workload", "prefix", "--compare"], ["--workload", "long", "--plot", "x"],
                                   ["--compare", "--temperature", "1.0"]])
def test_bench_throughput_refuses_options_it_would_ignore(flags, capsys):
    from tokenmill.cli import main
    assert main(["bench", "throughput", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tokenmill: ") and "Traceback" not in err


def test_sampling_params_keep_float32_meanings_and_samples_wrap_their_seeds():
    """The sampler holds top_p and the repetition penalty in float32: a top_p of 1e-300 stays above
    0 there (the kernel refused 0 and failed the whole step), a penalty stays finite and nonzero.
    The j-th of n samples gets seed + j, wrapped within 64 bits."""
    import torch
    assert torch.tensor(SamplingParams(top_p=1e-300).top_p, dtype=torch.float32) > 0
    for penalty in (1e-46, 1e39):
        value = torch.tensor(SamplingParams(repetition_penalty=penalty).repetition_penalty, dtype=torch.float32)
        assert 0 < value < float("inf")
    p = SamplingParams(n=3, seed=2 ** 63 - 1)
    assert [p.for_sample(j).seed for j in range(3)] == [2 ** 63 - 1, -(2 ** 63), -(2 ** 63) + 1]
    assert p.for_sample(1).n == 1 and SamplingParams(n=2).for_sample(1).seed is None


def test_a_seed_of_none_draws_one():
    seeds = {EngineConfig(seed=None).seed for _ in range(3)}
    assert len(seeds) == 3 and all(isinstance(s, int) for s in seeds)
    with pytest.raises(ValueError, match="seed"):
        EngineConfig(seed="x")


def test_vllm_dtype_names_are_accepted():
    assert EngineConfig(dtype="half").dtype == "float16" and EngineConfig(dtype="float").dtype == "float32"
    assert EngineConfig(dtype="auto").torch_dtype_name == "float32"
    assert EngineConfig(device="cuda", dtype="auto").torch_dtype_name == "bfloat16"


def test_cli_boolean_options_take_a_bare_flag_a_value_or_no():
    """A bare flag before a positional argument does not take it as its value."""
    from tokenmill.cli import build_parser, explicit_bool_values

    def parse(*argv):
        return build_parser().parse_args(explicit_bool_values(list(argv)))
    args = parse("generate", "hi", "--enforce-eager", "--no-enable-prefix-caching", "--gguf-blocks", "false",
                 "--dtype", "half")
    assert args.enforce_eager is True and args.enable_prefix_caching is False and args.gguf_blocks is False
    assert parse("generate", "hi").enable_prefix_caching is True
    args = parse("generate", "--enforce-eager", "Hello world", "--gguf-blocks", "off")
    assert args.enforce_eager is True and args.prompts == ["Hello world"] and args.gguf_blocks is False
    args = parse("serve", "--enforce-eager", "/models/m.gguf")
    assert args.enforce_eager is True and args.model == "/models/m.gguf"


def test_a_cuda_device_gets_its_index_and_needs_cuda(monkeypatch):
    """torch.cuda.set_device refuses "cuda" without an index: the engine resolves it to the current
    GPU. Without CUDA, an error before anything loads."""
    import torch

    from tokenmill.engine_parts import resolve_device
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1) and resolve_device("cuda:0") == torch.device("cuda", 0)


def test_seeds_past_32_bits_are_mixed_not_cut_on_the_cpu():
    """The CPU generator keeps a seed's low 32 bits: seeds 1 and 2^32 + 1 drew the same numbers."""
    import torch

    from tokenmill.model_runner import seed_bits
    cpu = torch.device("cpu")
    assert [seed_bits(s, cpu) for s in (0, 1, 2 ** 32 - 1)] == [0, 1, 2 ** 32 - 1]  # unchanged
    seeds = (0, 1, 2 ** 32 + 1, -1, 2 ** 63 - 1, -(2 ** 63), 2 ** 32)
    assert len({seed_bits(s, cpu) for s in seeds}) == len(seeds) and all(0 <= seed_bits(s, cpu) < 2 ** 32
                                                                          for s in seeds)
    assert seed_bits(2 ** 40, torch.device("cuda")) == 2 ** 40


def test_cli_refuses_a_bad_port_and_a_missing_gpu_before_loading(capsys):
    """A port out of range is a usage error, not a traceback after the model loaded; so is a CUDA
    device on a torch without one (the engine checks before loading anything)."""
    import torch

    from tokenmill.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "99999"])
    assert exit_info.value.code == 2 and "port" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["generate", "hi", "--device", "cuda", "--model", "/nonexistent"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("tokenmill: device 'cuda'") and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["bench", "spec", "--concurrency", "1", "0"],     # 0 concurrent requests never ended
    ["bench", "spec", "--num-passages", "0"],
    ["bench", "serve", "--request-rate", "0"], ["bench", "serve", "--burstiness", "0"],
    ["bench", "serve", "--max-concurrency", "-1"], ["bench", "serve", "--num-prompts", "0"],
    ["bench", "throughput", "--num-requests", "0"],
    ["serve", "--max-body-bytes", "0"],                  # a server that refused every request
])
def test_counts_and_rates_that_measure_or_serve_nothing_are_usage_errors(argv, capsys):
    from tokenmill.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "must be" in capsys.readouterr().err


def test_kv_transfer_options_are_checked_before_anything_loads():
    with pytest.raises(ValueError, match="kv_role must be one of"):
        EngineConfig(kv_role="producer")
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        EngineConfig(kv_role="decode", kv_connector="p2p", kv_storage_path="/tmp")
    with pytest.raises(ValueError, match="needs kv_storage_path"):
        EngineConfig(kv_role="prefill")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(kv_role="both", kv_storage_path="/tmp", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"kv_side_channel_port must be in \[0, 65535\], got 70000"):
        EngineConfig(kv_role="prefill", kv_connector="nixl", kv_side_channel_port=70000)
    with pytest.raises(ValueError, match="kv_hold_timeout must be positive seconds, got 0"):
        EngineConfig(kv_role="prefill", kv_connector="nixl", kv_hold_timeout=0)
    with pytest.raises(ValueError, match="kv_transfer_timeout must be positive seconds, got -1"):
        EngineConfig(kv_role="decode", kv_connector="nixl", kv_transfer_timeout=-1)
    assert EngineConfig(kv_role="decode", kv_connector="nixl").kv_side_channel_port == 0  # no directory needed
    with pytest.raises(ValueError, match="kv_transfer_params"):
        SamplingParams(kv_transfer_params=["do_remote_decode"])


def _model_config(**kwargs) -> ModelConfig:
    return ModelConfig(architecture="mistral", vocab_size=80, hidden_size=64, intermediate_size=96, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, **kwargs)


def test_layer_windows_give_each_layers_window_and_the_kv_window_only_when_all_slide():
    assert _model_config().window(1) is None and _model_config().kv_window is None
    mixed = _model_config(layer_windows=(None, 32))
    assert (mixed.window(0), mixed.window(1), mixed.kv_window) == (None, 32, None)
    assert _model_config(layer_windows=(16, 32)).kv_window == 32


@pytest.mark.parametrize("windows,match", [((32,), "layer_windows has 1 entries for 2 layers"),
                                           ((32, 0), "layer_windows must be positive or None")])
def test_bad_layer_windows_are_refused(windows, match):
    with pytest.raises(ValueError, match=match):
        _model_config(layer_windows=windows)


@pytest.mark.parametrize("dtype,rows,choice", [(None, None, None), ("float32", None, 0), (None, 8, 8),
                                               ("float32", 8, 8), ("bfloat16", None, None), (None, 0, 0)])
def test_gguf_int8_rows_left_to_the_cpu_unless_set_or_dtype_is_float32(dtype, rows, choice):
    assert EngineConfig(dtype=dtype, gguf_int8_rows=rows).int8_rows_choice == choice


def test_the_cpus_choice_is_every_step_with_vnni_and_none_without():
    from types import SimpleNamespace

    from tokenmill.models.cpu_packing import EVERY_STEP, int8_rows_by_cpu
    assert int8_rows_by_cpu(SimpleNamespace(vnni=True)) == EVERY_STEP
    assert int8_rows_by_cpu(SimpleNamespace(vnni=False)) == 0
