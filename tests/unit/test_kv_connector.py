"""The scheduler's KV connector seam (kv_connector.py): where a connector is asked, what it is
told, and how its tokens move the request's counter. A recording connector, no model."""

from __future__ import annotations

from fakes import fake_run, make_request, make_scheduler, run_to_completion

from tokenmill.outputs import FinishResult
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


class Recorder:
    """Offers `offer` tokens to every request, loads them (or fails to, with `fail`; with `manual`,
    a load ends only when the test puts it in `ended`), holds the blocks of requests that end by
    length (with `hold`) until `release` names them, and records each call."""

    def __init__(self, offer: int, fail: bool = False, hold: bool = False, manual: bool = False,
                 only: set[str] | None = None) -> None:
        self.offer = offer
        self.only = only  # the requests offered tokens (None: all)
        self.fail = fail
        self.hold = hold
        self.manual = manual
        self.ended: dict[str, bool] = {}
        self.release: list[str] = []
        self.calls: list[tuple] = []

    def num_matched_tokens(self, request, num_local_tokens):
        self.calls.append(("matched", request.request_id, num_local_tokens))
        return self.offer if self.only is None or request.request_id in self.only else 0

    def start_load(self, request, block_ids, num_local_tokens, num_external_tokens):
        self.calls.append(("load", request.request_id, list(block_ids), num_local_tokens, num_external_tokens))
        if not self.manual:
            self.ended[request.request_id] = not self.fail
        return True

    def finished_loads(self):
        ended, self.ended = self.ended, {}
        return ended

    def cancel_load(self, request_id):
        self.calls.append(("cancel", request_id))

    def on_finish(self, request, block_ids):
        self.calls.append(("finished", request.request_id, list(block_ids), request.status.name))
        by_length = request.status.name == "FINISHED_LENGTH"
        return FinishResult({"do_remote_prefill": True} if by_length else None, hold_blocks=self.hold and by_length)

    def released(self):
        self.calls.append(("released",))
        released, self.release = self.release, []
        return released


def test_external_tokens_get_blocks_at_admission_and_count_as_computed_once_loaded():
    connector = Recorder(offer=8)
    s = make_scheduler(budget=32, block_size=4, connector=connector)
    s.add_request(make_request("a", prompt_len=20, max_tokens=2))
    sched = s.schedule()  # starts the load: nothing of "a" runs in this step
    request = s.requests["a"]
    assert sched.requests == [] and list(s.loading) == ["a"] and request.num_computed_tokens == 0
    assert s.stats().num_waiting == 1 and s.prompt_tokens_waiting() == 20
    sched = s.schedule()
    assert list(zip([r.request_id for r in sched.requests], sched.num_scheduled_tokens)) == [("a", 12)]
    assert request.num_computed_tokens == 8 and request.num_cached_tokens == 0 and request.block_ids == [0, 1, 2, 3, 4]
    assert request.num_external_tokens == 8 and s.stats().num_external_tokens == 8
    assert connector.calls == [("matched", "a", 0), ("load", "a", [0, 1], 0, 8)]


def test_the_last_prompt_token_is_always_computed_here():
    connector = Recorder(offer=100)
    s = make_scheduler(budget=32, block_size=4, connector=connector)
    s.add_request(make_request("a", prompt_len=10, max_tokens=2))
    s.schedule()
    sched = s.schedule()
    assert sched.num_scheduled_tokens == [1] and s.requests["a"].num_computed_tokens == 9


def test_the_local_prefix_hit_comes_first_and_the_connector_supplies_what_follows():
    connector = Recorder(offer=4, only={"b"})
    s = make_scheduler(budget=32, block_size=4, prefix_caching=True, connector=connector)
    s.add_request(make_request("a", prompt_len=16, max_tokens=1))
    first = s.schedule()
    s.update(first, fake_run(first))
    s.add_request(make_request("b", prompt_len=16, max_tokens=1))  # the same tokens: 12 cached, 3 blocks
    connector.calls.clear()
    s.schedule()  # starts b's load of the token past the local hit
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
    s.schedule()
    sched = s.schedule()
    a = s.requests["a"]
    assert sched.num_scheduled_tokens == [8] and a.num_computed_tokens == 0 and a.num_external_tokens == 0
    assert a.num_registered_blocks == 2  # the two blocks this step fills; not the three promised past them
    s.update(sched, fake_run(sched))
    assert s.kv.find_prefix(make_request("b", prompt_len=20, max_tokens=2)).num_tokens == 8  # computed ones only
    steps = run_to_completion(s)
    assert [step.num_scheduled_tokens for step in steps] == [[8], [4], [1]]  # the rest of the prompt, then a decode
    assert s.stats().num_external_tokens == 0 and s.stats().kv_blocks_used == 0


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


