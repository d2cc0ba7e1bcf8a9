"""`tokenmill router`: its command line, and the app under uvicorn.

    tokenmill router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 [--port 8000]
                     [--policy cache_aware|round_robin|least_loaded]
    tokenmill router --prefill http://127.0.0.1:8001 --replica http://127.0.0.1:8002   (prefill / decode)

The socket is bound, the Host allow-list chosen and connections guarded as `tokenmill serve`
does them (server/options.py, server/connections.py). The router holds no API key: a client's
Authorization header goes on to the replicas, which check it; so a loopback router answers only
loopback Host names unless --allowed-hosts says otherwise.

On SIGINT/SIGTERM the router takes no new connections and lets what is in flight finish for
--drain-timeout seconds; then (or at a second signal) it ends the rest at once (forward.py:
a 503, or a stream's error event), and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import logging
from urllib.parse import urlsplit

from tokenmill.cli_args import at_least_one
from tokenmill.router.forward import STREAM_WRITE_TIMEOUT
from tokenmill.router.policy import POLICIES, make_policy
from tokenmill.server.connections import GuardedH11Protocol, connection_cap, raise_open_file_limit
from tokenmill.server.options import (
    add_allowed_origins_arg,
    bind,
    count,
    non_negative,
    port_number,
    resolve_allowed_hosts,
    resolve_allowed_origins,
    seconds,
)

logger = logging.getLogger("tokenmill.router")


def replica_url(text: str) -> str:
    """A replica's base URL, http(s)://host:port with no path; checked when the command line is read."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise argparse.ArgumentTypeError(f"expected a replica's base URL such as http://127.0.0.1:8001, got {text!r}")
    try:
        parts.port
    except ValueError:
        raise argparse.ArgumentTypeError(f"the port in {text!r} is not a port") from None
    return f"{parts.scheme}://{parts.netloc}"


def share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got {text!r}")
    return value


def ratio(text: str) -> float:
    value = non_negative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a ratio >= 1, got {text!r}")
    return value


def distinct_replicas(replicas: list[str], prefill: list[str] | None) -> None:
    """SystemExit for a URL given twice (as --replica, --prefill or both): one instance would be
    counted as two, each with half its load."""
    urls = [*replicas, *(prefill or [])]
    twice = sorted({url for url in urls if urls.count(url) > 1})
    if twice:
        raise SystemExit(f"each instance once: {', '.join(twice)} given more than once (--replica/--prefill)")


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica", type=replica_url, action="append", required=True, dest="replicas", metavar="URL",
                        help="a `tokenmill serve` instance's base URL (repeat for each replica)")
    parser.add_argument("--prefill", type=replica_url, action="append", default=None, dest="prefill", metavar="URL",
                        help="a `tokenmill serve --kv-role prefill` instance (repeat for each): each request's prompt "
                             "is computed there and its K/V handed to the replicas, then `--kv-role decode` instances")
    parser.add_argument("--min-uncached-chars", type=count, default=1024,
                        help="with --prefill: a prompt with fewer characters than this that no decode instance is "
                             "known to hold is computed where it lands, without a transfer (default: 1024)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware",
                        help="cache_aware: to the replica with the least prompt work queued, counting the part of "
                             "the prompt it already holds as done, unless loads are uneven; round_robin; "
                             "least_loaded (default: cache_aware)")
    parser.add_argument("--cache-threshold", type=share, default=0.5,
                        help="cache_aware: the share of a prompt's prefix chunks a replica must hold to be chosen "
                             "for it (default: 0.5)")
    parser.add_argument("--balance-abs-threshold", type=count, default=8,
                        help="cache_aware: loads are uneven when the most loaded replica has more than this many "
                             "requests over the least loaded ... (default: 8)")
    parser.add_argument("--balance-rel-threshold", type=ratio, default=1.5,
                        help="... and more than this many times its load (default: 1.5)")
    parser.add_argument("--decode-weight", type=non_negative, default=1 / 16,
                        help="cache_aware: the 64-character prompt chunks one row of a step costs: each request "
                             "in flight on a replica adds this times the new request's max_tokens (at most 256) to "
                             "its wait (default: 1/16, a token's work)")
    parser.add_argument("--stream-write-timeout", type=seconds, default=STREAM_WRITE_TIMEOUT,
                        help="end a relayed stream whose client takes no output for this many seconds (its "
                             f"replica then aborts the request; default: {STREAM_WRITE_TIMEOUT:g} s)")
    parser.add_argument("--drain-timeout", type=seconds, default=10.0,
                        help="on SIGINT/SIGTERM, let requests in flight finish for this long, then end them (a 503, "
                             "or an error event in a stream); a second signal ends them at once (default: 10 s)")
    parser.add_argument("--health-interval", type=seconds, default=1.0,
                        help="poll each replica's /health and /metrics this often (default: 1 s)")
    parser.add_argument("--allowed-hosts", default=None,
                        help="comma-separated Host names to answer, '*' for any (default: on a loopback address, "
                             "localhost, 127.0.0.1 and [::1]; else any)")
    add_allowed_origins_arg(parser)
    parser.add_argument("--max-body-bytes", type=at_least_one, default=4 * 1024 * 1024,
                        help="larger bodies get HTTP 413")
    parser.add_argument("--max-connections", type=at_least_one, default=1024,
                        help="past this many open client connections a new one's request gets HTTP 503")


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, then drain (the module's docstring)."""
    import uvicorn
    from prometheus_client import disable_created_metrics

    from tokenmill.router.app import create_app  # FastAPI's app and uvicorn: not needed to read the command line
    from tokenmill.server.draining import DrainingServer

    distinct_replicas(args.replicas, args.prefill)
    disable_created_metrics()  # no _created series beside each counter (as the server's)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request to a replica
    policy = make_policy(args.policy, args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold,
                         args.decode_weight)
    max_connections = connection_cap(args.max_connections, raise_open_file_limit())
    with bind(args.host, args.port) as sock:
        allowed = resolve_allowed_hosts(args.allowed_hosts, args.host, sock.getsockname()[0], None)
        app = create_app(args.replicas, policy, max_body_bytes=args.max_body_bytes, allowed_hosts=allowed,
                         allowed_origins=resolve_allowed_origins(args.allowed_origins),
                         health_interval=args.health_interval, prefill_urls=args.prefill,
                         min_uncached_chars=args.min_uncached_chars,
                         stream_write_timeout=args.stream_write_timeout)
        protocol = functools.partial(GuardedH11Protocol, header_timeout=10.0, max_connections=max_connections)
        config = uvicorn.Config(app, host=args.host, port=args.port, access_log=False, http=protocol,
                                log_level=logging.getLevelName(logging.getLogger().level).lower(),
                                timeout_graceful_shutdown=args.drain_timeout + 5)  # (the drain ends them first)
        server = DrainingServer(config, args.drain_timeout, end=app.state.stopping.set)
        logger.warning("routing (%s) over %s%s on http://%s:%d", args.policy, ", ".join(args.replicas),
                       f", prefill on {', '.join(args.prefill)}" if args.prefill else "", args.host,
                       sock.getsockname()[1])
        server.run(sockets=[sock])
    return 0

