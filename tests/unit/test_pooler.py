"""The pooler over hand-made hidden states: last-token, mean and cls pooling, across chunks, with
and without normalising; exact expectations against the rows themselves."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fakes import make_embedding_request

from tokenmill.pooler import PoolChunk, Pooler
from tokenmill.pooling_params import PoolingParams


def hidden_states(num_rows: int, width: int = 8) -> torch.Tensor:
    return torch.arange(num_rows * width, dtype=torch.float32).reshape(num_rows, width).sin()


def test_last_pooling_reads_the_last_row_of_the_chunk_that_ends_the_prompt_normalised():
    a, b = make_embedding_request("a", prompt_len=10), make_embedding_request("b", prompt_len=6)
    h = hidden_states(9)
    pooler = Pooler()
    # rows 0-3: a's last 4 prompt tokens; rows 4-8: b's first 5 of 6 (its prompt goes on)
    out = pooler.pool(h, [PoolChunk(a, 0, 4, 6, True), PoolChunk(b, 4, 9, 0, False)])
    assert out.request_ids == ["a"]
    torch.testing.assert_close(out.vectors, F.normalize(h[3:4], dim=-1), rtol=0, atol=0)
    assert abs(torch.linalg.vector_norm(out.vectors[0]).item() - 1.0) < 1e-6
    assert pooler.pool(h, [PoolChunk(b, 4, 9, 0, False)]) is None


def test_mean_pooling_sums_chunks_across_steps_and_divides_by_the_prompt_length():
    r = make_embedding_request("m", prompt_len=7, pooling="mean")
    r.pooling = PoolingParams("mean", normalize=False)
    first, second = hidden_states(4), hidden_states(5) + 1.0
    pooler = Pooler()
    assert pooler.pool(first, [PoolChunk(r, 1, 4, 0, False)]) is None  # prompt positions 0-2
    out = pooler.pool(second, [PoolChunk(r, 1, 5, 3, True)])          # positions 3-6
    expected = (first[1:4].sum(0) + second[1:5].sum(0)) / 7
    torch.testing.assert_close(out.vectors[0], expected)
    assert out.request_ids == ["m"] and pooler.kept == {}


def test_a_chunk_from_position_zero_starts_the_mean_over_as_a_replayed_prompt_does():
    r = make_embedding_request("m", prompt_len=4, pooling="mean")
    pooler = Pooler()
    pooler.pool(hidden_states(2) * 100, [PoolChunk(r, 0, 2, 0, False)])  # then preempted by recompute
    h = hidden_states(4)
    out = pooler.pool(h, [PoolChunk(r, 0, 4, 0, True)])                  # the whole prompt again
    torch.testing.assert_close(out.vectors[0], F.normalize(h.mean(0), dim=0))


def test_each_vector_pairs_with_its_request_id_and_has_its_own_normalisation():
    last = make_embedding_request("last", prompt_len=2)
    mean = make_embedding_request("mean", prompt_len=3, pooling="mean")
    raw = make_embedding_request("raw", prompt_len=1)
    raw.pooling = PoolingParams("last", normalize=False)
    h = hidden_states(6)
    out = Pooler().pool(h, [PoolChunk(mean, 0, 3, 0, True), PoolChunk(last, 3, 5, 0, True),
                            PoolChunk(raw, 5, 6, 0, True)])
    by_id = dict(zip(out.request_ids, out.vectors))
    assert sorted(by_id) == ["last", "mean", "raw"] and out.vectors.shape == (3, 8)
    torch.testing.assert_close(by_id["last"], F.normalize(h[4], dim=0))
    torch.testing.assert_close(by_id["mean"], F.normalize(h[0:3].mean(0), dim=0))
    torch.testing.assert_close(by_id["raw"], h[5])


def test_cls_pooling_keeps_the_first_prompt_row_until_the_step_that_ends_the_prompt():
    r = make_embedding_request("c", prompt_len=7, pooling="cls")
    first, second = hidden_states(4), hidden_states(5) + 1.0
    pooler = Pooler()
    assert pooler.pool(first, [PoolChunk(r, 1, 4, 0, False)]) is None  # positions 0-2: row 1 is position 0
    first.zero_()  # (the step's buffer, reused)
    out = pooler.pool(second, [PoolChunk(r, 1, 5, 3, True)])           # positions 3-6
    torch.testing.assert_close(out.vectors[0], F.normalize(hidden_states(4)[1], dim=0), rtol=0, atol=0)
    assert out.request_ids == ["c"] and pooler.kept == {}
    whole = pooler.pool(second, [PoolChunk(r, 2, 5, 0, True)])        # one chunk, as an encoder runs it
    torch.testing.assert_close(whole.vectors[0], F.normalize(second[2], dim=0), rtol=0, atol=0)


def test_forget_drops_the_sum_of_a_request_that_ended_mid_prompt():
    r = make_embedding_request("m", prompt_len=9, pooling="mean")
    pooler = Pooler()
    pooler.pool(hidden_states(3), [PoolChunk(r, 0, 3, 0, False)])
    assert list(pooler.kept) == ["m"]
    pooler.forget(["other", "m"])
    assert pooler.kept == {}
