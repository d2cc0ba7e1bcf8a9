"""`tokenmill bench throughput` and `bench roofline` end to end on a tiny model: the tables, the CPU line, --compare."""

import json

from tokenmill.cli import main
from tokenmill.cpu_kernels import this_cpu

SMALL = ["--num-requests", "4", "--prompt-len", "4", "8", "--output-len", "4", "8", "--max-num-seqs", "4"]


def test_bench_throughput_compare_runs_every_baseline_and_records_the_cpu(tiny_llama, tmp_path, capsys):
    out, trace = tmp_path / "results.json", tmp_path / "trace.json"
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--compare", *SMALL, "--json", str(out),
                 "--trace-file", str(trace)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"CPU: {this_cpu().describe()}\n")
    # transformers in the dtype of tokenmill's weights: bfloat16 ones where the kernels have AVX512-BF16
    assert ("transformers generate in bfloat16" in printed) == this_cpu().has("avx512_bf16")
    results = json.loads(out.read_text())
    assert [r["name"] for r in results["results"]] == ["tokenmill", "static", "hf-generate"]
    assert results["cpu"] == this_cpu().as_dict()
    for path in (trace, tmp_path / "trace.static.json"):  # the engine's and its static baseline's
        events = json.loads(path.read_text())
        steps = [e for e in events if e["ph"] == "X" and e["name"].startswith("step ")]
        tracks = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 2]
        assert steps and len(tracks) >= 4  # the four requests (and any warm-up)
        assert {e["name"] for e in events if e["ph"] == "C"} == {"kv blocks", "requests"}


def test_a_baseline_that_fails_is_named_and_the_tables_still_printed(tiny_llama, monkeypatch, capsys):
    import tokenmill.bench.cli as bench_cli

    def fails(*args, **kwargs):
        raise ValueError("accelerate is required when loading a GGUF file")
    monkeypatch.setattr(bench_cli, "run_hf_generate", fails)
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--compare", *SMALL]) == 0
    printed = capsys.readouterr().out
    assert ("--compare: transformers generate failed (ValueError: accelerate is required when loading a GGUF "
            "file); left out of the table") in printed
    table = printed[printed.index("engine "):].splitlines()
    assert [line.split()[0] for line in table[1:3]] == ["tokenmill", "static"]


def test_bench_roofline_runs_the_workload_its_flags_size(tiny_llama, tmp_path, capsys):
    out = tmp_path / "roofline.json"
    assert main(["bench", "roofline", "--model", str(tiny_llama), "--num-requests", "3", "--prompt-len", "8", "8",
                 "--output-len", "5", "5", "--json", str(out)]) == 0
    assert "workload of 3 requests:" in capsys.readouterr().out
    results = json.loads(out.read_text())
    assert (results["num_requests"], results["output_tokens"]) == (3, 15)
