"""The router's own Prometheus figures, per replica: requests routed (and why), attempts that
failed before their first byte (each then retried elsewhere), and, as of the scrape, health,
requests in flight and the replica's queue. Its own CollectorRegistry, as the server's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tokenmill.router.replicas import Replica


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter("tokenmill_router_requests_routed", "Requests sent to a replica, by the policy's reason",
                              ["replica", "reason"], registry=r)
        self.failed = Counter("tokenmill_router_attempts_failed",
                              "Attempts that failed before the client got a byte (retried on another replica)",
                              ["replica"], registry=r)
        self.healthy = Gauge("tokenmill_router_replica_healthy", "1 while the replica is in routing", ["replica"],
                             registry=r)
        self.in_flight = Gauge("tokenmill_router_requests_in_flight", "The router's requests at the replica",
                               ["replica"], registry=r)
        self.prefill_legs = Counter("tokenmill_router_prefill_legs",
                                    "With prefill instances: requests whose prompt went to one (transferred), "
                                    "stayed on the decode instance as short (local), or fell back there (failed)",
                                    ["outcome"], registry=r)
        self.waiting = Gauge("tokenmill_router_replica_waiting", "The replica's queue at the last poll",
                             ["replica"], registry=r)

    def render(self, replicas: list[Replica]) -> bytes:
        for replica in replicas:
            self.healthy.labels(replica.url).set(1 if replica.healthy else 0)
            self.in_flight.labels(replica.url).set(replica.in_flight)
            self.waiting.labels(replica.url).set(replica.waiting)
        return generate_latest(self.registry)
