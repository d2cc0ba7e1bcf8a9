"""Tensor parallelism end to end: an engine with tensor_parallel_size=2 (this process rank 0, one
rank process beside it, gloo on 127.0.0.1) against the one-process engine on the tiny models;
models it must refuse; and a rank killed mid-run."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import copy_model, write_gguf_from_hf
from test_server import running_server

from tokenmill.config import EngineConfig
from tokenmill.engine import LLMEngine
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams

PREFIX = list(range(10, 58))  # 48 tokens: three blocks of 16 that later prompts share


def workload(llm: LLM) -> list:
    """Chunked prefill beside decodes (16-token steps), a pool small enough to preempt, then a prompt
    that hits the prefix cache; greedy, with logprobs, and prompt logprobs for a prompt of its own
    (a request that scores its prompt computes all of it: no prefix hit)."""
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=3, ignore_eos=True)
    scored = params.clone(prompt_logprobs=2)
    first = [PREFIX + [60 + i, 70 + i] for i in range(4)] + [PREFIX[::-1]]
    outputs = llm.generate(first, [params] * 4 + [scored], use_tqdm=False)
    outputs += llm.generate([PREFIX + [99]], params, use_tqdm=False)
    return outputs


def engine_options(preemption_mode: str) -> dict:
    # dtype float32: GGUF blocks decoded exactly on every CPU (with VNNI the default takes x in 8-bit
    # blocks, where a product a rank dequantizes to float32 would differ from one rank's)
    return dict(max_num_batched_tokens=16, num_kv_blocks=10, block_size=16, preemption_mode=preemption_mode,
                swap_space="1MiB", dtype="float32")


def max_logprob_gap(a, b) -> float:
    gaps = [abs(x[t] - y[t]) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs) for t in x]
    gaps += [abs(x[t] - y[t]) for x, y in zip((a.prompt_logprobs or [None])[1:], (b.prompt_logprobs or [None])[1:])
             for t in x]
    return max(gaps)


def one_rank_against_two(model, preemption_mode: str, kv_cache_dtype: str = "auto") -> list[tuple]:
    """The workload on one rank and on two: pairs of outputs, after checking that both preempted and
    hit the prefix cache alike (and with swapping, that both ranks' blocks went out and came back)."""
    results, stats, swaps = {}, {}, []
    for size in (1, 2):
        llm = LLM(str(model), tensor_parallel_size=size, kv_cache_dtype=kv_cache_dtype,
                  **engine_options(preemption_mode))
        if size == 2:  # count the swap lists rank 0 sends
            peers = llm.engine.runner.worker.peers
            send_swap = peers.send_swap
            peers.send_swap = lambda out, back: (swaps.append((out, back)), send_swap(out, back))
        try:
            results[size] = workload(llm)
            stats[size] = llm.engine.scheduler.stats()
        finally:
            llm.engine.close()
    assert stats[2].num_preemptions > 0 and stats[2].num_preemptions == stats[1].num_preemptions
    assert stats[2].prefix_tokens_hit >= 48 and stats[2].prefix_tokens_hit == stats[1].prefix_tokens_hit
    if preemption_mode == "swap":  # the victim's blocks went out to the host pools and came back, on both ranks
        assert any(out for out, _ in swaps) and any(back for _, back in swaps)
    for one, two in zip(results[1], results[2]):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        assert len(two.outputs[0].token_ids) == 20
    return list(zip(results[1], results[2]))


@pytest.mark.parametrize("arch,preemption_mode", [("llama", "swap"), ("qwen2", "recompute"), ("qwen3", "recompute")])
def test_two_ranks_give_one_ranks_greedy_tokens_and_logprobs_within_1e_4(tiny_models, arch, preemption_mode) -> None:
    for one, two in one_rank_against_two(tiny_models[arch], preemption_mode):
        assert max_logprob_gap(one, two) < 1e-4


def test_two_ranks_with_int8_pools_give_one_ranks_greedy_tokens_and_logprobs_within_1e_3(tiny_llama) -> None:
    """Each rank's int8 pool holds its kv heads' codes and scales. A key that differs from one rank's
    in its last bits (the projections' sums split over two ranks) may round to the next code, a step
    of max |x| / 127: the logprobs differ by more than the float pools' 1e-4."""
    for one, two in one_rank_against_two(tiny_llama, "swap", "int8"):
        assert max_logprob_gap(one, two) < 1e-3


@pytest.mark.parametrize("arch,qtype", [("qwen2_moe", None), ("qwen3_moe", "Q8_0")])
def test_a_mixture_of_experts_on_two_ranks_holding_half_the_experts_each_gives_one_ranks_greedy_tokens(
        tiny_moe_models, tiny_llama, tmp_path, arch, qtype) -> None:
    """Expert parallelism: each rank builds only its 4 of the 8 experts (the others absent), the
    router whole, Qwen2-MoE's dense layer 0 and shared expert cut as dense MLPs; from a Hugging Face
    directory, and from a GGUF file whose merged expert tensors stay in their Q8_0 blocks. The same
    greedy tokens as one rank, logprobs within 1e-4."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.models.loader import load_model, open_checkpoint
    from tokenmill.models.moe import AbsentExpert
    from tokenmill.models.parallel import TPShard
    path = tiny_moe_models[arch]
    if qtype is not None:
        path = tmp_path / f"{arch}-{qtype}.gguf"
        write_gguf_from_hf(AutoModelForCausalLM.from_pretrained(str(tiny_moe_models[arch]), dtype=torch.float32),
                           path, qtype)
    rank1 = load_model(open_checkpoint(path), 64, torch.float32, torch.device("cpu"), kernels="auto",
                       shard=TPShard(1, 2), all_reduce=lambda t: t)
    held = [not isinstance(e, AbsentExpert) for e in rank1.layers[1].mlp.inner.experts]
    assert held == [False] * 4 + [True] * 4
    results = {}
    for size in (1, 2):
        llm = LLM(str(path), tokenizer=str(tiny_llama) if qtype else None, tensor_parallel_size=size,
                  **engine_options("recompute"))
        try:
            results[size] = workload(llm)
        finally:
            llm.engine.close()
    for one, two in zip(results[1], results[2]):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        assert len(two.outputs[0].token_ids) == 20
        assert max_logprob_gap(one, two) < 1e-4


def test_a_model_whose_kv_heads_do_not_divide_by_the_size_is_refused_naming_the_counts(tiny_llama) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the model's num_kv_heads = 2 "
                                         r"\(pick a size that divides each of num_heads 6, num_kv_heads 2, "
                                         r"intermediate_size 192\)$"):
        LLM(str(tiny_llama), tensor_parallel_size=3)


def test_a_model_whose_intermediate_size_does_not_divide_is_refused_before_any_rank_starts(tiny_llama,
                                                                                             tmp_path) -> None:
    odd = copy_model(tiny_llama, tmp_path / "odd", intermediate_size=191)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"does not divide the model's intermediate_size = 191 \("):
        LLM(str(odd), tensor_parallel_size=2)
    assert time.monotonic() - start < 5  # refused from config.json: no rank started, no weight read


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_a_quantized_gguf_on_two_ranks_gives_one_ranks_greedy_tokens_and_logprobs_within_1e_4(
        tiny_llama, tmp_path, qtype, caplog) -> None:
    """A llama GGUF (permuted q/k rows) whose projections, head and embeddings are all Q8_0 or Q4_K,
    each rank keeping its shard in the file's blocks: the same greedy tokens as one rank, logprobs
    within 1e-4 (the row-parallel sums add two partial sums: float32 rounding, not bit-identity).
    Q4_K's o_proj, whose 128 input columns a rank would cut its 256-weight super-blocks, is
    dequantized to float32 on each rank, which says so."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("llama", vocab_size=384, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, initializer_range=0.05)
    torch.manual_seed(0)
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf_from_hf(AutoModelForCausalLM.from_config(config, dtype=torch.float32), path, qtype)
    results = {}
    for size in (1, 2):
        caplog.clear()
        llm = LLM(str(path), tokenizer=str(tiny_llama), tensor_parallel_size=size, **engine_options("recompute"))
        try:
            results[size] = workload(llm)
        finally:
            llm.engine.close()
    warned = [r.getMessage() for r in caplog.records if "dequantized to float32" in r.getMessage()]
    assert warned == ([] if qtype == "Q8_0" else [
        "tensor_parallel_size 2, rank 0: 2 GGUF matrices dequantized to float32 (input-column shards that "
        "would cut quantized blocks): blk.0.attn_output.weight (Q4_K, blocks of 256 weights, 128 columns a rank), "
        "blk.1.attn_output.weight (Q4_K, blocks of 256 weights, 128 columns a rank)"])
    for one, two in zip(results[1], results[2]):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        assert len(two.outputs[0].token_ids) == 20
        assert max_logprob_gap(one, two) < 1e-4


def test_a_rank_killed_with_sigkill_fails_the_running_requests_with_its_name_within_seconds(tiny_llama) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), tensor_parallel_size=2, num_kv_blocks=32))
    try:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        for i in range(3):
            engine.add_request(str(i), [5 + i, 6, 7, 8], params)
        for _ in range(3):
            assert not any(out.error for out in engine.step())
        pid = engine.ranks.processes[0].pid
        os.kill(pid, signal.SIGKILL)
        start, failed = time.monotonic(), {}
        while engine.has_unfinished_requests() and time.monotonic() - start < 10:
            failed.update((out.request_id, out) for out in engine.step() if out.finished)
        assert time.monotonic() - start < 5
        assert sorted(failed) == ["0", "1", "2"]
        expected = f"tensor-parallel rank 1 (pid {pid}) is gone (killed by SIGKILL)"
        assert all(expected in out.error and out.outputs[0].finish_reason == "error" for out in failed.values())
        # a request after that fails at once with the same error, without a collective to wait on
        engine.add_request("late", [5, 6], params)
        start = time.monotonic()
        out = engine.step()
        assert time.monotonic() - start < 1 and [o.request_id for o in out] == ["late"] and expected in out[0].error
    finally:
        start = time.monotonic()
        engine.close()
    assert time.monotonic() - start < 2


