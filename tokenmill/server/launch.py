"""`tokenmill serve`: build the engine, run the app under uvicorn, and shut down cleanly.

On SIGINT/SIGTERM uvicorn stops accepting connections; first, every in-flight request is ended
(finish_reason "abort"), so open streams get their final chunk, an error event
(server_shutting_down) and [DONE] before the connections close, and the process exits 0, a second
signal or not (server/draining.py). With --shutdown-timeout S the requests in flight first have S
seconds to finish (or until a second signal); new connections are refused, and a request that
still comes on an open one gets a 503.

Connections run under connections.py's guards (timeouts for idle connections and request heads, a
cap on open ones); the app answers only the Host names options.py's `resolve_allowed_hosts` gave.
The command line is read and the socket bound (options.py) before this module, which imports the
engine, is.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import signal
import socket
import threading

from tokenmill.server.api import create_app
from tokenmill.server.connections import GuardedH11Protocol
from tokenmill.server.draining import DrainingServer
from tokenmill.server.otel import RequestSpans, otlp_exporter

logger = logging.getLogger("tokenmill.server")


def run_server(args: argparse.Namespace, config, sock: socket.socket) -> int:
    """Load the engine and serve on `sock` (from options.listen) until a signal ends the server."""
    import uvicorn
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # no _created series beside each counter and histogram (as vLLM's server)

    from tokenmill.engine import LLMEngine

    engine = LLMEngine(dataclasses.replace(config, model=args.model))
    name = args.served_model_name or engine.model_path.stem
    app = create_app(engine, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                     protect_metrics_and_docs=args.protect_metrics_and_docs, allowed_hosts=args.allowed_hosts,
                     allowed_origins=args.allowed_origins,
                     stream_write_timeout=args.stream_write_timeout, request_log_size=args.request_log_size,
                     responses_store_size=args.responses_store_size,
                     spans=RequestSpans(otlp_exporter(args.otlp_traces_endpoint)) if args.otlp_traces_endpoint
                     else None)

    protocol = functools.partial(GuardedH11Protocol, header_timeout=args.timeout_request_headers,
                                 body_timeout=args.timeout_request_body, max_connections=args.max_connections)
    config = uvicorn.Config(app, host=args.host, port=args.port, access_log=False, http=protocol,
                            timeout_keep_alive=args.timeout_keep_alive,
                            log_level=logging.getLevelName(logging.getLogger().level).lower(),
                            timeout_graceful_shutdown=args.shutdown_timeout + 10)
    engine_loop = app.state.async_engine
    server = DrainingServer(config, args.shutdown_timeout, end=engine_loop.abort_all, begin=engine_loop.drain)
    logger.warning("serving %s as %r on http://%s:%d", engine.model_path, name, args.host, sock.getsockname()[1])
    # uvicorn takes SIGINT/SIGTERM while it serves and gives back the handlers it found after; a
    # second signal then (as an impatient operator sends one) must not kill the process that the
    # first one is ending cleanly: the server's handler until the end of uvicorn, then none.
    _on_end_signals(server.handle_exit)
    server.run(sockets=[sock])
    _on_end_signals(signal.SIG_IGN)
    return 0


def _on_end_signals(handler) -> None:
    """SIGINT and SIGTERM to `handler`, in the main thread (the only one Python lets set them)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handler)
