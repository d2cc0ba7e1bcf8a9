"""The command line: mistakes are said before the model loads where they can be, in one line
naming what to change; `generate` prints each answer as soon as it can."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from tokenmill.cli import build_parser, main

HEAVY = "[m for m in ('torch', 'transformers', 'tokenmill.engine') if m in sys.modules]"


def test_help_and_every_subcommands_options_are_read_without_importing_torch_or_transformers():
    code = ("import sys; from tokenmill.cli import build_parser; parser = build_parser(); "
            "[parser.parse_args(argv) for argv in (['serve', '--port', '0'], ['router', '--replica', 'http://a:1'], "
            "['bench', 'throughput'], ['generate', 'hi'], ['chat'])]; print(" + HEAVY + ")")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_the_router_app_is_built_without_importing_torch_or_transformers():
    code = ("import sys; from tokenmill.router.app import create_app; from tokenmill.router.policy import RoundRobin; "
            "create_app(['http://127.0.0.1:1'], RoundRobin()); print(" + HEAVY + ")")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_serve_flag_that_needs_a_key_fails_before_torch_is_imported(tmp_path):
    code = ("import os, sys; os.environ.pop('TOKENMILL_API_KEY', None); from tokenmill.cli import main\n"
            "try:\n    main(['serve', 'none', '--port', '0', '--protect-metrics-and-docs'])\n"
            "except SystemExit as exc:\n    print(exc, " + HEAVY + ")")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.stdout.strip() == "--protect-metrics-and-docs needs an API key (--api-key, --api-key-file or "\
                                 "TOKENMILL_API_KEY) []", out.stderr


@pytest.mark.parametrize("command", [["generate"], ["chat"], ["serve"], ["bench", "throughput"], ["bench", "roofline"]])
def test_every_option_in_help_says_its_default_in_words(command, capsys):
    """An option whose default is derived (the model's, the machine's) says how, not "None"."""
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "--max-model-len MAX_MODEL_LEN context length, prompt + output " \
                                               "(default: the model's)" in text


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--temperature", "-1"], ["generate", "hi", "--top-p", "0"],
    ["generate", "hi", "--top-p", "1.5"], ["generate", "hi", "--max-tokens", "0"],
    ["chat", "--temperature", "-0.5"], ["bench", "throughput", "--top-p", "2"],
])
def test_bad_sampling_options_are_usage_errors_before_the_model_loads(argv, capsys):
    """The model path does not exist: only a check made before loading can name the option."""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--model", "/nonexistent"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and argv[-2][2:].replace("-", "_") in err and "/nonexistent" not in err


def test_generate_prints_each_answer_once_it_and_those_before_are_done(tiny_llama, monkeypatch):
    """With one sequence a step the prompts run one after the other: the first answer is out
    while the second still runs, and the answers come in the prompts' order."""
    from tokenmill.engine import LLMEngine
    steps = 0
    step = LLMEngine.step

    def counted(self):
        nonlocal steps
        steps += 1
        return step(self)
    monkeypatch.setattr(LLMEngine, "step", counted)
    written: list[tuple[int, str]] = []  # (steps run, text) per write to stdout

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            written.append((steps, text))
            return super().write(text)
    monkeypatch.setattr(sys, "stdout", Recorder())
    assert main(["generate", "w5 w6", "w7 w8", "--model", str(tiny_llama), "--max-tokens", "4",
                 "--temperature", "0", "--max-num-seqs", "1"]) == 0
    answers = [(at, text) for at, text in written if text.startswith("w")]
    assert [text.split()[0] for _, text in answers] == ["w5", "w7"]
    assert answers[0][0] < answers[1][0] == steps


def test_a_system_prompt_that_leaves_no_room_is_one_error(tiny_llama, monkeypatch, capsys):
    """Before, every message failed twice ("the conversation starts over") and chat exited 0."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("w5\n"))
    assert main(["chat", "--model", str(tiny_llama), "--max-model-len", "32", "--max-tokens", "8",
                 "--system", " ".join(["w9"] * 30)]) == 1
    err = capsys.readouterr().err
    assert "--system" in err and "32 tokens" in err and "Traceback" not in err


def test_a_tokenizer_path_that_does_not_exist_is_named(tiny_llama, tmp_path, capsys):
    """Not the hub's "Repo id must be in the form 'repo_name'" (transformers took it for a repo id)."""
    missing = tmp_path / "no-tokenizer"
    assert main(["generate", "w5", "--model", str(tiny_llama), "--tokenizer", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tokenmill: tokenizer path") and str(missing) in err and "Repo id" not in err


@pytest.mark.parametrize("flags", [["--num-kv-blocks", str(10**12)], ["--kv-cache-memory", "10000TiB"]])
def test_a_pool_too_big_for_memory_names_its_size_and_option(tiny_llama, flags, capsys):
    """(10^12 blocks of 8 KiB are past any address space, whatever the overcommit setting.)"""
    assert main(["generate", "w5", "--model", str(tiny_llama), "--dtype", "float32", *flags]) == 1
    err = capsys.readouterr().err
    assert f"lower {flags[0]}" in err and "blocks x 8192 bytes" in err and "GiB" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("bench", ["throughput", "serve", "spec", "roofline"])
def test_unwritable_json_and_plot_paths_are_usage_errors_before_the_run(bench, tmp_path, capsys):
    """Found out after the run, they threw away minutes of benchmarking."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    bad = [["--json", str(a_file / "out.json")], ["--json", str(tmp_path)]]
    if bench in ("throughput", "serve"):
        bad += [["--plot", str(a_file)], ["--plot", str(a_file / "plots")]]
    for flags in bad:
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["bench", bench, *flags])
        assert exit_info.value.code == 2 and flags[0] in capsys.readouterr().err
    args = build_parser().parse_args(["bench", bench, "--json", str(tmp_path / "new" / "out.json")])
    assert args.json == tmp_path / "new" / "out.json"  # folders that do not exist yet are made
    if bench in ("throughput", "serve"):
        assert build_parser().parse_args(["bench", bench, "--plot", str(tmp_path / "new")]).plot == tmp_path / "new"
