"""server/launch.py: where `tokenmill serve` takes its API key from, and its write timeout."""

import argparse

import pytest

from tokenmill.server.launch import add_serve_args, resolve_api_key


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
                                           ("empty", "holds no key")])
def test_a_key_file_that_gives_no_key_is_an_error_before_anything_loads(case, message, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    given = {"both": args(api_key="k", api_key_file=str(empty)), "missing": args(api_key_file=str(tmp_path / "no")),
             "empty": args(api_key_file=str(empty))}[case]
    with pytest.raises(SystemExit, match=message):
        resolve_api_key(given, {})


def test_the_stream_write_timeout_is_a_positive_number_of_seconds_60_by_default(capsys):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args([]).stream_write_timeout == 60.0
    assert parser.parse_args(["--stream-write-timeout", "2.5"]).stream_write_timeout == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--stream-write-timeout", bad])
        assert "expected a number of seconds > 0" in capsys.readouterr().err
