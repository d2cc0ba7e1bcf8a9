"""The tensor-parallel ranks' process groups, and what rank 0 tells the others each step.

Two torch.distributed groups over the same N ranks, as vLLM has them:

    control   gloo, host tensors: the small header of every message, and swap lists. The other
              ranks wait on it between steps for as long as the engine idles, so its timeout is
              a week; a rank 0 that dies closes its connections, which fails that wait at once
    device    the model's collectives (the all-reduces of models/parallel.py), each step's
              tensors and the pool size: gloo on the CPU, NCCL on CUDA, so the step goes device
              to device; its timeout (distributed_timeout) bounds how long a stuck rank can stall

Rank 0 runs the scheduler and the runner; for every step it broadcasts the tensors the runner
prepared, never Python objects: a header over the control group, then the step's integers packed
into one int64 tensor over the device group, from which the other ranks rebuild the same
AttentionMetadata (its host lists are read back from the tensors):

    header   [kind, T, B, max_blocks, num_short, num_short_tokens, swap_out pairs, swap_in pairs]
    STEP     payload  input_ids (T) | positions (T) | slot_block (T) | slot_offset (T)
                      | query_start_loc (B + 1) | seq_lens (B) | block_tables (B * max_blocks)
    SWAP     payload  swap_out pairs, then swap_in pairs (2 ints each), over the control group
    LOGITS   payload  the hidden states of the rows that sample (R x hidden, the model's dtype): each
                      rank computes its vocabulary slice of their logits, and rank 0 gathers the
                      slices over the device group (gather_logits)
    SHUTDOWN          no payload: the rank leaves its loop

Every collective carries the group's timeout, and gloo fails a collective at once when a peer's
connection closes, so a dead or stuck rank ends in an error, never a hang (tp_rank.py turns it
into one that names the rank).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from tokenmill.attention import AttentionMetadata

HEADER_LEN = 8
IDLE_TIMEOUT = datetime.timedelta(days=7)  # the control group's: ranks wait on it while the engine idles


class Message(IntEnum):
    STEP = 1
    SWAP = 2
    SHUTDOWN = 3
    LOGITS = 4


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a LOGITS payload's dtype, by index in the header


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the tensor-parallel ranks and the two groups over them."""

    rank: int
    size: int
    control: dist.ProcessGroup
    device_group: dist.ProcessGroup
    device: torch.device

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks in place (the row-parallel layers' reduction); returns it."""
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pool's block count)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.device_group)
        return int(t.item())


def join_group(rank: int, size: int, device: torch.device, timeout_s: float, store: dist.Store | None = None,
               ) -> TPGroup:
    """Join the ranks' default group (through `store`, or env:// under torchrun when None) and make the
    control and device groups; a device collective fails after `timeout_s`."""
    if dist.is_initialized():  # torch.distributed has one default group per process
        raise RuntimeError("this process already belongs to a torch.distributed group: close() the other "
                           "tensor-parallel engine first")
    timeout = datetime.timedelta(seconds=timeout_s)
    device_backend = "nccl" if device.type == "cuda" else "gloo"
    if store is None:
        dist.init_process_group(backend=device_backend, init_method="env://", rank=rank, world_size=size,
                                timeout=timeout)
    else:
        dist.init_process_group(backend=device_backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(list(range(size)), backend="gloo", timeout=IDLE_TIMEOUT)
    device_group = dist.new_group(list(range(size)), backend=device_backend, timeout=timeout)
    return TPGroup(rank, size, control, device_group, device)


def leave_group() -> None:
    """Tear the groups down (after the last message)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _send_header(group: TPGroup, kind: Message, *fields: int) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = kind
    header[1:1 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group.control)


def send_step(group: TPGroup, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
    """Rank 0: the step's tensors to the other ranks (before its own forward pass)."""
    tables = meta.block_tables
    _send_header(group, Message.STEP, input_ids.shape[0], meta.num_seqs, tables.shape[1], meta.num_short,
                 meta.num_short_tokens)
    parts = (input_ids, positions, meta.slot_block, meta.slot_offset, meta.query_start_loc, meta.seq_lens,
             tables.reshape(-1))
    payload = torch.cat([p.to(torch.int64) for p in parts])
    dist.broadcast(payload, src=0, group=group.device_group)


def send_swap(group: TPGroup, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
    """Rank 0: the blocks to copy out to the host pool and back in, before the step that needs them."""
    _send_header(group, Message.SWAP, 0, 0, 0, 0, 0, len(swap_out), len(swap_in))
    pairs = torch.tensor([x for pair in swap_out + swap_in for x in pair], dtype=torch.int64)
    dist.broadcast(pairs, src=0, group=group.control)


def send_shutdown(group: TPGroup) -> None:
    _send_header(group, Message.SHUTDOWN)


def send_logits(group: TPGroup, hidden: torch.Tensor) -> None:
    """Rank 0: the rows whose logits it needs, before computing its own slice (then gather_logits)."""
    _send_header(group, Message.LOGITS, hidden.shape[0], hidden.shape[1], _DTYPES.index(hidden.dtype))
    dist.broadcast(hidden.contiguous(), src=0, group=group.device_group)


def gather_logits(group: TPGroup, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Every rank, with its (R, rows it holds) slice: rank 0 gets the (R, vocab_size) logits, the
    others None. The slices are padded to ceil(vocab_size / N) columns for the collective."""
    width = -(-vocab_size // group.size)
    if local.shape[1] < width:
        local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
    parts = [torch.empty_like(local) for _ in range(group.size)] if group.rank == 0 else None
    dist.gather(local.contiguous(), parts, dst=0, group=group.device_group)
    return torch.cat(parts, dim=1)[:, :vocab_size] if parts is not None else None


@dataclass
class Received:
    """A message as another rank gets it: the step (tensors on its device), or the swap lists."""

    kind: Message
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    meta: AttentionMetadata | None = None
    swap_out: list[tuple[int, int]] | None = None
    swap_in: list[tuple[int, int]] | None = None
    hidden: torch.Tensor | None = None      # LOGITS: the rows to compute logits for


def receive(group: TPGroup, block_size: int) -> Received:
    """Ranks 1..N-1: wait for rank 0's next message."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group.control)
    kind, t, b, max_blocks, num_short, num_short_tokens, n_out, n_in = header.tolist()
    kind = Message(kind)
    if kind == Message.SWAP:
        pairs = torch.empty(2 * (n_out + n_in), dtype=torch.int64)
        dist.broadcast(pairs, src=0, group=group.control)
        flat = pairs.tolist()
        pairs_list = list(zip(flat[0::2], flat[1::2]))
        return Received(kind, swap_out=pairs_list[:n_out], swap_in=pairs_list[n_out:])
    if kind == Message.LOGITS:
        hidden = torch.empty(t, b, dtype=_DTYPES[max_blocks], device=group.device)
        dist.broadcast(hidden, src=0, group=group.device_group)
        return Received(kind, hidden=hidden)
    if kind != Message.STEP:
        return Received(kind)
    payload = torch.empty(4 * t + 2 * b + 1 + b * max_blocks, dtype=torch.int64, device=group.device)
    dist.broadcast(payload, src=0, group=group.device_group)
    input_ids, positions, slot_block, slot_offset, qsl, seq_lens, tables = payload.split(
        [t, t, t, t, b + 1, b, b * max_blocks])
    qsl, seq_lens = qsl.to(torch.int32), seq_lens.to(torch.int32)
    meta = AttentionMetadata(
        slot_block=slot_block, slot_offset=slot_offset, query_start_loc=qsl, seq_lens=seq_lens,
        block_tables=tables.to(torch.int32).view(b, max_blocks), query_start_loc_host=qsl.tolist(),
        seq_lens_host=seq_lens.tolist(), block_size=block_size, num_short=num_short,
        num_short_tokens=num_short_tokens)
    return Received(kind, input_ids=input_ids, positions=positions, meta=meta)


class StepSender:
    """Rank 0's end of the protocol, as the worker (worker.py) uses it: each step and swap goes to the
    other ranks first. `check` raises if a rank is known to be gone; `explain` turns a failed
    collective into the error to raise (one that says which rank died, when one did)."""

    def __init__(self, group: TPGroup, check: Callable[[], None],
                 explain: Callable[[Exception], Exception]) -> None:
        self.group = group
        self.check = check
        self.explain = explain

    @contextlib.contextmanager
    def failures(self) -> Iterator[None]:
        """Around anything that talks to the other ranks: a rank already gone fails at once, and a
        collective that fails (a peer's connection closed, the group's timeout) fails explained."""
        self.check()
        try:
            yield
        except RuntimeError as exc:  # gloo's and NCCL's errors (DistBackendError is one)
            raise self.explain(exc) from exc

    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        send_step(self.group, input_ids, positions, meta)

    def send_swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        if swap_out or swap_in:
            send_swap(self.group, swap_out, swap_in)

    def logits(self, hidden: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor],
               vocab_size: int) -> torch.Tensor:
        """The whole logits of `hidden`'s rows: the other ranks get the rows, each rank computes its
        slice with `compute`, rank 0 gathers them."""
        send_logits(self.group, hidden)
        return gather_logits(self.group, compute(hidden), vocab_size)
