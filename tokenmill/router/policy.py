"""Which replica takes a request. Each policy picks among the candidates it is given (the
healthy replicas not yet tried for this request, never empty) and names why:

    cache_aware   SGLang's cache-aware policy: while loads are even, the replica whose prefix
                  set holds the longest prefix of the request's chain, if that covers at least
                  `cache_threshold` of the chain ("prefix"); otherwise the least loaded, the one
                  with the fewest prefixes among equals, to spread new prefixes ("least_loaded").
                  When loads are uneven (the most loaded has over `balance_abs` more than the
                  least and over `balance_rel` times as much), the least loaded ("balance").
                  The chosen replica's set records the chain.
    round_robin   each candidate in turn
    least_loaded  the least loaded (the router's in-flight requests plus the replica's queue)
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.router.replicas import Replica

POLICIES = ("cache_aware", "round_robin", "least_loaded")


def least_loaded(candidates: list[Replica]) -> Replica:
    """The least loaded; among equals the one with the fewest prefixes, then the first."""
    return min(candidates, key=lambda r: (r.load, len(r.prefixes)))


@dataclass
class CacheAware:
    cache_threshold: float = 0.5   # the share of the chain a match must cover
    balance_abs: int = 8           # loads are uneven past this difference ...
    balance_rel: float = 1.5       # ... and this ratio, both

    def choose(self, candidates: list[Replica], hashes: list[bytes]) -> tuple[Replica, str]:
        low, high = least_loaded(candidates), max(r.load for r in candidates)
        if high - low.load > self.balance_abs and high > self.balance_rel * low.load:
            chosen, reason = low, "balance"
        else:
            matches = [(r.prefixes.match(hashes), -r.load, -i) for i, r in enumerate(candidates)]
            best = max(range(len(candidates)), key=matches.__getitem__)
            if hashes and matches[best][0] >= self.cache_threshold * len(hashes):
                chosen, reason = candidates[best], "prefix"
            else:
                chosen, reason = low, "least_loaded"
        chosen.prefixes.insert(hashes)
        return chosen, reason


@dataclass
class RoundRobin:
    turn: int = 0

    def choose(self, candidates: list[Replica], hashes: list[bytes]) -> tuple[Replica, str]:
        chosen = candidates[self.turn % len(candidates)]
        self.turn += 1
        return chosen, "round_robin"


@dataclass
class LeastLoaded:
    def choose(self, candidates: list[Replica], hashes: list[bytes]) -> tuple[Replica, str]:
        return least_loaded(candidates), "least_loaded"


def make_policy(name: str, cache_threshold: float = 0.5, balance_abs: int = 8,
                balance_rel: float = 1.5) -> CacheAware | RoundRobin | LeastLoaded:
    if name == "cache_aware":
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        return CacheAware(cache_threshold, balance_abs, balance_rel)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {name!r}")
