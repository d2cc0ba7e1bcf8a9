"""server/options.py: where `tokenmill serve` takes its API key from, which Host names it answers, its
connection limits, its stream write timeout and the sizes of what it keeps."""

import argparse

import pytest

from tokenmill.server.access import host_entry, host_name
from tokenmill.server.connections import FILES_RESERVED, connection_cap
from tokenmill.server.options import (
    add_serve_args,
    resolve_allowed_hosts,
    resolve_allowed_origins,
    resolve_api_key,
    seconds,
)


def args(api_key=None, api_key_file=None) -> argparse.Namespace:
    return argparse.Namespace(api_key=api_key, api_key_file=api_key_file)


def test_the_flag_then_the_file_then_the_environment_give_the_key(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("  from-file  \nsecond line\n")
    env = {"TOKENMILL_API_KEY": "from-env"}
    assert resolve_api_key(args(api_key="from-flag"), env) == "from-flag"
    assert resolve_api_key(args(api_key_file=str(key_file)), env) == "from-file"
    assert resolve_api_key(args(), env) == "from-env"
    assert resolve_api_key(args(), {}) is None
    assert resolve_api_key(args(), {"TOKENMILL_API_KEY": ""}) is None


@pytest.mark.parametrize("case, message", [("both", "not both"), ("missing", "cannot read"),
                                           ("empty", "holds no key"), ("blank flag", "the key is blank")])
def test_a_key_file_or_flag_that_gives_no_key_is_an_error_before_anything_loads(case, message, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    given = {"both": args(api_key="k", api_key_file=str(empty)), "missing": args(api_key_file=str(tmp_path / "no")),
             "empty": args(api_key_file=str(empty)), "blank flag": args(api_key=" ")}[case]
    with pytest.raises(SystemExit, match=message):
        resolve_api_key(given, {})


def test_without_a_key_a_loopback_server_answers_only_its_loopback_names():
    assert resolve_allowed_hosts(None, "127.0.0.1", "127.0.0.1", None) == ["127.0.0.1", "[::1]", "localhost"]
    assert resolve_allowed_hosts(None, "::1", "::1", None) == ["127.0.0.1", "[::1]", "localhost"]
    assert "127.0.0.5" in resolve_allowed_hosts(None, "127.0.0.5", "127.0.0.5", None)
    assert resolve_allowed_hosts(None, "127.0.0.1", "127.0.0.1", "key") is None      # the key guards it
    assert resolve_allowed_hosts(None, "0.0.0.0", "0.0.0.0", None) is None          # reached by names unknown here


def test_allowed_hosts_from_the_flag_apply_with_or_without_a_key_and_star_allows_any():
    assert resolve_allowed_hosts("api.example, localhost", "0.0.0.0", "0.0.0.0", "key") == ["api.example", "localhost"]
    assert resolve_allowed_hosts("*", "127.0.0.1", "127.0.0.1", None) is None
    with pytest.raises(SystemExit, match="host names"):
        resolve_allowed_hosts(" , ", "127.0.0.1", "127.0.0.1", None)


@pytest.mark.parametrize("header, name", [(b"localhost:8000", "localhost"), (b"LocalHost", "localhost"),
                                          (b"[::1]:80", "[::1]"), (b"[::1]", "[::1]"), (b"127.0.0.1", "127.0.0.1")])
def test_a_host_header_is_compared_by_its_name_without_the_port(header, name):
    assert host_name(header) == name
    assert host_entry(name.strip("[]")) == name


def test_allowed_origins_are_a_comma_list_or_vllms_json_list_and_none_by_default():
    assert resolve_allowed_origins(None) is None
    assert resolve_allowed_origins("https://app.example, http://localhost:3000/") == [
        "https://app.example", "http://localhost:3000"]
    assert resolve_allowed_origins('["*"]') == resolve_allowed_origins("*") == ["*"]
    for bad in ("", " , ", "app.example", '["https://a.example", 3]', "[not json"):
        with pytest.raises(SystemExit, match="--allowed-origins"):
            resolve_allowed_origins(bad)


def test_the_connection_cap_leaves_room_under_the_open_file_limit():
    assert connection_cap(1024, 1_048_576) == 1024
    assert connection_cap(1024, None) == 1024  # no limit
    assert connection_cap(1024, 1024) == 1024 - FILES_RESERVED
    assert connection_cap(1024, 100) == 1


@pytest.mark.parametrize("text", ["0", "-1", "inf", "nan", "soon"])
def test_a_timeout_is_a_positive_finite_number_of_seconds(text):
    with pytest.raises(argparse.ArgumentTypeError):
        seconds(text)
    assert seconds("0.5") == 0.5


def test_the_stream_write_timeout_is_a_positive_number_of_seconds_60_by_default(capsys):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args([]).stream_write_timeout == 60.0
    assert parser.parse_args(["--stream-write-timeout", "2.5"]).stream_write_timeout == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--stream-write-timeout", bad])
        assert "expected a positive number of seconds" in capsys.readouterr().err


def test_the_request_log_keeps_1000_ended_responses_by_default_and_takes_no_negative_size(capsys):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args([]).request_log_size == 1000
    assert parser.parse_args(["--request-log-size", "0"]).request_log_size == 0
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--request-log-size", bad])
        assert "expected an integer >= 0" in capsys.readouterr().err


def test_the_responses_store_keeps_1000_responses_by_default_and_takes_no_negative_size(capsys):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args([]).responses_store_size == 1000
    assert parser.parse_args(["--responses-store-size", "0"]).responses_store_size == 0
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--responses-store-size", bad])
        assert "expected an integer >= 0" in capsys.readouterr().err


def test_the_reasoning_parser_flag_takes_harmony_beside_the_think_parsers():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert [parser.parse_args(["--reasoning-parser", name]).reasoning_parser
            for name in ("qwen3", "deepseek_r1", "harmony")] == ["qwen3", "deepseek_r1", "harmony"]