def test_health_and_new_requests_answer_503_naming_a_rank_that_was_killed(tiny_llama) -> None:
    with running_server(tiny_llama, engine_options={"tensor_parallel_size": 2}) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        pid = server.engine.ranks.processes[0].pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (answer := httpx.get(server.url + "/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert answer.status_code == 503
        assert answer.json()["error"]["message"].startswith(f"tensor-parallel rank 1 (pid {pid}) is gone (killed by")
        # a request from then on is refused with the same 503, not run into a failing step (a 500)
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 4})
        assert answer.status_code == 503
        assert answer.json()["error"]["message"].startswith(f"tensor-parallel rank 1 (pid {pid}) is gone (killed by")
        server.engine.close()


def test_a_rank_leaves_within_seconds_when_the_engine_process_is_killed(tiny_llama) -> None:
    script = (f"from tokenmill.llm import LLM\nllm = LLM({str(tiny_llama)!r}, tensor_parallel_size=2)\n"
              "print(llm.engine.ranks.processes[0].pid, flush=True)\nimport time\ntime.sleep(120)\n")
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        ready = selectors.DefaultSelector()
        ready.register(engine.stdout, selectors.EVENT_READ)
        assert ready.select(timeout=90), "the engine did not start within 90 s"
        rank_pid = int(engine.stdout.readline())
        engine.kill()
        engine.wait(10)
        start = time.monotonic()
        while time.monotonic() - start < 15 and _alive(rank_pid):
            time.sleep(0.05)
        assert not _alive(rank_pid), "rank 1 outlived its engine by 15 s"
        assert "rank 0 is gone" in engine.stderr.read()
    finally:
        if engine.poll() is None:
            engine.kill()
        engine.wait()


