"""`tokenmill bench`: throughput | serve | spec | roofline. Each prints a table of figures measured
side by side in one run, and can save JSON (--json); throughput and serve also plots (--plot DIR)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from tokenmill.cli_args import MODEL_HELP, add_engine_args, at_least_one


def positive(text: str) -> float:
    """A request rate or a burstiness (inf allowed: all at once)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def slo(text: str) -> dict[str, float]:
    """--slo ttft=MS,tpot=MS, read with the command line: a typo found only after the run would
    have thrown the run away."""
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        try:
            ms = float(value)
        except ValueError:
            ms = 0.0
        if key not in ("ttft", "tpot") or not 0 < ms < float("inf"):
            raise argparse.ArgumentTypeError(f"expected ttft=MS,tpot=MS (milliseconds > 0), got {text!r}")
        out[key] = ms
    return out


class LengthRange(argparse.Action):
    """MIN MAX token counts (--prompt-len, --output-len; each at least 1 by its type): MIN above
    MAX is a usage error here, not randint's "empty range" once a model or a server is up."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        low, high = values
        if low > high:
            raise argparse.ArgumentError(self, f"MIN ({low}) is above MAX ({high})")
        setattr(namespace, self.dest, values)


def _nearest_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def json_path(text: str) -> Path:
    """--json PATH: a file that can be written (or made, folders and all), checked before the
    run, not found out after it."""
    path = Path(text)
    if path.exists():
        if path.is_dir() or not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"cannot write the file {text!r}")
    elif not _writable_dir(existing := _nearest_existing(path.parent)):
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: {str(existing)!r} is not a writable folder")
    return path


def plot_dir(text: str) -> Path:
    """--plot DIR: a folder that can be written into (or made), checked before the run."""
    existing = _nearest_existing(Path(text))
    if not _writable_dir(existing):
        raise argparse.ArgumentTypeError(f"cannot write plots into {text!r}: {str(existing)!r} is not a "
                                         "writable folder")
    return Path(text)


def _add_random_workload_args(p: argparse.ArgumentParser) -> None:
    """The random workload's size (its defaults: the default workload, 64 requests)."""
    p.add_argument("--num-requests", type=at_least_one, default=64, help="(default: %(default)s)")
    p.add_argument("--prompt-len", type=at_least_one, nargs=2, action=LengthRange, default=[32, 256],
                   metavar=("MIN", "MAX"), help="prompt lengths, uniform in [MIN, MAX] (default: 32 256)")
    p.add_argument("--output-len", type=at_least_one, nargs=2, action=LengthRange, default=[32, 256],
                   metavar=("MIN", "MAX"), help="output lengths, uniform in [MIN, MAX] (default: 32 256)")
    p.add_argument("--dataset-seed", type=int, default=0, help="(default: %(default)s)")


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)

    p = sub.add_parser("throughput", help="offline throughput through the engine API")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--workload", choices=["random", "prefix", "long"], default="random")
    _add_random_workload_args(p)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0: nucleus sampling")
    p.add_argument("--compare", action="store_true",
                   help="also run static batching and Hugging Face generate on the same requests")
    p.add_argument("--pressure", action="store_true",
                   help="also run with the KV pool cut to a quarter of the peak the workload used")
    p.add_argument("--json", type=json_path, default=None, help="write results as JSON here")
    p.add_argument("--plot", type=plot_dir, default=None, help="write PNG plots into this directory")
    add_engine_args(p)

    p = sub.add_parser("serve", help="online latency/throughput over HTTP (any OpenAI-compatible server)")
    p.add_argument("--base-url", default=None, help="server to test (default: start `tokenmill serve` here)")
    p.add_argument("--model", default=None, help="model for the server this command starts: " + MODEL_HELP)
    p.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--request-rate", type=positive, nargs="+", default=[float("inf")],
                   help="requests per second, one run per value (inf: all at once)")
    p.add_argument("--burstiness", type=positive, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=at_least_one, default=None)
    p.add_argument("--num-prompts", type=at_least_one, default=64)
    p.add_argument("--prompt-len", type=at_least_one, nargs=2, action=LengthRange, default=[32, 256],
                   metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=at_least_one, nargs=2, action=LengthRange, default=[32, 128],
                   metavar=("MIN", "MAX"))
    p.add_argument("--dataset-seed", type=int, default=0,
                   help="seed of the first rate's prompts; each further rate draws new ones (seed + 1, ...)")
    p.add_argument("--max-seconds", type=float, default=600, help="stop sending new requests after this")
    p.add_argument("--slo", type=slo, default=None, help="goodput SLO, e.g. ttft=2000,tpot=200 (milliseconds)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="leave out vLLM's ignore_eos field, for servers that reject it (transformers "
                        "serve): outputs then end at EOS or --output-len, and only tokens received count")
    p.add_argument("--text-prompts", action="store_true",
                   help="send each prompt as text (its token ids decoded with --model's tokenizer) for servers "
                        "that take only strings (transformers serve); the server's token count may differ")
    p.add_argument("--json", type=json_path, default=None)
    p.add_argument("--plot", type=plot_dir, default=None)
    add_engine_args(p)

    p = sub.add_parser("spec", help="speculative decoding on a repeat-the-passage workload")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--concurrency", type=at_least_one, nargs="+", default=[1, 4, 32])
    p.add_argument("--min-requests", type=at_least_one, default=4, help="requests per concurrency at least")
    p.add_argument("--num-passages", type=at_least_one, default=None,
                   help="distinct passages (default: max concurrency)")
    p.add_argument("--passage-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=240)
    p.add_argument("--json", type=json_path, default=None)
    add_engine_args(p)

    p = sub.add_parser("roofline", help="measured GEMM peak and memory bandwidth vs the engine")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    _add_random_workload_args(p)
    p.add_argument("--json", type=json_path, default=None)
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    from tokenmill.cpu_kernels import this_cpu
    cpu = this_cpu()
    print(f"CPU: {cpu.describe()}")
    if args.bench == "throughput":
        from tokenmill.bench.cli import bench_throughput
        results = bench_throughput(args)
    elif args.bench == "serve":
        from tokenmill.bench.serve import bench_serve
        results = bench_serve(args)
    elif args.bench == "spec":
        from tokenmill.bench.spec import bench_spec
        if args.speculative is None:
            args.speculative = "ngram"
        results = bench_spec(args)
    elif args.bench == "roofline":
        from tokenmill.bench.roofline import bench_roofline
        results = bench_roofline(args)
    else:
        raise ValueError(f"unknown benchmark {args.bench!r}")
    results["cpu"] = cpu.as_dict()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=_jsonable))
        print(f"results written to {args.json}")
    if args.bench == "serve" and not any(row["completed"] for row in results["rows"]):
        print("tokenmill: bench serve: every request failed, nothing was measured (errors above)", file=sys.stderr)
        return 1
    return 0


def _jsonable(obj):
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(type(obj).__name__)
