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

_ENGINE_HELP = {
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "per-step token budget (decodes + prompt chunks)",
    "max_model_len": "context length (prompt + output)",
    "kv_cache_memory": "KV pool size, bytes or a string like 2GiB",
    "num_kv_blocks": "exact KV pool size in blocks",
    "gguf_blocks": "CPU: keep GGUF projections and MXFP4 experts in their blocks (bit-identical to float32)",
    "gguf_int8_rows": "CPU, GGUF blocks: steps of up to N rows take x in 8-bit blocks, as llama.cpp "
                      "(faster, perplexity +0.75%%, results then depend on the step's size; 0: off; "
                      "default: every step on a CPU with VNNI unless --dtype float32)",
    "kv_cache_dtype": "CPU: the KV pool's type, 'float16' or 'bfloat16' (half float32's bytes), or 'int8' "
                      "(8-bit codes and a scale per token and head: 0.53x float16's bytes; the C++ kernels only) "
                      "(default 'auto': the model's, or float16 for a GGUF on a CPU with AVX512-VNNI, "
                      "bfloat16 for float weights on one with AVX512-BF16)",
    "num_threads": "CPU: threads for a step, fixed (default: the cores other processes leave free, "
                   "followed as they change)",
    "trace_file": "write the engine's steps and each request's timeline to this file as Chrome trace JSON "
                  "(chrome://tracing, ui.perfetto.dev)",
    "tensor_parallel_size": "split each layer over N ranks (processes on the CPU, GPUs on CUDA), "
                            "rank 0 in this process",
    "distributed_timeout": "tensor parallelism: seconds a rank waits on a collective or startup before failing",
    "kv_role": "disaggregated prefill/decode: 'prefill' keeps finished prompts' K/V for a decode instance "
               "(requests with kv_transfer_params do_remote_decode), 'decode' loads it (do_remote_prefill), 'both'",
    "kv_connector": "how K/V moves between instances: 'shared_storage' (block files in --kv-storage-path), "
                    "'nixl' (the decode instance reads the prefill instance's blocks over NIXL)",
    "kv_storage_path": "shared_storage: a directory both the prefill and the decode instance see",
    "kv_side_channel_host": "nixl, prefill: the address decode instances fetch this instance's NIXL metadata at",
    "kv_side_channel_port": "nixl, prefill: the TCP port for that metadata (0: any free one; the params name it)",
    "kv_hold_timeout": "nixl, prefill: seconds a finished prompt's blocks are held for a decode instance to read",
    "kv_transfer_timeout": "nixl, decode: seconds a read of remote blocks may take before the prompt is computed here",
    "enforce_eager": "CUDA: launch every step from Python, no decode graphs",
    "async_output": "build a step's outputs while the next step runs (default: on for CUDA)",
    "async_scheduling": "schedule and launch the next step before this one's tokens reach the host "
                        "(default: on for CUDA without speculation)",
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
        help_text = f"{_ENGINE_HELP.get(f.name, f.name.replace('_', ' '))} (default: {default})"
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
