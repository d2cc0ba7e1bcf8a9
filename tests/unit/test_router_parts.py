"""tokenmill router's parts without processes: the prefix chain and its bounded set, the routing
text of a request, the policies' choices, the queue length read from a replica's /metrics, and
the command line's checks."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket

import httpx
import pytest

from tokenmill.router.app import create_app
from tokenmill.router.forward import Forwarder, sse_events
from tokenmill.router.launch import add_router_args, distinct_replicas, replica_url
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import CacheAware, LeastLoaded, RoundRobin, make_policy
from tokenmill.router.prefix import (
    CHUNK_CHARS,
    DEFAULT_DECODE_TOKENS,
    MAX_DECODE_TOKENS,
    PrefixSet,
    chunk_hashes,
    decode_tokens,
    routing_text,
)
from tokenmill.router.replicas import Replica, poll, waiting_requests


def replicas(n: int, capacity: int = 1000) -> list[Replica]:
    return [Replica(f"http://127.0.0.1:{8001 + i}", PrefixSet(capacity), healthy=True) for i in range(n)]


def test_texts_sharing_their_first_two_chunks_share_exactly_their_first_two_hashes():
    shared = "a" * (2 * CHUNK_CHARS)
    one, two = chunk_hashes(shared + "b" * CHUNK_CHARS), chunk_hashes(shared + "c" * CHUNK_CHARS + "tail")
    assert len(one) == len(two) == 3
    assert one[:2] == two[:2] and one[2] != two[2]


def test_a_partial_last_chunk_has_no_hash_and_equal_chunks_at_other_places_differ():
    assert chunk_hashes("x" * (CHUNK_CHARS - 1)) == []
    assert len(chunk_hashes("x" * (2 * CHUNK_CHARS + 5))) == 2
    hashes = chunk_hashes("x" * (3 * CHUNK_CHARS))
    assert len(set(hashes)) == 3  # each covers its whole prefix, not only its own chunk


def test_a_lone_surrogate_in_a_prompt_hashes_without_error():
    assert len(chunk_hashes("\ud800" * CHUNK_CHARS)) == 1


def test_the_prefix_set_matches_leading_chunks_only():
    prefixes = PrefixSet(100)
    prefixes.insert(chunk_hashes("a" * (3 * CHUNK_CHARS)))
    assert prefixes.match(chunk_hashes("a" * (5 * CHUNK_CHARS))) == 3
    assert prefixes.match(chunk_hashes("b" + "a" * (5 * CHUNK_CHARS))) == 0
    assert prefixes.match([]) == 0


def test_past_its_capacity_the_set_drops_the_least_recent_chains_ends_first():
    prefixes = PrefixSet(4)
    old = chunk_hashes("o" * (3 * CHUNK_CHARS))
    prefixes.insert(old)
    new = chunk_hashes("n" * (2 * CHUNK_CHARS))
    prefixes.insert(new)
    assert len(prefixes) == 4
    assert prefixes.match(new) == 2
    assert prefixes.match(old) == 2  # the old chain lost its last chunk, not its first
    prefixes.clear()
    assert len(prefixes) == 0 and prefixes.match(new) == 0


def test_the_routing_text_is_the_prompt_or_the_tools_and_messages_in_order():
    assert routing_text("/v1/completions", {"prompt": "hello"}) == "hello"
    assert routing_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert routing_text("/v1/completions", {"prompt": [1, 2, 3]}) == "[1, 2, 3]"
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert routing_text("/v1/chat/completions", chat) == "<system>be brief<user>hi"
    tools = routing_text("/v1/chat/completions", {**chat, "tools": [{"type": "function"}]})
    assert tools == '[{"type": "function"}]<system>be brief<user>hi'
    assert routing_text("/v1/chat/completions", {"messages": "not a list"}) == ""
    assert routing_text("/v1/completions", {"prompt": "hello", "cache_salt": "t1"}) == "<salt>t1</salt>hello"


def sent(policy: CacheAware, candidates: list[Replica], hashes: list[bytes]) -> tuple[Replica, str]:
    """The policy's choice, recorded in the chosen replica's prefix set as the forwarder does."""
    replica, reason = policy.choose(candidates, hashes)
    replica.route(hashes)
    return replica, reason


def test_cache_aware_sends_a_shared_prefix_where_it_went_before_and_a_new_one_to_the_emptier_replica():
    policy, (a, b) = CacheAware(), replicas(2)
    first = chunk_hashes("p" * (4 * CHUNK_CHARS) + "one")
    assert sent(policy, [a, b], first) == (a, "least_loaded")
    other = chunk_hashes("q" * (4 * CHUNK_CHARS))
    assert sent(policy, [a, b], other) == (b, "least_loaded")  # a holds prefixes, b none
    a.in_flight = 3   # three requests in flight: 3 chunks of wait (16 decode steps each) against the 4 a holds
    again = chunk_hashes("p" * (4 * CHUNK_CHARS) + "two" * CHUNK_CHARS)
    assert sent(policy, [a, b], again) == (a, "prefix")


def test_cache_aware_wants_the_threshold_share_of_the_chain_matched():
    policy, (a, b) = CacheAware(cache_threshold=0.5), replicas(2)
    sent(policy, [a, b], chunk_hashes("p" * (2 * CHUNK_CHARS)))
    b.in_flight = 1
    short_match = chunk_hashes("p" * (2 * CHUNK_CHARS) + "z" * (3 * CHUNK_CHARS))  # 2 of 5 chunks held by a
    a.in_flight = 2
    assert sent(policy, [a, b], short_match) == (b, "least_loaded")  # wait 6 against a's 7


def test_cache_aware_sends_a_prompt_past_a_prefix_holder_with_more_prompt_work_queued_than_it_saves():
    policy, (a, b) = CacheAware(), replicas(2)
    document = chunk_hashes("d" * (8 * CHUNK_CHARS) + "question one")
    sent(policy, [a, b], document)
    question = chunk_hashes("d" * (8 * CHUNK_CHARS) + "q" * (2 * CHUNK_CHARS))  # a holds 8 of its 10 chunks
    a.in_flight, a.prefilling, a.backlog = 2, 2, 13
    assert policy.choose([a, b], question) == (a, "prefix")     # wait 13 + 2 + 2 in flight against b's 10 + 8
    a.backlog = 14
    assert policy.choose([a, b], question) == (a, "prefix")     # a tie: the longer match wins
    a.backlog = 15
    assert policy.choose([a, b], question) == (b, "backlog")    # 19 against 18


def route_hot_prefix(policy: CacheAware, candidates: list[Replica], count: int, decode_tokens: int) -> list[str]:
    """Send `count` requests sharing an 8-chunk prefix (each with a chunk of its own) that all stay in
    flight, decoding; the last port digit of the replica each went to."""
    chosen = []
    for i in range(count):
        replica, _ = policy.choose(candidates, hot := chunk_hashes("h" * (8 * CHUNK_CHARS) + f"{i:064d}"),
                                   decode_tokens)
        replica.route(hot)
        replica.in_flight += 1
        chosen.append(replica.url[-1])
    return chosen


def test_a_hot_prefix_is_copied_to_another_replica_once_its_holders_wait_passes_computing_it_there():
    """16 decode steps: each request in flight adds a chunk to a replica's wait. b has 4 chunks of
    other prompt work queued. A non-holder's wait for a request is its backlog + 9 chunks + the 8
    held elsewhere once more: 21 on b, 17 on c. (Balancing by request counts is set out of the way.)"""
    policy, (a, b, c) = CacheAware(balance_abs=100), replicas(3)
    b.backlog = 4
    chosen = route_hot_prefix(policy, [a, b, c], 43, decode_tokens=16)
    # a takes the prefix while 1 + in flight <= 17 (a tie goes to the holder), then c copies it; the two
    # share it (ties to the first) until both have 21 in flight, past b's 21
    assert chosen == ["1"] * 17 + ["3"] * 17 + ["1", "3"] * 4 + ["2"]
    assert (a.in_flight, b.in_flight, c.in_flight) == (21, 1, 21)
    prefix = chunk_hashes("h" * (8 * CHUNK_CHARS))
    assert [r.prefixes.match(prefix) for r in (a, b, c)] == [8, 8, 8]
    hot = chunk_hashes("h" * (8 * CHUNK_CHARS) + "x" * CHUNK_CHARS)
    assert policy.choose([a, b, c], hot, 16) == (b, "prefix")  # b holds it now: 4 + 1 + 1 in flight


def test_a_hot_prefix_of_short_answers_stays_on_its_replica():
    """One decode step: a request in flight adds 1/16 chunk, and 43 of them stay under c's 17."""
    policy, (a, b, c) = CacheAware(balance_abs=100), replicas(3)
    b.backlog = 4
    assert route_hot_prefix(policy, [a, b, c], 43, decode_tokens=1) == ["1"] * 43


