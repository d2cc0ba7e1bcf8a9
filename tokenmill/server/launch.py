"""`tokenmill serve`: build the engine, run the app under uvicorn, and shut down cleanly.

On SIGINT/SIGTERM uvicorn stops accepting connections; first, every in-flight request is
ended (finish_reason "abort"), so open streams get their final chunk and [DONE] before the
connections close, and the process exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from tokenmill.cli_args import at_least_one
from tokenmill.server.api import create_app
from tokenmill.server.reasoning import REASONING_PARSERS
from tokenmill.server.tools import PARSERS

API_KEY_ENV = "TOKENMILL_API_KEY"

logger = logging.getLogger("tokenmill.server")


def port_number(text: str) -> int:
    """A TCP port, checked before the model loads (not after, by bind)."""
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return int(text)


def seconds(text: str) -> float:
    """A positive, finite number of seconds, checked before the model loads."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use is one line at once, not
    uvicorn's error after the load, and the address logged is the one bound (port 0: the port
    the system chose)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:  # a host name that does not resolve
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:  # in use, or a port below 1024 without the right
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="HF directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize "
                             f"(any local user can read a command line: prefer --api-key-file or {API_KEY_ENV})")
    parser.add_argument("--api-key-file", default=None,
                        help="read the key from the first line of this file")
    parser.add_argument("--served-model-name", default=None, help="model name clients send (default: from path)")
    parser.add_argument("--max-body-bytes", type=at_least_one, default=4 * 1024 * 1024,
                        help="larger bodies get HTTP 413")
    parser.add_argument("--stream-write-timeout", type=seconds, default=60.0,
                        help="end a stream whose client takes no output for this many seconds, and abort its "
                             "requests (until then a client that stops reading holds one output per request)")
    parser.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                        help="the model's tool-call format, for tool_choice 'auto' (hermes: Qwen 2.5/3, Hermes; "
                             "llama3_json: Llama 3.1+; mistral: Mistral's [TOOL_CALLS]; pythonic: Llama 3.2/4)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="return <think> blocks as reasoning_content (qwen3; deepseek_r1: templates that open "
                             "the block themselves)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's flag, accepted: tool_choice 'auto' is on whenever --tool-call-parser is given")


def resolve_api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The key clients must send: --api-key, else the first line of --api-key-file, else the
    environment's TOKENMILL_API_KEY (neither of the last two shows in `ps` or /proc/PID/cmdline);
    None for none. SystemExit for both flags, or a file that cannot be read or holds no key."""
    if args.api_key is not None and args.api_key_file is not None:
        raise SystemExit("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            key = Path(args.api_key_file).read_text().partition("\n")[0].strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"--api-key-file: cannot read {args.api_key_file}: {exc}") from None
        if not key:
            raise SystemExit(f"--api-key-file: {args.api_key_file} holds no key on its first line")
        return key
    return args.api_key if args.api_key is not None else (environ.get(API_KEY_ENV) or None)


def run_server(args: argparse.Namespace, config) -> int:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (" + " or ".join(PARSERS) + ")")
    args.api_key = resolve_api_key(args, os.environ)
    with bind(args.host, args.port) as sock:
        return _serve(args, config, sock)


def _serve(args: argparse.Namespace, config, sock: socket.socket) -> int:
    """Load the engine and serve on `sock` until a signal ends the server."""
    import uvicorn

    from tokenmill.engine import LLMEngine

    engine = LLMEngine(dataclasses.replace(config, model=args.model))
    name = args.served_model_name or engine.model_path.stem
    app = create_app(engine, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                     stream_write_timeout=args.stream_write_timeout)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # End in-flight requests first, so open streams get a final chunk before connections close.
            app.state.async_engine.abort_all()
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after shutdown (the exit status would say "killed");
            # this shutdown is the clean one the signal asked for, so exit 0.
            self._captured_signals.clear()

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, access_log=False,
                                   log_level=logging.getLevelName(logging.getLogger().level).lower(),
                                   timeout_graceful_shutdown=10))
    logger.warning("serving %s as %r on http://%s:%d", engine.model_path, name, args.host, sock.getsockname()[1])
    server.run(sockets=[sock])
    return 0
