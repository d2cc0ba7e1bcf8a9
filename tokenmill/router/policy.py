"""Which replica takes a request. Each policy picks among the candidates it is given (the
healthy replicas not yet tried for this request, never empty) and names why; the forwarder then
records the prompt's chain in the chosen replica's prefix set (Replica.route).

    cache_aware   SGLang's cache-aware policy, with work instead of request counts while loads
                  are even: each candidate's wait is the prompt chunks already queued there
                  (Replica.backlog), plus the chunks of this prompt it does not hold (a match
                  under `cache_threshold` of the chain counts as none), counted twice where
                  another candidate holds them, plus `decode_weight` x the request's decode
                  tokens for each request in flight there (each shares a step with each of this
                  request's decode steps, a row each); the least wait wins, then the longest
                  match, the lower load and the fewest prefixes. Its reason: "prefix" when the
                  winner holds the longest match, "backlog" when a replica holding more of the
                  prompt was too busy, else "least_loaded". When loads are uneven (the most
                  loaded has over `balance_abs` more than the least and over `balance_rel`
                  times as much), the least loaded ("balance").
    round_robin   each candidate in turn
    least_loaded  the least loaded (the router's in-flight requests plus the replica's queue)

Counting work rather than requests is what keeps a shared prefix's replica from taking request
after request while its neighbour idles: a replica with two documents still to prefill is busier
than one decoding four short answers, whatever their counts say. A prefix computed again
elsewhere counts twice because the cluster pays for it twice: the time of the replica that
recomputes it is taken from the requests that come after.

A hot prefix (one many requests share) brings its holder no prompt work, only requests to
decode, so it is the decode term that moves it: the holder keeps the prefix's requests while its
wait is at most what another replica would need to compute the prefix itself (its backlog, the
prompt, the prefix once more); past that the request goes to the other replica, which then
holds the prefix too, and the two share its requests by their waits. A third replica takes a copy
when both are that busy, and so on: the prefix is held by as many replicas as its load needs.
The decode term is in prompt chunks: on a CPU a step costs about its token count, so a row of a
step is a token's work, 1/16 of a 64-character chunk (about 16 tokens), the default weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.router.prefix import DEFAULT_DECODE_TOKENS
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
    decode_weight: float = 1 / 16  # prompt chunks a row of a step costs: a token's work on a CPU

    def choose(self, candidates: list[Replica], hashes: list[bytes],
               decode_tokens: int = DEFAULT_DECODE_TOKENS) -> tuple[Replica, str]:
        low, high = least_loaded(candidates), max(r.load for r in candidates)
        if high - low.load > self.balance_abs and high > self.balance_rel * low.load:
            return low, "balance"
        held = [self._held(r, hashes) for r in candidates]
        most = max(held)
        shared_steps = self.decode_weight * decode_tokens  # what each request in flight adds to this one's wait
        wait = [r.backlog + len(hashes) - h + (most - h) + shared_steps * r.in_flight for r, h in zip(candidates, held)]
        best = min(range(len(candidates)),
                   key=lambda i: (wait[i], -held[i], candidates[i].load, len(candidates[i].prefixes), i))
        if held[best] and held[best] == most:
            return candidates[best], "prefix"
        return candidates[best], "backlog" if most > held[best] else "least_loaded"

    def _held(self, replica: Replica, hashes: list[bytes]) -> int:
        """The chunks of the chain the replica holds, or 0 under the threshold's share."""
        matched = replica.prefixes.match(hashes)
        return matched if hashes and matched >= self.cache_threshold * len(hashes) else 0


@dataclass
class RoundRobin:
    turn: int = 0

    def choose(self, candidates: list[Replica], hashes: list[bytes],
               decode_tokens: int = DEFAULT_DECODE_TOKENS) -> tuple[Replica, str]:
        chosen = candidates[self.turn % len(candidates)]
        self.turn += 1
        return chosen, "round_robin"


@dataclass
class LeastLoaded:
    def choose(self, candidates: list[Replica], hashes: list[bytes],
               decode_tokens: int = DEFAULT_DECODE_TOKENS) -> tuple[Replica, str]:
        return least_loaded(candidates), "least_loaded"


def make_policy(name: str, cache_threshold: float = 0.5, balance_abs: int = 8,
                balance_rel: float = 1.5, decode_weight: float = 1 / 16) -> CacheAware | RoundRobin | LeastLoaded:
    if name == "cache_aware":
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if decode_weight < 0:
            raise ValueError(f"decode_weight must be >= 0, got {decode_weight}")
        return CacheAware(cache_threshold, balance_abs, balance_rel, decode_weight)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {name!r}")