def test_the_decode_steps_weighed_are_max_tokens_capped_or_a_default():
    assert decode_tokens({"max_tokens": 64}) == 64
    assert decode_tokens({"max_completion_tokens": 8, "max_tokens": 64}) == 8
    assert decode_tokens({"max_tokens": 100_000}) == MAX_DECODE_TOKENS == 256
    for body in ({}, {"max_tokens": None}, {"max_tokens": 0}, {"max_tokens": "9"}, {"max_tokens": True}):
        assert decode_tokens(body) == DEFAULT_DECODE_TOKENS == 16


def test_cache_aware_goes_to_the_least_loaded_when_loads_are_uneven():
    policy, (a, b) = CacheAware(balance_abs=8, balance_rel=1.5), replicas(2)
    chain = chunk_hashes("p" * (4 * CHUNK_CHARS))
    sent(policy, [a, b], chain)
    a.in_flight, b.waiting = 10, 1
    assert sent(policy, [a, b], chain) == (b, "balance")
    assert b.prefixes.match(chain) == 4  # b now holds the prefix too
    a.in_flight = 9   # a difference of 8 is not past the threshold
    assert sent(policy, [a, b], chain)[1] == "prefix"


def test_round_robin_takes_each_candidate_in_turn_and_least_loaded_the_least_loaded():
    policy, (a, b, c) = RoundRobin(), replicas(3)
    assert [policy.choose([a, b, c], [])[0] for _ in range(4)] == [a, b, c, a]
    a.in_flight, b.waiting, c.in_flight = 2, 1, 3
    assert LeastLoaded().choose([a, b, c], []) == (b, "least_loaded")


