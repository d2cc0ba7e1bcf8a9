"""`tokenmill serve`'s command line and socket: its options, checked as they are read, where its
API key comes from, which Host names it answers, and the socket bound before the model loads.

Light on purpose: `tokenmill --help`, a usage error and the router's own command line read this
module without importing torch, transformers or the engine (server/launch.py does that, once the
command line is good).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from tokenmill.cli_args import MODEL_HELP, at_least_one
from tokenmill.server.access import LOOPBACK_HOSTS, host_entry
from tokenmill.server.connections import connection_cap, raise_open_file_limit
from tokenmill.server.reasoning import REASONING_PARSERS
from tokenmill.server.tools import HARMONY, PARSERS

API_KEY_ENV = "TOKENMILL_API_KEY"


def port_number(text: str) -> int:
    """A TCP port, checked before the model loads (not after, by bind)."""
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return int(text)


def seconds(text: str) -> float:
    """A timeout: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def non_negative(text: str) -> float:
    """A number that may be 0 (a wait that may be none, a weight): finite and >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def count(text: str) -> int:
    """A number of things kept: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
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
    parser.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=port_number, default=8000, help="(default: %(default)s)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize, /detokenize and the "
                             "dashboard's data (open /dashboard#key=KEY) "
                             f"(any local user can read a command line: prefer --api-key-file or {API_KEY_ENV})")
    parser.add_argument("--api-key-file", default=None,
                        help="read the key from the first line of this file")
    parser.add_argument("--protect-metrics-and-docs", action="store_true",
                        help="require the API key on /metrics, /docs, /redoc and /openapi.json too")
    parser.add_argument("--allowed-hosts", default=None,
                        help="comma-separated names the Host header may give (any port), '*' for any; others get "
                             "HTTP 400 (default, against DNS rebinding: on a loopback address without an API key, "
                             "localhost, 127.0.0.1 and [::1]; else any)")
    add_allowed_origins_arg(parser)
    parser.add_argument("--served-model-name", default=None, help="model name clients send (default: from path)")
    parser.add_argument("--max-body-bytes", type=at_least_one, default=4 * 1024 * 1024,
                        help="larger bodies get HTTP 413 (default: %(default)s, 4 MiB)")
    parser.add_argument("--timeout-keep-alive", type=seconds, default=5.0,
                        help="close a connection idle this many seconds, before its first request or after a response "
                             "(default: %(default)s)")
    parser.add_argument("--timeout-request-headers", type=seconds, default=10.0,
                        help="close a connection whose request line and headers are not all in this many seconds "
                             "after their first byte (slowloris) (default: %(default)s)")
    parser.add_argument("--timeout-request-body", type=seconds, default=30.0,
                        help="close a connection whose request body stops coming: no byte of it for this many "
                             "seconds (default: %(default)s)")
    parser.add_argument("--max-connections", type=at_least_one, default=1024,
                        help="past this many open connections a new one's request gets HTTP 503 (lowered to fit "
                             "the open-file limit, whose soft value serve raises to the hard one; "
                             "default: %(default)s)")
    parser.add_argument("--otlp-traces-endpoint", default=None,
                        help="export one OpenTelemetry span per request to this OTLP/HTTP collector "
                             "(e.g. http://localhost:4318); a W3C traceparent header makes it a child span")
    parser.add_argument("--request-log-size", type=count, default=1000,
                        help="GET /v1/requests/{id} answers for live requests and the last this many responses "
                             "that ended (0: none; default: %(default)s)")
    parser.add_argument("--responses-store-size", type=count, default=1000,
                        help="keep the conversations of the last this many stored /v1/responses answers for "
                             "previous_response_id (0: none; least recently used forgotten first; "
                             "default: %(default)s)")
    parser.add_argument("--stream-write-timeout", type=seconds, default=60.0,
                        help="end a stream whose client takes no output for this many seconds, and abort its "
                             "requests (until then a client that stops reading holds one output per request) "
                             "(default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=non_negative, default=0.0,
                        help="at SIGINT/SIGTERM, seconds the requests in flight have to finish while the server "
                             "takes no new ones (it closes its socket; a request that still comes on an open "
                             "connection gets a 503), before the rest are ended; 0: end them at once (vLLM's flag "
                             "and default; default: %(default)s)")
    parser.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                        help="the model's tool-call format, for tool_choice 'auto' (default: the one its chat template "
                             "shows; hermes: Qwen 2.5/3, Hermes; "
                             "llama3_json: Llama 3.1+; mistral: Mistral's [TOOL_CALLS]; phi4_mini_json: Phi-4-mini's "
                             "<|tool_call|> or functools[...]; pythonic: Llama 3.2/4)")
    parser.add_argument("--reasoning-parser", choices=(*REASONING_PARSERS, HARMONY), default=None,
                        help="return <think> blocks as reasoning_content (qwen3; deepseek_r1: templates that open "
                             "the block themselves; harmony: gpt-oss's channels and tool calls, its default)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's flag, accepted: tool_choice 'auto' is on whenever the tool-call format is known "
                             "(from the chat template or --tool-call-parser)")


