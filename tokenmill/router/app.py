"""The router's OpenAI-compatible app: the replicas' API behind one address.

    POST /v1/completions, /v1/chat/completions    routed by the policy, streams relayed by event
    GET  /v1/models, /v1/models/{id}; POST /v1/embeddings, /tokenize, /detokenize
                                                  to the least loaded replica
    GET  /health     200 while some replica is in routing, with each replica's state; else 503
    GET  /metrics    the router's own figures (metrics.py)

The router answers itself only what it must read to route: a body that is no JSON object (400),
an oversized body (413), a Host it does not answer (400), an unknown path (404), no replica
left (503), a request its shutdown ended (503); each in OpenAI's error shape. Everything else
is the replicas' answer, unchanged.
`create_app` wires the module-level handler's routes; the poller runs while the app does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import __version__
from tokenmill.router.disagg import PrefillStage
from tokenmill.router.forward import (
    STREAM_WRITE_TIMEOUT,
    ClientGone,
    Forwarder,
    RouterStopping,
    request_headers,
    settle,
    shutting_down,
)
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import CacheAware, LeastLoaded, RoundRobin
from tokenmill.router.prefix import DEFAULT_DECODE_TOKENS, PrefixSet, chunk_hashes, decode_tokens, routing_text
from tokenmill.router.replicas import Replica, poll, watch
from tokenmill.sampling_params import check_depth, too_deep
from tokenmill.server.access import HostAllowListMiddleware, add_cors
from tokenmill.server.openapi import STREAM_RESPONSES, OpenAIStyleAPI, error_responses
from tokenmill.server.protocol import error_body
from tokenmill.server.streaming import AccessLogMiddleware, BodyLimitMiddleware, RequestIdMiddleware

logger = logging.getLogger("tokenmill.router")


@dataclass
class RouterHandler:
    forwarder: Forwarder
    replicas: list[Replica]
    metrics: RouterMetrics
    prefill: PrefillStage | None = None  # disaggregated prefill/decode (disagg.py): the replicas decode

    async def completions(self, raw: Request) -> Response:
        return await self._generate(raw)

    async def chat_completions(self, raw: Request) -> Response:
        return await self._generate(raw)

    async def passed_on(self, raw: Request) -> Response:
        """/v1/models, /tokenize and the like: the least loaded replica's answer."""
        return await self._forward(raw, await raw.body(), None)

    async def health(self) -> JSONResponse:
        states = {r.url: {"healthy": r.healthy, "in_flight": r.in_flight, "waiting": r.waiting}
                  for r in self.replicas}
        if self.prefill is not None:
            states |= {r.url: {"healthy": r.healthy, "in_flight": r.in_flight, "waiting": r.waiting, "role": "prefill"}
                       for r in self.prefill.prefill}
        if not any(r.healthy for r in self.replicas):
            body = error_body("no replica is healthy", "server_error", code="no_replica_available")
            return JSONResponse({**body, "replicas": states}, status_code=503)
        return JSONResponse({"status": "ok", "replicas": states})

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(self.replicas), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _generate(self, raw: Request) -> Response:
        """Read the body only as far as routing needs (its prompt or messages); send it on as it came."""
        content = await raw.body()
        try:
            body = json.loads(content)
        except (ValueError, UnicodeDecodeError):
            return JSONResponse(error_body("request body is not valid JSON"), status_code=400)
        except RecursionError:  # (past Python 3.11's decoder; 3.12's reads on to about 8,000 levels)
            return JSONResponse(error_body(str(too_deep("the body"))), status_code=400)
        try:
            check_depth(body, "the body")  # as the replicas refuse it
        except ValueError as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("request body must be a JSON object"), status_code=400)
        text = routing_text(raw.url.path, body)
        hashes = chunk_hashes(text)
        if self.prefill is not None:
            leg = self.prefill.prepare(raw.url.path, body, content, request_headers(raw.headers), hashes, len(text))
            try:
                content = await settle(leg, raw.receive, self.forwarder.stopping)
            except ClientGone:
                return Response(status_code=499)
            except RouterStopping:
                return shutting_down()
        return await self._forward(raw, content, hashes, decode_tokens(body))

    async def _forward(self, raw: Request, content: bytes, hashes: list[bytes] | None,
                       steps: int = DEFAULT_DECODE_TOKENS) -> Response:
        target = raw.scope.get("raw_path", raw.url.path.encode()).decode("latin-1")
        if raw.url.query:
            target += "?" + raw.url.query
        work = self.forwarder.forward(raw.method, target, content, request_headers(raw.headers), hashes, steps)
        try:
            return await settle(work, raw.receive, self.forwarder.stopping)
        except ClientGone:  # nobody reads this answer; its replica's work was cancelled
            return Response(status_code=499)
        except RouterStopping:
            return shutting_down()