def _alive(pid: int) -> bool:
    """Running (a zombie that no init reaps counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_two_torchrun_invocations_on_127_0_0_1_give_one_processs_greedy_text(tiny_llama, tmp_path) -> None:
    """Multi-node as two torchrun agents (--nnodes 2, --node-rank 0 and 1, c10d rendezvous) on one
    machine: the process that becomes rank 0 prints the answer, the other runs its shard."""
    prompt, options = "w5 w6 w7 w8", ["--max-tokens", "12", "--temperature", "0", "--num-kv-blocks", "32"]
    llm = LLM(str(tiny_llama), num_kv_blocks=32)
    expected = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0].text
    port = _free_port()
    torchrun = Path(sys.executable).with_name("torchrun")
    agents = [subprocess.Popen(
        [str(torchrun), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "tokenmill-test", "--max-restarts", "0",
         "-m", "tokenmill.cli", "generate", "--model", str(tiny_llama), "--tensor-parallel-size", "2", *options,
         prompt], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])))
        for node in (0, 1)]
    try:
        results = [agent.communicate(timeout=150) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    assert [agent.returncode for agent in agents] == [0, 0], [err[-2000:] for _, err in results]
    printed = [out for out, _ in results if out.strip()]
    assert len(printed) == 1 and printed[0].startswith(prompt) and expected in printed[0]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
