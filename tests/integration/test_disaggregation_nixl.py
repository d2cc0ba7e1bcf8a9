"""Disaggregated prefill and decode through the NIXL KV connector (kv_nixl.py): a prefill engine
in a second process (nixl_prefill_peer.py; NIXL wants one agent a process) and a decode engine
here reading its blocks over UCX on loopback, against one engine doing both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the NIXL connector needs nixl-cu12 (pip install nixl-cu12)")

from tokenmill import LLM, SamplingParams  # noqa: E402

PROMPTS = [[5 + (7 * i + j) % 90 for j in range(40 + 9 * i)] for i in range(3)]  # 40, 49, 58 tokens
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
OPTIONS = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 64}
PEER = Path(__file__).with_name("nixl_prefill_peer.py")


class Peer:
    """The prefill engine's process (nixl_prefill_peer.py)."""

    def __init__(self, model: Path, **options) -> None:
        self.proc = subprocess.Popen([sys.executable, str(PEER), str(model), json.dumps({**OPTIONS, **options})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._answer() == "ready"

    def ask(self, **command):
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self):
        for line in self.proc.stdout:
            if line.startswith("@"):
                return json.loads(line[1:])
        raise AssertionError(f"the prefill peer ended with status {self.proc.wait(10)}")

    def close(self) -> int:
        if self.proc.poll() is None:
            assert self.ask(op="exit") == "closed"
        return self.proc.wait(30)


@pytest.fixture(scope="module")
def peer(tiny_models):
    peer = Peer(tiny_models["llama"])
    yield peer
    if peer.proc.poll() is None:  # (the last test kills it)
        assert peer.close() == 0  # agents released: a clean exit


@pytest.fixture(scope="module")
def colocated(tiny_models) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in LLM(str(tiny_models["llama"]), **OPTIONS).generate(
        PROMPTS, GREEDY, use_tqdm=False)]


def decode(tiny_models, params: list[dict], sampling: SamplingParams = GREEDY,
           **options) -> tuple[list[list[int]], LLM, int]:
    """The decode instance's outputs for those params, the instance, and the prompt tokens it computed."""
    llm = LLM(str(tiny_models["llama"]), kv_role="decode", kv_connector="nixl", **{**OPTIONS, **options})
    computed = []
    llm.engine.stats_listeners.append(lambda stats: computed.append(stats.num_prefill_tokens))
    outs = llm.generate(PROMPTS, [sampling.clone(kv_transfer_params=p) for p in params], use_tqdm=False)
    llm.engine.close()
    return [out.outputs[0].token_ids for out in outs], llm, sum(computed)


def test_the_decode_instance_reads_the_blocks_computes_each_last_prompt_token_and_answers_as_one_instance(
        tiny_models, peer, colocated):
    params = peer.ask(op="prefill", prompts=PROMPTS)
    assert [p["remote_block_ids"] != [] and p["do_remote_prefill"] and not p["do_remote_decode"] for p in params] \
        == [True] * 3
    assert [len(p["remote_block_ids"]) for p in params] == [2, 3, 3]  # full blocks of 16 of 40, 49, 58 tokens
    # the scheduler holds all their blocks (3, 4, 4), the partial last ones too, until the reads end
    assert peer.ask(op="held", within=0) == {"requests": 3, "blocks": 3 + 4 + 4, "timeouts": 0}
    outputs, llm, computed = decode(tiny_models, params)
    assert outputs == colocated
    assert llm.engine.scheduler.stats().num_external_tokens == 32 + 48 + 48
    assert computed == (40 - 32) + (49 - 48) + (58 - 48)
    assert llm.engine.scheduler.connector.num_blocks_loaded == 8
    # the reads' notifications free the blocks, long before the hold times out
    assert peer.ask(op="held", within=10) == {"requests": 0, "blocks": 0, "timeouts": 0}


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_prefill_instance_takes_under_a_fifth_of_a_core(peer):
    """Its agent's progress thread sleeps in poll() between polls (kv_nixl.make_agent); one that
    spins takes most of a core, or whatever share of it a loaded machine leaves it."""
    before, start = cpu_seconds(peer.proc.pid), time.monotonic()
    time.sleep(2.0)
    assert (cpu_seconds(peer.proc.pid) - before) / (time.monotonic() - start) < 0.2