def resolve_api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The key clients must send: --api-key, else the first line of --api-key-file, else the
    environment's TOKENMILL_API_KEY (neither of the last two shows in `ps` or /proc/PID/cmdline);
    None for none. SystemExit for both flags, a blank --api-key (as `--api-key "$KEY"` gives with
    KEY unset: a server no key could open), or a file that cannot be read or holds no key."""
    if args.api_key is not None and args.api_key_file is not None:
        raise SystemExit("give --api-key or --api-key-file, not both")
    if args.api_key is not None and not args.api_key.strip():
        raise SystemExit("--api-key: the key is blank (leave the flag out to serve without a key)")
    if args.api_key_file is not None:
        try:
            key = Path(args.api_key_file).read_text().partition("\n")[0].strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"--api-key-file: cannot read {args.api_key_file}: {exc}") from None
        if not key:
            raise SystemExit(f"--api-key-file: {args.api_key_file} holds no key on its first line")
        return key
    return args.api_key if args.api_key is not None else (environ.get(API_KEY_ENV) or None)


def resolve_allowed_hosts(flag: str | None, host: str, address: str, api_key: str | None) -> list[str] | None:
    """The Host header names to answer (None: any). --allowed-hosts when given ('*': any); else,
    for a server on the loopback `address` without an API key, its loopback names and `host`
    (a page's DNS rebinding reaches only such a server; a key guards it, and a server on another
    address is reached under names this one cannot know)."""
    if flag is not None:
        names = [name.strip() for name in flag.split(",") if name.strip()]
        if not names:
            raise SystemExit("--allowed-hosts: give host names, or '*' for any")
        return None if "*" in names else names
    if api_key is not None or not ipaddress.ip_address(address.partition("%")[0]).is_loopback:
        return None
    return sorted({*LOOPBACK_HOSTS, host_entry(host)})


def add_allowed_origins_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allowed-origins", default=None,
                        help="comma-separated web origins (scheme://host[:port]) whose pages may call the API and "
                             "read its answers (CORS), '*' for any; vLLM's JSON list is read too (default: none, "
                             "so no other site's page can use the server through its visitors' browsers; vLLM's "
                             "default is '*')")


def resolve_allowed_origins(flag: str | None) -> list[str] | None:
    """--allowed-origins as a list (None: no cross-origin access): comma-separated, or a JSON list
    as vLLM's flag takes it ('["*"]')."""
    if flag is None:
        return None
    try:
        origins = json.loads(flag) if flag.lstrip().startswith("[") else flag.split(",")
    except ValueError:
        raise SystemExit(f"--allowed-origins: {flag!r} is not a JSON list") from None
    if not all(isinstance(o, str) for o in origins):
        raise SystemExit(f"--allowed-origins: a JSON list of strings, got {flag!r}")
    origins = [o.strip().rstrip("/") for o in origins if o.strip()]
    if not origins or any(o != "*" and "://" not in o for o in origins):
        raise SystemExit(f"--allowed-origins: give origins such as https://app.example or http://localhost:3000, "
                         f"or '*' for any; got {flag!r}")
    return origins


def listen(args: argparse.Namespace) -> socket.socket:
    """Everything about `serve`'s command line that can fail before the model loads, checked, and
    the socket bound: `args` gets its API key, connection cap, Host allow-list and CORS origins
    filled in."""
    args.api_key = resolve_api_key(args, os.environ)
    if args.protect_metrics_and_docs and args.api_key is None:
        raise SystemExit(f"--protect-metrics-and-docs needs an API key (--api-key, --api-key-file or {API_KEY_ENV})")
    args.max_connections = connection_cap(args.max_connections, raise_open_file_limit())
    sock = bind(args.host, args.port)
    args.allowed_hosts = resolve_allowed_hosts(args.allowed_hosts, args.host, sock.getsockname()[0], args.api_key)
    args.allowed_origins = resolve_allowed_origins(args.allowed_origins)
    return sock
