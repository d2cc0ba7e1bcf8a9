"""Each replica as the router knows it (health, load, the prefixes routed to it), and the loop
that keeps health and queue length fresh by polling the replicas' /health and /metrics.

A replica is taken out of routing when its /health fails or a request to it fails in transport
(connection refused or dropped), and back when /health answers 200 again. Going down clears its
prefixes: a replica that comes back is usually a restarted one, whose cache is empty.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from tokenmill.router.prefix import PrefixSet

logger = logging.getLogger("tokenmill.router")

# The replicas' metric (vLLM's name, which tokenmill exports too) giving its queue length.
WAITING_METRIC = "vllm:num_requests_waiting"


@dataclass
class Replica:
    url: str              # http://host:port, no trailing slash
    prefixes: PrefixSet   # chain hashes of the prompts routed here (cache_aware only)
    healthy: bool = False  # until the first /health answers
    in_flight: int = 0    # requests the router has sent here and not finished
    waiting: int = 0      # the replica's own queue, from its /metrics at the last poll
    prefilling: int = 0   # of in_flight, those whose answer has not begun: their prompts are being computed
    backlog: int = 0      # the prompt chunks those requests brought that this replica was not known to hold
    metrics_refused: bool = False  # its /metrics answered 401/403 (said once in the log)

    @property
    def load(self) -> int:
        """What routing balances: the router's requests in flight here plus the replica's queue
        (which may hold requests from other clients of the replica)."""
        return self.in_flight + self.waiting

    def route(self, hashes: list[bytes]) -> int:
        """Record a prompt's chain as sent here; how many of its chunks this replica was not known
        to hold (the part of the prompt it will compute)."""
        uncached = len(hashes) - self.prefixes.match(hashes)
        self.prefixes.insert(hashes)
        return uncached

    def mark_down(self, why: str) -> None:
        if self.healthy:
            logger.warning("replica %s is out of routing: %s", self.url, why)
        self.healthy = False
        self.waiting = 0
        self.prefixes.clear()

    def mark_up(self) -> None:
        if not self.healthy:
            logger.info("replica %s is in routing", self.url)
        self.healthy = True


def waiting_requests(metrics_text: str) -> int:
    """The sum of WAITING_METRIC's samples (one per model label) in a Prometheus text page."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(WAITING_METRIC) and line[len(WAITING_METRIC):len(WAITING_METRIC) + 1] in ("{", " "):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return int(total)


async def poll(client: httpx.AsyncClient, replica: Replica, timeout: float) -> None:
    """One look at a replica: /health decides whether it is in routing; /metrics, when it
    answers, its queue length (a hint only: a replica with a protected /metrics is still used)."""
    try:
        health = await client.get(replica.url + "/health", timeout=timeout)
    except httpx.HTTPError as exc:
        replica.mark_down(f"/health: {type(exc).__name__} {exc}")
        return
    if health.status_code != 200:
        replica.mark_down(f"/health answered {health.status_code}")
        return
    replica.mark_up()
    try:
        page = await client.get(replica.url + "/metrics", timeout=timeout)
    except httpx.HTTPError:
        return
    if page.status_code == 200:
        replica.waiting = waiting_requests(page.text)
    elif page.status_code in (401, 403) and not replica.metrics_refused:
        replica.metrics_refused = True
        logger.warning("replica %s's /metrics needs a key (--protect-metrics-and-docs): routing goes without its "
                       "queue length", replica.url)


async def watch(client: httpx.AsyncClient, replicas: list[Replica], interval: float, timeout: float) -> None:
    """Poll every replica each `interval` seconds, all at once, until cancelled."""
    while True:
        await asyncio.gather(*(poll(client, r, timeout) for r in replicas))
        await asyncio.sleep(interval)