def test_a_request_waits_apart_while_its_load_runs_and_its_blocks_are_offered_to_the_cache_once_loaded():
    connector = Recorder(offer=8, manual=True, only={"a"})
    s = make_scheduler(budget=32, block_size=4, prefix_caching=True, connector=connector)
    s.add_request(make_request("a", prompt_len=12, max_tokens=2))
    s.add_request(Request(request_id="other", prompt_token_ids=[50 + i for i in range(6)], max_tokens=4,
                          params=SamplingParams(max_tokens=4, ignore_eos=True)))
    steps = [s.schedule()]
    assert [r.request_id for r in steps[0].requests] == ["other"] and list(s.loading) == ["a"]
    for _ in range(2):  # "other" decodes; "a" holds its two blocks, none of them offered to the cache
        s.update(steps[-1], fake_run(steps[-1]))
        steps.append(s.schedule())
        assert [r.request_id for r in steps[-1].requests] == ["other"]
    assert s.requests["a"].num_registered_blocks == 0
    assert s.kv.find_prefix(make_request("c", prompt_len=12, max_tokens=2)).num_tokens == 0
    connector.ended = {"a": True}
    s.update(steps[-1], fake_run(steps[-1]))
    sched = s.schedule()
    assert list(zip([r.request_id for r in sched.requests], sched.num_scheduled_tokens)) == [("other", 1), ("a", 4)]
    assert s.requests["a"].num_registered_blocks == 3 and not s.loading
    assert s.kv.find_prefix(make_request("c", prompt_len=12, max_tokens=2)).num_tokens == 8


def test_a_request_that_ends_while_its_load_runs_has_it_cancelled_and_its_blocks_freed():
    connector = Recorder(offer=8, manual=True)
    s = make_scheduler(budget=32, block_size=4, connector=connector)
    s.add_request(make_request("a", prompt_len=12, max_tokens=2))
    s.schedule()
    assert s.stats().kv_blocks_used == 2
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert connector.calls[-2:] == [("cancel", "a"), ("finished", "a", [0, 1], "FINISHED_ABORTED")]
    assert not s.loading and not s.has_unfinished_requests() and s.stats().kv_blocks_used == 0
    connector.ended = {"a": True}  # a connector that names it anyway changes nothing
    assert s.schedule().requests == []


class Silent(Recorder):
    """Starts loads, then raises whenever asked which ended."""

    def finished_loads(self):
        raise ConnectionError("agent gone")


def test_a_connector_that_cannot_say_which_loads_ended_has_every_load_computed_here():
    from tokenmill.kv_connector import GuardedConnector
    connector = Silent(offer=8)
    s = make_scheduler(budget=32, block_size=4, connector=GuardedConnector(connector))
    s.add_request(make_request("a", prompt_len=12, max_tokens=2))
    steps = run_to_completion(s)
    assert [step.num_scheduled_tokens for step in steps] == [[], [12], [1]]
    assert ("cancel", "a") in connector.calls and s.stats().num_external_tokens == 0
    assert s.stats().kv_blocks_used == 0


def test_a_load_that_does_not_fit_yet_waits_for_room_instead_of_computing_the_tokens_here():
    connector = Recorder(offer=8, only={"a"})
    s = make_scheduler(num_blocks=5, block_size=4, budget=4, connector=connector)
    s.add_request(make_request("big", prompt_len=14, max_tokens=3, ignore_eos=True))  # 4 of the 5 blocks
    sched = s.schedule()
    s.add_request(make_request("a", prompt_len=12, max_tokens=2))
    while "big" in s.requests:
        # "a" waits: its first chunk (3 tokens beside big's decode) would fit the free block, its K/V not
        assert [r.request_id for r in sched.requests] == ["big"] and not s.loading
        assert not any(call[0] == "load" for call in connector.calls)
        s.update(sched, fake_run(sched))
        sched = s.schedule()
    assert list(s.loading) == ["a"] and sched.requests == []  # the step after "big" ended: its load starts
    steps = run_to_completion(s)
    assert [step.num_scheduled_tokens for step in steps] == [[4], [1]]
    assert s.stats().num_external_tokens == 8
