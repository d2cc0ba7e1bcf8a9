"""device.py's choices that depend on the CPU: the KV pool's dtype."""

import torch

from tokenmill.config import EngineConfig
from tokenmill.cpu_kernels import this_cpu
from tokenmill.device import activation_dtype, kv_dtype_name

CPU = torch.device("cpu")


def test_quantized_weights_on_a_cpu_with_avx512_vnni_get_a_float16_pool_unless_a_dtype_is_set():
    auto = "float16" if this_cpu().has("avx512_vnni") else "float32"
    assert kv_dtype_name(EngineConfig(), True, CPU) == auto
    assert kv_dtype_name(EngineConfig(dtype="float32"), True, CPU) == "float32"
    assert kv_dtype_name(EngineConfig(kv_cache_dtype="bfloat16"), True, CPU) == "bfloat16"


def test_float_weights_on_a_cpu_with_avx512_bf16_get_a_bfloat16_pool_unless_a_dtype_is_set():
    """There the products take bfloat16 weights (EngineConfig.bf16_weights_choice)."""
    auto = "bfloat16" if this_cpu().has("avx512_bf16") else "float32"
    assert kv_dtype_name(EngineConfig(), False, CPU) == auto
    assert kv_dtype_name(EngineConfig(dtype="float32"), False, CPU) == "float32"
    assert kv_dtype_name(EngineConfig(kv_cache_dtype="float16"), False, CPU) == "float16"


def test_bfloat16_on_a_cpu_with_avx512_bf16_runs_float32_between_bfloat16_products():
    """There dtype="bfloat16" takes the defaults' arithmetic (bfloat16 weights and pool); elsewhere,
    with torch's kernels, or on CUDA, the model itself is bfloat16."""
    bf16 = this_cpu().has("avx512_bf16")
    config = EngineConfig(dtype="bfloat16")
    assert activation_dtype(config, CPU) == (torch.float32 if bf16 else torch.bfloat16)
    assert config.bf16_weights_choice is True and kv_dtype_name(config, False, CPU) == "bfloat16"
    assert activation_dtype(EngineConfig(dtype="bfloat16", kernels="torch"), CPU) == torch.bfloat16
    assert activation_dtype(config, torch.device("cuda", 0)) == torch.bfloat16
    assert activation_dtype(EngineConfig(), CPU) == torch.float32
    assert EngineConfig().bf16_weights_choice is None and EngineConfig(dtype="float32").bf16_weights_choice is False