def test_an_unknown_policy_or_a_threshold_out_of_range_is_refused():
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("random")
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("cache_aware", cache_threshold=1.5)
    with pytest.raises(ValueError, match="decode_weight"):
        make_policy("cache_aware", decode_weight=-1)


def test_going_down_clears_a_replicas_prefixes_and_queue():
    (a,) = replicas(1)
    a.prefixes.insert(chunk_hashes("p" * CHUNK_CHARS))
    a.waiting = 4
    a.mark_down("test")
    assert not a.healthy and len(a.prefixes) == 0 and a.waiting == 0
    a.mark_up()
    assert a.healthy


def test_the_queue_length_is_the_sum_of_vllms_waiting_samples():
    page = ("# HELP vllm:num_requests_waiting Requests waiting\n# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{model_name="a"} 3.0\nvllm:num_requests_waiting{model_name="b"} 2.0\n'
            "vllm:num_requests_waiting_other 7.0\ntokenmill_num_requests_waiting 9.0\n")
    assert waiting_requests(page) == 5
    assert waiting_requests("") == 0


def test_replica_urls_are_base_urls():
    assert replica_url("http://127.0.0.1:8001/") == "http://127.0.0.1:8001"
    assert replica_url("https://host.example") == "https://host.example"
    for bad in ("127.0.0.1:8001", "ftp://host", "http://host:8001/v1", "http://host:99999", "http://"):
        with pytest.raises(argparse.ArgumentTypeError):
            replica_url(bad)


def test_the_router_needs_a_replica_and_takes_several():
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([])
    args = parser.parse_args(["--replica", "http://a:1", "--replica", "http://b:2", "--policy", "round_robin"])
    assert args.replicas == ["http://a:1", "http://b:2"] and args.policy == "round_robin"


@pytest.mark.parametrize("flag, bad", [("--decode-weight", "-1"), ("--balance-abs-threshold", "-1"),
                                       ("--balance-rel-threshold", "0.5"), ("--min-uncached-chars", "-1"),
                                       ("--drain-timeout", "0")])
def test_a_router_flag_out_of_its_range_is_a_usage_error(flag, bad, capsys):
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--replica", "http://a:1", flag, bad])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


def test_an_instance_given_twice_is_refused_and_named():
    distinct_replicas(["http://a:1", "http://b:2"], ["http://c:3"])
    with pytest.raises(SystemExit, match=r"^each instance once: http://a:1 given more than once"):
        distinct_replicas(["http://a:1", "http://b:2", "http://a:1"], None)
    with pytest.raises(SystemExit, match="http://b:2 given more than once"):
        distinct_replicas(["http://a:1", "http://b:2"], ["http://b:2"])


def test_the_routers_stream_write_timeout_is_a_positive_number_of_seconds_60_by_default():
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    replica = ["--replica", "http://a:1"]
    assert parser.parse_args(replica).stream_write_timeout == 60.0
    assert parser.parse_args([*replica, "--stream-write-timeout", "0.5"]).stream_write_timeout == 0.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args([*replica, "--stream-write-timeout", bad])
    with pytest.raises(ValueError, match="stream_write_timeout must be > 0"):
        create_app(["http://a:1"], make_policy("cache_aware"), stream_write_timeout=0)


