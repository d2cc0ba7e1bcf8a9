"""Disaggregated prefill and decode behind the router: `tokenmill router --prefill URL --replica URL`.

With prefill instances (`tokenmill serve --kv-role prefill`) the router's replicas are decode
instances (`--kv-role decode`), and a generating request goes in two legs, as vLLM's proxies do:

    1. to the least loaded prefill instance, as it came but with max_tokens 1, no stream and
       kv_transfer_params {"do_remote_decode": true}: it computes the prompt, keeps its K/V for a
       decode instance and answers with kv_transfer_params saying where
    2. to a decode instance (the routing policy picks it), as it came plus those params: it loads
       the prompt's K/V, computes the last prompt token and streams the answer to the client

A request skips the first leg when the part of its prompt no decode instance is known to hold is
short (under `min_uncached_chars` characters of the routing text, by the prefix sets the
cache-aware policy keeps): a transfer would cost more than computing it where it lands. When the
first leg fails (no prefill instance healthy, one that dies, an error answer, its instance taken
out of routing by the health poller meanwhile, no answer within PREFILL_TIMEOUT) the request goes
to a decode instance without params, which computes the prompt itself: slower, never wrong or lost.
A client that leaves during the first leg ends it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import httpx

from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import least_loaded
from tokenmill.router.prefix import CHUNK_CHARS
from tokenmill.router.replicas import Replica

logger = logging.getLogger("tokenmill.router")

PREFILL_TIMEOUT = 300.0  # seconds a prefill leg may take before the decode instance computes the prompt
HEALTH_LOOK_S = 0.25  # how often a prefill leg looks whether its instance is still in routing


@dataclass
class PrefillStage:
    client: httpx.AsyncClient
    prefill: list[Replica]        # the prefill instances
    decode: list[Replica]         # the decode instances (the router's replicas)
    metrics: RouterMetrics
    min_uncached_chars: int = 1024

    def __post_init__(self) -> None:
        for outcome in ("transferred", "local", "failed"):  # each shown from the start, at 0
            self.metrics.prefill_legs.labels(outcome)

    async def prepare(self, path: str, body: dict, content: bytes, headers: dict[str, str],
                      hashes: list[bytes], text_chars: int) -> bytes:
        """The body for the decode leg: with the prefill leg's kv_transfer_params, or as it came
        when the prompt is short where it lands, when the request scores its prompt (its logprobs
        need every prompt position computed where it is answered), or the prefill leg failed; with
        no decode instance healthy, as it came at once (to be answered 503, no prompt computed)."""
        if not any(r.healthy for r in self.decode):
            return content
        held = max((r.prefixes.match(hashes) for r in self.decode if r.healthy), default=0)
        scores_prompt = body.get("prompt_logprobs") is not None or bool(body.get("echo")) and (
            body.get("logprobs") is not None)
        if text_chars - held * CHUNK_CHARS < self.min_uncached_chars or scores_prompt:
            self.metrics.prefill_legs.labels("local").inc()
            return content
        params = await self._prefill(path, body, headers)
        if params is None:
            self.metrics.prefill_legs.labels("failed").inc()
            return content
        self.metrics.prefill_legs.labels("transferred").inc()
        return json.dumps({**body, "kv_transfer_params": params}).encode()

    async def _prefill(self, path: str, body: dict, headers: dict[str, str]) -> dict | None:
        """The prefill leg's kv_transfer_params, or None (logged) if it gave none."""
        candidates = [r for r in self.prefill if r.healthy]
        if not candidates:
            logger.warning("no prefill instance is healthy: %s computed on a decode instance", path)
            return None
        replica = least_loaded(candidates)
        leg = {key: value for key, value in body.items()
               if key not in ("stream", "stream_options", "max_completion_tokens", "min_tokens", "n", "logprobs",
                              "top_logprobs")}
        leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        replica.in_flight += 1
        try:
            answer = await self._post_while_healthy(replica, path, leg, headers)
            if answer is None:
                logger.warning("prefill instance %s went out of routing during a prefill leg; computing on a "
                               "decode instance", replica.url)
                return None
            data = answer.json() if answer.status_code == 200 else None
            params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        except (httpx.HTTPError, ValueError) as exc:
            replica.mark_down(f"prefill leg: {type(exc).__name__} {exc}")
            params = None
        else:
            if params is None:
                logger.warning("prefill instance %s answered %d without kv_transfer_params; computing on a "
                               "decode instance", replica.url, answer.status_code)
        finally:
            replica.in_flight -= 1
        return params if isinstance(params, dict) else None

    async def _post_while_healthy(self, replica: Replica, path: str, leg: dict,
                                  headers: dict[str, str]) -> httpx.Response | None:
        """The prefill leg's answer, or None once the health poller takes `replica` out of routing
        first (a frozen or overloaded instance: its /health timed out), the leg then cancelled."""
        post = asyncio.ensure_future(self.client.post(replica.url + path, json=leg, headers=headers,
                                                      timeout=httpx.Timeout(PREFILL_TIMEOUT, connect=5.0)))
        try:
            while not (await asyncio.wait({post}, timeout=HEALTH_LOOK_S))[0]:
                if not replica.healthy:
                    return None
            return post.result()
        finally:
            post.cancel()
