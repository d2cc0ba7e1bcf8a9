"""server/request_log.py: live responses are always found; ended ones while in the ring."""

from __future__ import annotations

import pytest
from fakes import make_request

from tokenmill.server.request_log import LIVE_FACTOR, RequestLog


def response(rid: str, n: int = 1) -> list:
    return [make_request(f"{rid}-0-{j}", prompt_len=3) for j in range(n)]


def end(requests: list) -> None:
    for r in requests:
        r.timeline.add(1.0, "finished", finish_reason="stop")


def test_a_live_response_stays_however_many_end_after_it() -> None:
    log = RequestLog(size=2)
    live = response("live", n=2)
    log.add("live", live)
    for i in range(5):
        ended = response(f"r{i}")
        log.add(f"r{i}", ended)
        end(ended)
    entries = log.get("live")
    assert [rid for rid, _ in entries] == ["live-0-0", "live-0-1"] and entries[0][1] is live[0].timeline
    assert log.get("r0") is None and log.get("r2") is None and log.get("r3") is not None and log.get("r4")


def test_a_response_enters_the_ring_only_when_all_its_requests_ended() -> None:
    log = RequestLog(size=1)
    both = response("both", n=2)
    log.add("both", both)
    end(both[:1])
    other = response("other")
    log.add("other", other)
    end(other)
    log.add("third", response("third"))  # "other" ended: into the ring of one
    assert log.get("both") is not None and log.get("other") is not None
    end(both[1:])
    assert log.get("both") is not None and log.get("other") is None  # "both" ended after: it pushed it out


def test_live_responses_are_bounded_too_and_size_zero_keeps_nothing() -> None:
    log = RequestLog(size=1)
    for i in range(LIVE_FACTOR + 3):
        log.add(f"r{i}", response(f"r{i}"))
    assert log.get("r0") is None and log.get("r2") is None and log.get(f"r{LIVE_FACTOR + 2}") is not None
    none = RequestLog(size=0)
    none.add("a", response("a"))
    assert none.get("a") is None
    with pytest.raises(ValueError, match="size"):
        RequestLog(size=-1)
