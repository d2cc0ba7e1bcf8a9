"""tokenmill command line: generate | chat | serve | router | bench.

Engine options are generated from EngineConfig's fields (cli_args.py), so every option the Python API
takes is also a flag (`--max-num-seqs 64`, `--kv-cache-memory 2GiB`, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import TYPE_CHECKING

from tokenmill.cli_args import MODEL_HELP, add_engine_args, engine_config_from_args, explicit_bool_values

if TYPE_CHECKING:
    from tokenmill.outputs import RequestOutput


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="most tokens per answer (default: 128)")
    group.add_argument("--temperature", type=float, default=0.7, help="0: greedy (default: 0.7)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k best tokens (default: 0, off)")


def _sampling_params(args):
    from tokenmill.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k)


def cmd_generate(args) -> int:
    """Every prompt runs at once (continuous batching); the answers are printed in the prompts'
    order, each as soon as it and those before it are done (not all at the end)."""
    from tokenmill.engine import LLMEngine
    engine = LLMEngine(engine_config_from_args(args))
    prompts = args.prompts or [sys.stdin.read()]
    params = _sampling_params(args).clone(output_kind="final")
    # every prompt checked before any runs (as LLM.generate); past the context, an answer ends there
    make = engine.input_processor.make_request
    requests = [make(str(i), p, params, fit_to_context=True) for i, p in enumerate(prompts)]
    for request in requests:
        engine.add(request)
    done: dict[int, RequestOutput] = {}
    failed = 0
    for i in range(len(prompts)):
        while i not in done and engine.has_unfinished_requests():
            done.update((int(out.request_id), out) for out in engine.step() if out.finished)
        failed += _print_answer(done.pop(i), separate=len(prompts) > 1)
    return 1 if failed else 0


def _print_answer(out: RequestOutput, separate: bool) -> bool:
    """Print one prompt's answer (flushed: a pipe sees it now); True if it failed."""
    if out.error is not None:
        print(f"tokenmill: generation failed: {out.error}", file=sys.stderr, flush=True)
        return True
    print(out.prompt + out.outputs[0].text if out.prompt else out.outputs[0].text, flush=True)
    if separate:
        print("-" * 40, flush=True)
    return False


def cmd_chat(args) -> int:
    """An interactive chat that streams each answer as it is generated."""
    from tokenmill.llm import LLM
    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    engine = llm.engine
    engine.input_processor.check_generates()  # an encoder: said now, not at the first message
    start = [{"role": "system", "content": args.system}] if args.system else []
    if start:  # a system prompt that leaves no room would fail every message: said once, up front
        used = len(llm.render_chat(start)["prompt_token_ids"])
        if used + args.max_tokens >= engine.max_model_len:
            raise ValueError(f"--system: the system prompt takes {used} tokens, and with --max-tokens "
                             f"{args.max_tokens} leaves no room for a message in the context of "
                             f"{engine.max_model_len} tokens")
    history: list[dict] = list(start)
    turn = 0
    print("tokenmill chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()  # end the prompt's line
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        try:
            engine.add_request(f"chat-{turn}", llm.render_chat(history), _sampling_params(args))
        except ValueError as exc:  # the conversation no longer fits the context: start over with this message
            print(f"tokenmill: {exc}; the conversation starts over", file=sys.stderr)
            history = [*start, history[-1]]
            try:
                engine.add_request(f"chat-{turn}", llm.render_chat(history), _sampling_params(args))
            except ValueError as exc:  # the message alone does not fit either
                print(f"tokenmill: {exc}", file=sys.stderr)
                history = list(start)
                turn += 1
                continue
        answer = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.new_text, end="", flush=True)
                answer.append(out.new_text)
        print()
        history.append({"role": "assistant", "content": "".join(answer)})
        turn += 1
    return 0


def cmd_serve(args) -> int:
    from tokenmill.server.options import listen
    with listen(args) as sock:  # a bad key, flag or port: one line now, before torch and the model load
        from tokenmill.server.launch import run_server
        return run_server(args, engine_config_from_args(args), sock)


def cmd_router(args) -> int:
    from tokenmill.router.launch import run_router
    return run_router(args)


def cmd_bench(args) -> int:
    from tokenmill.bench import main as bench_main
    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="A small, clear LLM inference engine.")
    parser.add_argument("--log-level", default=None, help="default: INFO for serve, WARNING otherwise")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate from prompts given as arguments (or stdin)",
                       description="Generate from prompts given as arguments (or stdin). The prompts run together; "
                                   "each answer is printed, in the prompts' order, as soon as it and the ones "
                                   "before it are done.")
    p.add_argument("prompts", nargs="*")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat through the model's chat template")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--system", default=None, help="a system prompt")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)

    from tokenmill.server.options import add_serve_args
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    from tokenmill.router.launch import add_router_args
    p = sub.add_parser("router", help="one OpenAI-compatible front over several `serve` replicas, routing by prefix",
                       description="Route OpenAI-compatible requests over several `tokenmill serve` replicas: to the "
                                   "one that holds the longest prefix of the prompt in its cache while loads are "
                                   "even, else the least loaded; unhealthy replicas are left out, and a request "
                                   "that fails before its first byte is retried on another.")
    add_router_args(p)
    p.set_defaults(func=cmd_router)

    from tokenmill.bench import add_bench_args
    p = sub.add_parser("bench", help="throughput, serving, speculation and roofline benchmarks")
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)
    return parser


def _torchrun_rank_other_than_0() -> bool:
    """torchrun started this process as a tensor-parallel rank other than 0 (read from its variables
    here, without importing torch)."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and os.environ.get("RANK", "0") != "0"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(explicit_bool_values(sys.argv[1:] if argv is None else argv))
    try:  # bad engine or sampling options: usage errors now, not errors after the model loaded
        if hasattr(args, "max_num_seqs"):
            engine_config_from_args(args)
        if args.command in ("generate", "chat"):
            _sampling_params(args)
        if getattr(args, "bench", None) == "throughput":
            from tokenmill.sampling_params import SamplingParams
            SamplingParams(temperature=args.temperature, top_p=args.top_p)
    except ValueError as e:
        parser.error(str(e))
    level = args.log_level or ("INFO" if args.command in ("serve", "router") else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if hasattr(args, "max_num_seqs") and _torchrun_rank_other_than_0():
            # this process runs its shard of the steps that rank 0, which runs the command, sends
            from tokenmill.tp_rank import run_torchrun_rank
            run_torchrun_rank(engine_config_from_args(args))
            return 0
        return args.func(args)
    except (ValueError, OSError, MemoryError) as exc:  # a model that cannot be found or loaded, a pool too
        logging.getLogger("tokenmill").debug("the error in full", exc_info=True)  # big: a message, not a traceback
        print(f"tokenmill: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for it, without a traceback
        print("tokenmill: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