def test_with_no_replica_answering_the_router_says_503_in_openai_shape():
    """In process, without the app's lifespan: the replica was never polled (so it is not in
    routing), then it is taken for healthy but refuses connections (so the attempt fails, the
    replica leaves routing and no other is left)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    app = create_app([url], make_policy("cache_aware"))

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1") as client:
            health = await client.get("/health")
            never_polled = await client.post("/v1/completions", json={"prompt": "hi"})
            app.state.replicas[0].healthy = True
            refused = await client.post("/v1/completions", json={"prompt": "hi"})
            return health, never_polled, refused, app.state.replicas[0].healthy
    health, never_polled, refused, healthy_after = asyncio.run(ask())
    assert health.status_code == 503 and health.json()["replicas"][url]["healthy"] is False
    assert never_polled.status_code == 503
    assert never_polled.json()["error"] == {"message": "no replica is healthy", "type": "server_error", "param": None,
                                            "code": "no_replica_available"}
    assert refused.status_code == 503 and refused.json()["error"]["message"] == "no replica answered (1 tried)"
    assert not healthy_after


def test_with_no_decode_instance_healthy_no_prefill_leg_is_sent_and_the_answer_is_503():
    """A prefill leg would compute the prompt for nothing and answer later: up to tens of seconds
    when prompts queue on the prefill instance."""
    app = create_app(["http://127.0.0.1:9"], make_policy("cache_aware"), prefill_urls=["http://127.0.0.1:10"],
                     min_uncached_chars=10)

    async def ask():
        prefill = app.state.replicas[1]
        prefill.healthy = True  # nothing listens there: a leg sent would fail and take it out of routing
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1") as client:
            answer = await client.post("/v1/completions", json={"prompt": "w5 " * 200})
            return answer, prefill.healthy, (await client.get("/metrics")).text
    answer, prefill_healthy, metrics = asyncio.run(ask())
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_replica_available"
    assert prefill_healthy  # no leg was sent to it
    assert 'tokenmill_router_prefill_legs_total{outcome="failed"} 0.0' in metrics


def test_a_replicas_stream_is_relayed_in_whole_events_however_its_bytes_are_cut():
    class Upstream:
        async def aiter_raw(self):
            for chunk in (b"data: a\n", b"\ndata: b\n\nda", b"ta: c\n\ndata: d\n\n", b"data: [DONE]"):
                yield chunk

    async def collect():
        return [event async for event in sse_events(Upstream())]
    # what came together goes together, cut after its last whole event; a partial event waits for its end
    assert asyncio.run(collect()) == [b"data: a\n\ndata: b\n\n", b"data: c\n\ndata: d\n\n", b"data: [DONE]"]


def test_a_request_counts_in_its_replicas_backlog_until_its_first_event_and_in_flight_until_its_end():
    """A replica on loopback that answers a stream's first event only when told to: while it
    computes, the request's 3 chunks the replica did not hold are in its backlog."""
    async def scenario():
        go = asyncio.Event()

        async def replica_side(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await go.wait()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                         b"data: first\n\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(replica_side, "127.0.0.1", 0)
        (replica,) = [Replica(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", PrefixSet(100), healthy=True)]
        async with httpx.AsyncClient() as client:
            forwarder = Forwarder(client, [replica], CacheAware(), RouterMetrics())
            replica.route(chunk_hashes("s" * CHUNK_CHARS))
            hashes = chunk_hashes("s" * (4 * CHUNK_CHARS))
            answer = asyncio.ensure_future(forwarder.forward("POST", "/v1/completions", b"{}", {}, hashes))
            while replica.prefilling == 0:
                await asyncio.sleep(0.01)
            computing = (replica.in_flight, replica.prefilling, replica.backlog)
            go.set()
            relay = await asyncio.wait_for(answer, 10)
            streaming = (replica.in_flight, replica.prefilling, replica.backlog)
            await relay.upstream.aclose()
        server.close()
        await server.wait_closed()
        return computing, streaming
    computing, streaming = asyncio.run(scenario())
    assert computing == (1, 1, 3)
    assert streaming == (1, 0, 0)   # the relay gives its in-flight count back when the stream ends


def test_a_replica_whose_metrics_need_a_key_stays_in_routing_and_the_log_says_so_once(caplog):
    """A replica on loopback whose /health answers 200 and /metrics 401 (a replica run with
    --protect-metrics-and-docs), polled three times."""
    async def scenario() -> Replica:
        async def replica_side(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            status = b"200 OK" if head.startswith(b"GET /health ") else b"401 Unauthorized"
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(replica_side, "127.0.0.1", 0)
        replica = Replica(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", PrefixSet(100))
        async with httpx.AsyncClient() as client:
            for _ in range(3):
                await poll(client, replica, 5.0)
        server.close()
        await server.wait_closed()
        return replica
    with caplog.at_level(logging.WARNING, logger="tokenmill.router"):
        replica = asyncio.run(scenario())
    assert replica.healthy and replica.waiting == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"replica {replica.url}'s /metrics needs a key (--protect-metrics-and-docs): routing goes without its queue "
        "length"]
