"""What rank 0 sends the other ranks each step (distributed.py), on a real 2-rank gloo world: the
step's tensors and host lists arrive as they were prepared, swap lists and the shutdown too."""

from __future__ import annotations

import pytest
import torch
from tp_world import run_world

from tokenmill.attention import AttentionMetadata
from tokenmill.distributed import Message, TPGroup, receive, send_logits, send_shutdown, send_step, send_swap


def a_step() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode (position 20 of a sequence on blocks 4, 7) beside a 3-token prompt chunk (block 2)."""
    meta = AttentionMetadata(
        slot_block=torch.tensor([7, 2, 2, 2]), slot_offset=torch.tensor([4, 0, 1, 2]),
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32), seq_lens=torch.tensor([21, 3], dtype=torch.int32),
        block_tables=torch.tensor([[4, 7], [2, 0]], dtype=torch.int32), query_start_loc_host=[0, 1, 4],
        seq_lens_host=[21, 3], block_size=16, num_short=1, num_short_tokens=1)
    return torch.tensor([11, 12, 13, 14]), torch.tensor([20, 0, 1, 2]), meta


def exchange(rank: int, size: int) -> list:
    import torch.distributed as dist
    group = TPGroup(rank, size, dist.new_group(backend="gloo"), dist.new_group(backend="gloo"), torch.device("cpu"))
    if rank == 0:
        send_swap(group, [(3, 0), (5, 1)], [(0, 6)])
        send_step(group, *a_step())
        send_logits(group, torch.arange(6, dtype=torch.bfloat16).view(2, 3))
        send_shutdown(group)
        return []
    got = [receive(group, 16) for _ in range(4)]
    swap, step, logits, end = got
    m = step.meta
    return [(swap.kind, swap.swap_out, swap.swap_in), (step.kind, step.input_ids.tolist(), step.positions.tolist()),
            {"slot_block": m.slot_block.tolist(), "slot_offset": m.slot_offset.tolist(),
             "query_start_loc": (m.query_start_loc.dtype, m.query_start_loc.tolist()),
             "seq_lens": (m.seq_lens.dtype, m.seq_lens.tolist()),
             "block_tables": (m.block_tables.dtype, m.block_tables.tolist()),
             "host": (m.query_start_loc_host, m.seq_lens_host, m.block_size, m.num_short, m.num_short_tokens)},
            end.kind, (logits.kind, logits.hidden.dtype, logits.hidden.tolist())]


@pytest.fixture(scope="module")
def received() -> list:
    return run_world(exchange, size=2, timeout=60)[1]


def test_swap_lists_arrive_as_pairs_in_their_order(received) -> None:
    assert received[0] == (Message.SWAP, [(3, 0), (5, 1)], [(0, 6)])


def test_a_steps_tensors_and_host_lists_arrive_as_rank_0_prepared_them(received) -> None:
    assert received[1] == (Message.STEP, [11, 12, 13, 14], [20, 0, 1, 2])
    assert received[2] == {
        "slot_block": [7, 2, 2, 2], "slot_offset": [4, 0, 1, 2], "query_start_loc": (torch.int32, [0, 1, 4]),
        "seq_lens": (torch.int32, [21, 3]), "block_tables": (torch.int32, [[4, 7], [2, 0]]),
        "host": ([0, 1, 4], [21, 3], 16, 1, 1)}


def test_the_shutdown_message_arrives_last(received) -> None:
    assert received[3] == Message.SHUTDOWN


def test_logits_rows_arrive_in_their_shape_and_dtype(received) -> None:
    assert received[4] == (Message.LOGITS, torch.bfloat16, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
