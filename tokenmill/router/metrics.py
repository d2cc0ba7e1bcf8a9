"""The router's own Prometheus figures: its answers by path and status, and how long they took
(for a stream, until its last byte); per replica, requests routed (and why), attempts that
failed before their first byte (each then retried elsewhere), and, as of the scrape, health,
requests in flight and the replica's queue. Its own CollectorRegistry, as the server's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.responses = Counter("tokenmill_router_responses", "The router's answers, by route and HTTP status",
                                 ["path", "status"], registry=r)
        self.duration = Histogram("tokenmill_router_request_duration_seconds",
                                  "Request to the answer's last byte, by route", ["path"], registry=r,
                                  buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

    def on_response(self, scope: dict, status: int, seconds: float) -> None:
        """An answer (AccessLogMiddleware's hook), under its route's path ("/v1/models/{model_id}"),
        or "other" for a path the router does not route (so that no client can make a series per
        path)."""
        route = getattr(scope.get("route"), "path_format", "other")
        self.responses.labels(route, str(status)).inc()
        self.duration.labels(route).observe(seconds)

    def render(self, replicas: list[Replica]) -> bytes:
        for replica in replicas:
            self.healthy.labels(replica.url).set(1 if replica.healthy else 0)
            self.in_flight.labels(replica.url).set(replica.in_flight)
            self.waiting.labels(replica.url).set(replica.waiting)
        return generate_latest(self.registry)