async def _http_error(raw: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method) in OpenAI's shape, with their headers; an
    unknown path's names what the router does route (a replica serves more: /v1/responses)."""
    if exc.status_code == 404:
        routed = sorted({route.path_format for route in raw.app.routes if getattr(route, "include_in_schema", False)})
        message = (f"the router does not route {raw.url.path}; it routes {', '.join(routed)} (send other "
                   "paths to a replica)")
        return JSONResponse(error_body(message, "not_found_error"), status_code=404, headers=exc.headers)
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code,
                        headers=exc.headers)


def create_app(replica_urls: list[str], policy: CacheAware | RoundRobin | LeastLoaded,
               max_body_bytes: int = 4 * 1024 * 1024, allowed_hosts: list[str] | None = None,
               health_interval: float = 1.0, health_timeout: float = 5.0, prefix_capacity: int = 1 << 16,
               prefill_urls: list[str] | None = None, min_uncached_chars: int = 1024,
               stream_write_timeout: float = STREAM_WRITE_TIMEOUT, allowed_origins: list[str] | None = None) -> FastAPI:
    """The router over `replica_urls` (http://host:port), routing by `policy` (policy.py); with
    `prefill_urls`, prefill instances in front of them (disagg.py). A relayed stream whose client
    takes nothing for `stream_write_timeout` seconds is ended (its replica then aborts the request).

    Replicas are polled (/health, /metrics) every `health_interval` seconds, each look given
    `health_timeout`; each replica's prefix set keeps at most `prefix_capacity` chunk hashes
    (8 bytes each, about 100 bytes with the set's own cost). allowed_hosts: the Host names the
    router answers (None: any); allowed_origins: the web origins whose pages may call it (CORS;
    None: none)."""
    if not replica_urls:
        raise ValueError("the router needs at least one replica")
    if not stream_write_timeout > 0:
        raise ValueError(f"stream_write_timeout must be > 0 seconds, got {stream_write_timeout}")
    replicas = [Replica(url.rstrip("/"), PrefixSet(prefix_capacity)) for url in replica_urls]
    # no read timeout: a completion takes as long as it takes; trust_env off: no proxy between
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    metrics = RouterMetrics()
    prefill = [Replica(url.rstrip("/"), PrefixSet(1)) for url in prefill_urls or []]
    stage = PrefillStage(client, prefill, replicas, metrics, min_uncached_chars) if prefill else None
    handler = RouterHandler(Forwarder(client, replicas, policy, metrics, stream_write_timeout), replicas, metrics,
                            stage)

    app = OpenAIStyleAPI(title="tokenmill router", version=__version__, lifespan=_lifespan)
    app.state.client, app.state.replicas = client, replicas + prefill  # all polled; prefill ones never routed to
    app.state.health = (health_interval, health_timeout)
    app.state.stopping = handler.forwarder.stopping  # set by server/draining.py when the shutdown's drain time is up
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)  # (the last added runs first)
    if allowed_hosts is not None:
        app.add_middleware(HostAllowListMiddleware, hosts=allowed_hosts)
    add_cors(app, allowed_origins)
    app.add_middleware(AccessLogMiddleware, logger=logger, on_response=metrics.on_response)
    app.add_middleware(RequestIdMiddleware)  # the router's own answers echo it too; replicas' pass it on
    app.add_exception_handler(StarletteHTTPException, _http_error)

    generating = {**STREAM_RESPONSES, **error_responses(400, 404, 413, 500, 503)}
    app.add_api_route("/v1/completions", handler.completions, methods=["POST"], responses=generating)
    app.add_api_route("/v1/chat/completions", handler.chat_completions, methods=["POST"], responses=generating)
    app.add_api_route("/v1/models", handler.passed_on, methods=["GET"], responses=error_responses(503))
    app.add_api_route("/v1/models/{model_id:path}", handler.passed_on, methods=["GET"],
                      responses=error_responses(404, 503))
    app.add_api_route("/v1/embeddings", handler.passed_on, methods=["POST"],
                      responses=error_responses(400, 404, 413, 500, 503))
    app.add_api_route("/tokenize", handler.passed_on, methods=["POST"], responses=error_responses(400, 404, 503))
    app.add_api_route("/detokenize", handler.passed_on, methods=["POST"], responses=error_responses(400, 404, 503))
    app.add_api_route("/health", handler.health, methods=["GET"], responses=error_responses(503))
    app.add_api_route("/metrics", handler.prometheus, methods=["GET"], response_class=PlainTextResponse)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """A first look at every replica before the first request, then the poller until shutdown."""
    client, replicas = app.state.client, app.state.replicas
    interval, timeout = app.state.health
    await asyncio.gather(*(poll(client, r, timeout) for r in replicas))
    for replica in replicas:
        if not replica.healthy:
            logger.warning("replica %s is not healthy yet; it joins when its /health answers", replica.url)
    poller = asyncio.create_task(watch(client, replicas, interval, timeout))
    yield
    poller.cancel()
    await asyncio.gather(poller, return_exceptions=True)
    await client.aclose()
