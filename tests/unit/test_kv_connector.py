"""The scheduler's KV connector seam (kv_connector.py): where a connector is asked, what it is
told, and how its tokens move the request's counter. A recording connector, no model."""

from __future__ import annotations

from fakes import fake_run, make_request, make_scheduler, run_to_completion

from tokenmill.outputs import FinishResult
from tokenmill.request import RequestStatus


class Recorder:
    """Offers `offer` tokens to every request, loads them (or fails to, with `fail`), holds the
    blocks of requests that end by length (with `hold`) until `release` names them, and records
    each call."""

    def __init__(self, offer: int, fail: bool = False, hold: bool = False) -> None:
        self.offer = offer
        self.fail = fail
        self.hold = hold
        self.release: list[str] = []
        self.calls: list[tuple] = []

    def num_matched_tokens(self, request, num_local_tokens):
        self.calls.append(("matched", request.request_id, num_local_tokens))
        return self.offer

    def load(self, request, block_ids, num_local_tokens, num_external_tokens):
        self.calls.append(("loaded", request.request_id, list(block_ids), num_local_tokens, num_external_tokens))
        return not self.fail

    def on_finish(self, request, block_ids):
        self.calls.append(("finished", request.request_id, list(block_ids), request.status.name))
        by_length = request.status.name == "FINISHED_LENGTH"
        return FinishResult({"do_remote_prefill": True} if by_length else None, hold_blocks=self.hold and by_length)

    def released(self):
        self.calls.append(("released",))
        released, self.release = self.release, []
        return released


def test_external_tokens_are_counted_computed_and_get_blocks_at_admission():
    connector = Recorder(offer=8)
    s = make_scheduler(budget=32, block_size=4, connector=connector)
    s.add_request(make_request("a", prompt_len=20, max_tokens=2))
    sched = s.schedule()
    request = s.requests["a"]
    assert list(zip([r.request_id for r in sched.requests], sched.num_scheduled_tokens)) == [("a", 12)]
    assert request.num_computed_tokens == 8 and request.num_cached_tokens == 0
    assert request.num_external_tokens == 8 and s.stats().num_external_tokens == 8
    assert connector.calls == [("matched", "a", 0), ("loaded", "a", [0, 1, 2, 3, 4], 0, 8)]


def test_the_last_prompt_token_is_always_computed_here():
    connector = Recorder(offer=100)
    s = make_scheduler(budget=32, block_size=4, connector=connector)
    s.add_request(make_request("a", prompt_len=10, max_tokens=2))
    sched = s.schedule()
    assert sched.num_scheduled_tokens == [1] and s.requests["a"].num_computed_tokens == 9


def test_the_local_prefix_hit_comes_first_and_the_connector_supplies_what_follows():
    connector = Recorder(offer=4)
    s = make_scheduler(budget=32, block_size=4, prefix_caching=True, connector=connector)
    s.add_request(make_request("a", prompt_len=16, max_tokens=1))
    first = s.schedule()
    s.update(first, fake_run(first))
    s.add_request(make_request("b", prompt_len=16, max_tokens=1))  # the same tokens: 12 cached, 3 blocks
    connector.calls.clear()
    second = s.schedule()
    b = s.requests["b"]
    assert connector.calls[0] == ("matched", "b", 12)
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 15  # 12 local + 3 (the last is computed)
    assert second.num_scheduled_tokens[-1] == 1


def test_a_finishing_request_shows_its_blocks_before_they_are_freed():
    connector = Recorder(offer=0)
    s = make_scheduler(budget=32, block_size=4, connector=connector)
    s.add_request(make_request("a", prompt_len=6, max_tokens=1))
    sched = s.schedule()
    s.update(sched, fake_run(sched))
    assert connector.calls[-1] == ("finished", "a", [0, 1], "FINISHED_LENGTH")
    assert s.stats().kv_blocks_used == 0
    assert sched.requests[0].kv_transfer_params == {"do_remote_prefill": True}


def test_a_failed_load_computes_the_tokens_here_and_caches_none_of_the_promised_blocks():
    connector = Recorder(offer=12, fail=True)
    s = make_scheduler(budget=8, block_size=4, prefix_caching=True, connector=connector)
    s.add_request(make_request("a", prompt_len=20, max_tokens=2))
    sched = s.schedule()
    a = s.requests["a"]
    assert sched.num_scheduled_tokens == [8] and a.num_computed_tokens == 0 and a.num_external_tokens == 0
    assert a.num_registered_blocks == 2  # the two blocks this step fills; not the three promised past them
    s.update(sched, fake_run(sched))
    assert s.kv.find_prefix(make_request("b", prompt_len=20, max_tokens=2)).num_tokens == 8  # computed ones only
    steps = run_to_completion(s)
    assert [step.num_scheduled_tokens for step in steps] == [[8], [4], [1]]  # the rest of the prompt, then a decode
    assert s.stats().num_external_tokens == 0


def test_held_blocks_stay_out_of_the_pool_until_the_connector_releases_them():
    connector = Recorder(offer=0, hold=True)
    s = make_scheduler(budget=32, block_size=4, connector=connector)
    s.add_request(make_request("a", prompt_len=6, max_tokens=1))
    s.add_request(make_request("b", prompt_len=10, max_tokens=1))
    sched = s.schedule()
    s.update(sched, fake_run(sched))
    assert not s.has_unfinished_requests()
    stats = s.stats()
    assert (stats.num_held_requests, stats.kv_blocks_held, stats.kv_blocks_used) == (2, 2 + 3, 2 + 3)
    connector.release = ["b", "unknown"]
    s.schedule()  # asks the connector once, first
    assert connector.calls[-1] == ("released",)
    assert list(s.held) == ["a"] and s.stats().kv_blocks_used == 2
    connector.release = ["a"]
    s.release_held()  # what the engine does while it idles
    assert not s.held and s.stats().kv_blocks_used == 0 and s.stats().kv_blocks_held == 0


def test_an_aborted_request_is_never_held_and_nothing_is_asked_while_nothing_is():
    connector = Recorder(offer=0, hold=True)
    s = make_scheduler(budget=32, block_size=4, connector=connector)
    s.add_request(make_request("a", prompt_len=6, max_tokens=4))
    s.schedule()
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    s.schedule()
    assert not s.held and s.stats().kv_blocks_used == 0
    assert ("released",) not in connector.calls


class Broken(Recorder):
    """Raises in every call, as a connector given a client's malformed params might."""

    def num_matched_tokens(self, request, num_local_tokens):
        raise TypeError("object of type 'int' has no len()")

    def on_finish(self, request, block_ids):
        raise OSError("No space left on device")


def test_a_connector_that_raises_leaves_the_request_to_be_computed_here_and_the_scheduler_running():
    from tokenmill.kv_connector import GuardedConnector
    s = make_scheduler(budget=32, block_size=4, connector=GuardedConnector(Broken(offer=8)))
    s.add_request(make_request("a", prompt_len=10, max_tokens=2))
    steps = run_to_completion(s)
    assert [step.num_scheduled_tokens for step in steps] == [[10], [1]]
    assert s.stats().num_external_tokens == 0 and s.stats().kv_blocks_used == 0
