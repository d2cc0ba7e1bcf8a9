"""Tensor-parallel ranks: the processes rank 0 (the engine) starts and watches, and what each of
ranks 1..N-1 does, from joining the groups to its step loop.

    rank 0 (engine process)                      rank r (python -m tokenmill.tp_rank, or torchrun)
    RankProcesses: TCPStore on 127.0.0.1:0,
      start ranks 1..N-1 ------------------->    rank_main: store client, "joined/r"
    wait for every "joined/r" (or a death)
    join_group  <------- gloo/NCCL ------->      join_group
    load shard 0                                 load shard r          (an error: "error/r", exit)
    pool blocks: MIN over ranks  <-------->      pool blocks: MIN over ranks
    each step: send_step, own forward  ---->     receive, forward (all-reduces with every rank)
    close: SHUTDOWN, join, leave group  --->     leave the loop, leave group

A rank that dies is noticed by its process sentinel before each step, and by the collective in
flight when it goes (gloo fails at once on a closed connection; any collective fails after the
group's timeout): rank 0 then raises an error that names the rank, its pid and how it ended
(its own error message when it reported one), and every later step fails the same way at once.
A rank whose rank 0 goes away leaves its loop on the failed receive.

Ranks are started as `python -m tokenmill.tp_rank` rather than by multiprocessing's spawn, which
would run the caller's main module again in each (a script without an `if __name__ ==
"__main__"` guard would start engines recursively); the config travels as JSON on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tokenmill.attention import make_backend
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.device import activation_dtype, context_length, kv_dtype_name, rank_device, thread_governor
from tokenmill.distributed import (
    Message,
    StepSender,
    TPGroup,
    gather_logits,
    join_group,
    leave_group,
    receive,
    send_shutdown,
)
from tokenmill.model_runner import kv_pool_blocks
from tokenmill.models.loader import load_model, open_checkpoint, resolve_model_path
from tokenmill.models.parallel import TPShard
from tokenmill.worker import ModelWorker, kv_bytes_per_token

logger = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"
SHUTDOWN_WAIT_S = 10.0  # how long close() waits for a rank to leave before killing it


def torchrun_rank() -> int | None:
    """This process's global rank when torchrun started it; None otherwise."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"])


class RankProcesses:
    """Rank 0's handle on ranks 1..N-1: the processes it started and the store through which they
    join and report a failure to start; or, under torchrun, none of them (torchrun started every
    rank, and they meet through its rendezvous, env://)."""

    def __init__(self, config: EngineConfig, launch: bool = True) -> None:
        self.size = config.tensor_parallel_size
        self.timeout_s = config.distributed_timeout
        self.group: TPGroup | None = None
        self.store: dist.TCPStore | None = None
        self.processes: list[subprocess.Popen] = []
        if launch:
            self._launch(config)

    @classmethod
    def under_torchrun(cls, config: EngineConfig) -> RankProcesses:
        """Rank 0 of ranks that torchrun started (WORLD_SIZE of them, which must be the size)."""
        world = int(os.environ["WORLD_SIZE"])
        if world != config.tensor_parallel_size or torchrun_rank() != 0:
            raise ValueError(f"torchrun started {world} processes and this is rank {torchrun_rank()}: the engine "
                             f"runs on rank 0 of exactly tensor_parallel_size ({config.tensor_parallel_size})")
        return cls(config, launch=False)

    def _launch(self, config: EngineConfig) -> None:
        self.store = dist.TCPStore(STORE_HOST, 0, self.size, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        # the child imports this very package (an editable install elsewhere must not shadow it)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]))
        options = json.dumps(dataclasses.asdict(config))
        self.processes = [subprocess.Popen([sys.executable, "-m", "tokenmill.tp_rank", "--rank", str(rank),
                                            "--store", f"{STORE_HOST}:{self.store.port}", "--config", options],
                                           env=env)
                          for rank in range(1, self.size)]

    def join(self, device: torch.device) -> TPGroup:
        """Wait until every rank has come up, then join the groups as rank 0."""
        if self.store is None:  # torchrun's ranks: env://, bounded by the default group's timeout
            self.group = join_group(0, self.size, device, self.timeout_s)
            return self.group
        deadline = time.monotonic() + self.timeout_s
        keys = [f"joined/{rank}" for rank in range(1, self.size)]
        while not self.store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not start within {self.timeout_s:g} s "
                                   "(distributed_timeout)")
            time.sleep(0.02)
        self.group = join_group(0, self.size, device, self.timeout_s, self.store)
        return self.group

    def sender(self) -> StepSender:
        return StepSender(self.group, self.check, self.explain)

    def check(self) -> None:
        """Raise if a rank has exited."""
        death = self.death()
        if death is not None:
            raise RuntimeError(death)

    def death(self) -> str | None:
        """What ended the first rank that has exited, or None while all run (ranks this process
        started; torchrun watches its own)."""
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                return self._death(rank, process)
        return None

    def explain(self, exc: Exception) -> Exception:
        """The error for a failed collective: a rank's death when one died (its exit can trail the
        closed connection by a moment), else the collective's own error."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is not None:
                    return RuntimeError(self._death(rank, process))
            time.sleep(0.02)
        launched = "" if self.processes else " (a rank torchrun started may have died: see its log)"
        return RuntimeError(f"tensor-parallel collective failed{launched}: {exc}")

    def _death(self, rank: int, process: subprocess.Popen) -> str:
        code = process.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        key = f"error/{rank}"
        reported = f": {self.store.get(key).decode()}" if self.store.check([key]) else ""
        return f"tensor-parallel rank {rank} (pid {process.pid}) is gone ({how}){reported}"

    def abort(self) -> None:
        """After a failure to start: kill the ranks at once and leave the groups."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        if self.group is not None:
            leave_group()
            self.group = None

    def close(self) -> None:
        """Tell the ranks to leave, wait for them (killing any that does not), leave the groups."""
        if self.group is not None and all(p.poll() is None for p in self.processes):
            try:
                send_shutdown(self.group)
            except RuntimeError as exc:
                logger.warning("tensor-parallel shutdown message failed: %s", exc)
        for process in self.processes:
            try:
                process.wait(SHUTDOWN_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.group is not None:
            leave_group()
            self.group = None


def rank_main(config: EngineConfig, rank: int, store_host: str, store_port: int) -> None:
    """A started rank: join, build the shard's worker, run steps until SHUTDOWN or rank 0 is gone."""
    timeout = datetime.timedelta(seconds=config.distributed_timeout)
    store = dist.TCPStore(store_host, store_port, config.tensor_parallel_size, is_master=False, timeout=timeout)
    store.set(f"joined/{rank}", "1")
    try:
        group = join_group(rank, config.tensor_parallel_size, rank_device(config.device, rank),
                           config.distributed_timeout, store)
        worker = build_rank_worker(config, group)
    except Exception as exc:
        store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    serve_steps(worker, group)


def run_torchrun_rank(config: EngineConfig) -> None:
    """A rank other than 0 that torchrun started: join through env://, build the shard's worker, run
    steps until rank 0's SHUTDOWN (or until rank 0 is gone)."""
    rank, local_rank = torchrun_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {world} processes for tensor_parallel_size "
                         f"{config.tensor_parallel_size}: start exactly that many")
    group = join_group(rank, world, rank_device(config.device, local_rank), config.distributed_timeout)
    serve_steps(build_rank_worker(config, group), group)