def test_a_request_preempted_on_the_decode_instance_still_answers_right(tiny_models, peer):
    """Seven blocks: the first two prompts' loads start together (2 + 3 blocks), and the first one
    grows past what is left (40 + 40 tokens: 5 blocks) while the second holds its blocks, loading or
    running, whenever its load ends."""
    longer = GREEDY.clone(max_tokens=40)
    colocated = [out.outputs[0].token_ids for out in LLM(str(tiny_models["llama"]), **OPTIONS).generate(
        PROMPTS, longer, use_tqdm=False)]
    params = peer.ask(op="prefill", prompts=PROMPTS)
    outputs, llm, _ = decode(tiny_models, params, longer, num_kv_blocks=7)
    assert outputs == colocated
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.connector.num_load_failures == 0
    assert peer.ask(op="held", within=10)["requests"] == 0


def test_blocks_that_cannot_be_read_are_computed_here_and_freed_on_notice_or_timeout(tiny_models, peer, colocated):
    llm = LLM(str(tiny_models["llama"]), kv_role="decode", kv_connector="nixl", **OPTIONS)
    before = peer.ask(op="hold_timeout", seconds=6.0)  # (params then expire after 3 s)
    try:
        params = peer.ask(op="prefill", prompts=PROMPTS)
        wrong = [{**params[0], "remote_engine_id": "f" * 32},         # another instance answers there
                 {**params[1], "remote_block_ids": [10_000, 1, 2]},   # past the end of its pool
                 {**params[2], "remote_port": 1}]                     # nobody listens there
        outs = llm.generate(PROMPTS, [GREEDY.clone(kv_transfer_params=p) for p in wrong], use_tqdm=False)
        llm.engine.close()
        assert [out.outputs[0].token_ids for out in outs] == colocated
        assert llm.engine.scheduler.stats().num_external_tokens == 0
        assert llm.engine.scheduler.connector.num_load_failures == 3
        # only the second read met the prefill agent: its failure is noticed, the other two time out
        assert peer.ask(op="held", within=2.0, until=2) == {"requests": 2, "blocks": 3 + 4, "timeouts": 0}
        assert peer.ask(op="held", within=10) == {"requests": 0, "blocks": 0, "timeouts": 2}
    finally:
        peer.ask(op="hold_timeout", seconds=before)


def test_a_prefill_instance_that_is_gone_leaves_the_prompt_to_the_decode_instance(tiny_models, peer, colocated):
    """Ends the module's peer (so it comes last): the decode instance has met its agent already."""
    llm = LLM(str(tiny_models["llama"]), kv_role="decode", kv_connector="nixl", kv_transfer_timeout=2.0, **OPTIONS)
    params = peer.ask(op="prefill", prompts=PROMPTS)
    first = llm.generate(PROMPTS[0], GREEDY.clone(kv_transfer_params=params[0]), use_tqdm=False)[0]
    assert first.outputs[0].token_ids == colocated[0]
    assert llm.engine.scheduler.connector.num_blocks_loaded == 2
    peer.proc.kill()
    peer.proc.wait(30)
    outs = llm.generate(PROMPTS[1:], [GREEDY.clone(kv_transfer_params=p) for p in params[1:]], use_tqdm=False)
    llm.engine.close()
    assert [out.outputs[0].token_ids for out in outs] == colocated[1:]
    # the first read fails; the second is not tried, its engine having failed moments before
    assert llm.engine.scheduler.connector.num_load_failures == 1
    assert llm.engine.scheduler.stats().num_external_tokens == 32
