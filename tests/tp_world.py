"""Run a function on every rank of a real torch.distributed gloo world on 127.0.0.1: each rank a
process of its own (multiprocessing spawn), the results gathered back, the whole bounded in time.

    results = run_world(check_layers, size=2)   # [rank 0's return value, rank 1's]

`target(rank, size)` must be importable by the spawned processes (a module-level function of a
test module or helper); it runs with the default group initialised, and an exception in any rank
fails the call with that rank's traceback.
"""

from __future__ import annotations

import datetime
import multiprocessing
import queue
import socket
import time
import traceback
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(target: Callable, rank: int, size: int, port: int, results) -> None:
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=60))
        results.put((rank, True, target(rank, size)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(target: Callable, size: int = 2, timeout: float = 120.0) -> list:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_entry, args=(target, rank, size, port, results), daemon=True)
                 for rank in range(size)]
    for p in processes:
        p.start()
    deadline, out = time.monotonic() + timeout, [None] * size
    try:
        for _ in range(size):
            try:
                rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the {size}-rank world did not finish within {timeout:g} s") from None
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in processes:
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join()
    return out