def build_rank_worker(config: EngineConfig, group: TPGroup) -> ModelWorker:
    """Ranks 1..N-1: the shard's model and KV pool, sized as rank 0 sizes its own (build_engine_parts),
    with the same collective (the pool's MIN) at the same point."""
    device = group.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    checkpoint = open_checkpoint(resolve_model_path(config.model))
    dtype = activation_dtype(config, device)
    kv_dtype = getattr(torch, kv_dtype_name(config, checkpoint.quantized(), device))
    threads = thread_governor(config, device)
    max_len = context_length(config, checkpoint.config)
    model = load_model(checkpoint, max_len, dtype, device, config.kernels, config.gguf_blocks, config.int8_rows_choice,
                       TPShard(group.rank, group.size), group.all_reduce, config.bf16_weights_choice)
    local = model.config
    num_blocks = group.min_over_ranks(kv_pool_blocks(config, device, kv_bytes_per_token(local, kv_dtype), max_len))
    bytes_per_block = config.block_size * kv_bytes_per_token(local, kv_dtype)
    num_host_blocks = config.host_blocks(bytes_per_block)
    backend = make_backend(config.attention_backend, device, config.block_size, local.head_dim, dtype, kv_dtype)
    cache = CacheConfig(num_blocks, config.block_size, config.enable_prefix_caching)
    return ModelWorker(model, local, cache, backend, device, kv_dtype, num_host_blocks, threads)


@torch.inference_mode()
def serve_steps(worker: ModelWorker, group: TPGroup) -> None:
    """Run rank 0's swaps, steps and logits on this rank's shard until SHUTDOWN; a failed receive
    (rank 0 is gone, or silent past the timeout) ends the loop too."""
    try:
        while True:
            try:
                message = receive(group, worker.block_size)
            except RuntimeError as exc:
                logger.error("tensor-parallel rank %d: rank 0 is gone (%s); leaving", group.rank, exc)
                return
            if message.kind == Message.SHUTDOWN:
                return
            if message.kind == Message.SWAP:
                worker.swap(message.swap_out, message.swap_in)
                continue
            if message.kind == Message.LOGITS:
                gather_logits(group, worker.compute_logits(message.hidden), worker.vocab_size)
                continue
            worker.begin_step()
            worker.forward(message.input_ids, message.positions, message.meta)
    finally:
        leave_group()


def main(argv: list[str] | None = None) -> None:
    """`python -m tokenmill.tp_rank --rank R --store HOST:PORT --config JSON`, as RankProcesses starts it."""
    parser = argparse.ArgumentParser(prog="python -m tokenmill.tp_rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True, help="rank 0's TCPStore, HOST:PORT")
    parser.add_argument("--config", required=True, help="the engine's EngineConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"tp rank {args.rank}: %(levelname)s %(message)s")
    host, _, port = args.store.rpartition(":")
    rank_main(EngineConfig(**json.loads(args.config)), args.rank, host, int(port))


if __name__ == "__main__":
    main()
