"""Sampler: greedy, seeds across batch compositions, top-k/top-p/min-p mass, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.request import Request
from tokenmill.sampler import Sampler, SamplingMetadata, filter_logits, sort_best
from tokenmill.sampling_params import SamplingParams

V = 8
CPU = torch.device("cpu")


def req(rid: str, prompt=(3, 4), output=(), **params) -> Request:
    p = SamplingParams(max_tokens=50, **params)
    r = Request(request_id=rid, prompt_token_ids=list(prompt), params=p, max_tokens=50,
                eos_token_ids=frozenset({1}))
    r.token_ids.extend(output)
    return r


def meta_for(requests, generators=None):
    return SamplingMetadata.build(requests, generators or {}, V, CPU)


def probs_logits(probs):
    return torch.tensor([math.log(p) for p in probs]).unsqueeze(0)


@pytest.fixture(scope="module")
def kernels():
    loaded = load_cpu_kernels(required=False)
    if loaded is None:
        pytest.skip("no C++ compiler")
    return loaded


@pytest.fixture(params=["torch", "kernels"])
def sampler(request):
    """Sampler(seed) on the CPU in plain torch, and with the CPU kernels (the engine's on CPU)."""
    kernels = request.getfixturevalue("kernels") if request.param == "kernels" else None
    return lambda seed: Sampler(seed, CPU, kernels=kernels)


@pytest.fixture(params=["torch", "kernels"])
def filter_(request):
    """filter_logits in plain torch (whole-row sorts), and with the CPU kernels' floors."""
    kernels = request.getfixturevalue("kernels") if request.param == "kernels" else None
    return lambda logits, meta: filter_logits(logits, meta, kernels)


def test_greedy_is_argmax(sampler):
    logits = torch.randn(5, V)
    out = sampler(0)(logits, meta_for([req(str(i), temperature=0.0) for i in range(5)]))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_the_cpu_kernels_draw_the_same_tokens_as_torch(kernels):
    """The sampler with the CPU kernels (argmax_rows for all-greedy steps, sample_rows for the
    others) against plain torch (filter_logits, softmax, draw_by_sums) on the same uniform numbers:
    the same tokens, row by row, with greedy rows, temperatures, top-k, top-p, min-p and seeds mixed."""
    torch.manual_seed(0)
    vocab = 1003
    logits = torch.randn(40, vocab) * 2
    params = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.0, top_k=20),
              dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=300, top_p=0.95),
              dict(temperature=1.0, min_p=0.1), dict(temperature=0.5, top_p=0.5, min_p=0.2)]
    requests = [req(str(i), seed=i if i % 2 else None, **params[i % len(params)]) for i in range(40)]

    def tokens(with_kernels, rows):
        gens = {str(i): torch.Generator().manual_seed(i) for i in range(40) if i % 2}
        meta = SamplingMetadata.build([requests[i] for i in rows], gens, vocab, CPU)
        return Sampler(5, CPU, kernels=with_kernels)(logits[rows], meta).token_ids

    everyone = list(range(40))
    assert tokens(kernels, everyone) == tokens(None, everyone)
    greedy = list(range(0, 40, len(params)))
    assert tokens(kernels, greedy) == tokens(None, greedy) == logits[greedy].argmax(dim=-1).tolist()


def test_seeded_request_draws_the_same_tokens_alone_or_in_any_batch(sampler):
    torch.manual_seed(0)
    row = torch.randn(V)
    make_sampler = sampler

    def draws(batch_size: int, position: int, engine_seed: int) -> list[int]:
        sampler = make_sampler(engine_seed)
        gens = {"me": torch.Generator().manual_seed(1234)}
        tokens = []
        for _ in range(30):
            others = [req(f"o{i}", temperature=0.7) for i in range(batch_size - 1)]
            requests = others[:position] + [req("me", temperature=1.0, seed=1234)] + others[position:]
            logits = torch.randn(batch_size, V)
            logits[position] = row
            tokens.append(sampler(logits, meta_for(requests, gens)).token_ids[position])
        return tokens

    alone = draws(1, 0, engine_seed=0)
    assert draws(4, 2, engine_seed=7) == alone
    assert draws(9, 8, engine_seed=99) == alone
    assert len(set(alone)) > 1  # it really samples


def test_top_k_keeps_exactly_k_tokens(filter_):
    logits = torch.tensor([[5.0, 1.0, 4.0, 3.0, 0.0, 2.0, -1.0, -2.0]])
    kept = filter_(logits, meta_for([req("a", top_k=3)])).isfinite()
    assert kept[0].nonzero().flatten().tolist() == [0, 2, 3]


@pytest.mark.parametrize("top_p, expected", [(0.49, [0]), (0.79, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected, filter_):
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    kept = filter_(logits, SamplingMetadata.build([req("a", top_p=top_p)], {}, 4, CPU)).isfinite()
    assert kept[0].nonzero().flatten().tolist() == expected


def test_sample_rows_keeps_sort_best_sets(kernels):
    """The kernel's kept sets (every token at or above the floor it reports) are sort_best's, with
    top-k and top-p mixed per row, from one token to most of the vocabulary and past the sizes it
    sorts outright (cut by histograms), and its draws stay inside them."""
    gen = torch.Generator().manual_seed(0)
    vocab = 3000
    scales = torch.tensor([4.0, 4.0, 1.0, 0.1, 0.1, 2.0, 0.05, 3.0, 1.0]).unsqueeze(1)  # 0.1, 0.05: flat
    logits = torch.randn(9, vocab, generator=gen) * scales
    top_k = torch.tensor([vocab, 40, vocab, vocab, 500, 5, vocab, 1, 2000])
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.95, 1.0, 0.99, 0.999, 0.3, 1.0])
    temperature = torch.tensor([1.0, 0.7, 1.0, 1.0, 1.5, 1.0, 1.0, 1.0, 0.9])
    floors = torch.empty(9)
    scaled = logits / temperature.unsqueeze(1)
    for u in torch.rand(5, 9, dtype=torch.float64, generator=gen):
        tokens = kernels.sample_rows(logits, temperature, top_k, top_p, None, u, floors)
        kept = scaled >= floors.unsqueeze(1)
        assert torch.equal(kept, sort_best(scaled, top_k, top_p).isfinite())
        assert bool(kept[torch.arange(9), tokens].all())
    sizes = kept.sum(dim=1).tolist()
    assert sizes[6] > 2500 and sizes[1] <= 40 and sizes[7] == 1 and sizes[8] == 2000


def test_sample_rows_keeps_ties_and_never_draws_masked_or_dropped_tokens(kernels):
    """Sets are defined by values: tokens tied with the k-th best (or with the last token top-p
    needs) are all kept, so a row keeps the same set in any order. -inf tokens are never drawn,
    u near 1 lands on the last kept token, and a row with a NaN gives torch.argmax's answer."""
    row = torch.full((1, 2000), -10.0)
    row[0, [3, 700, 1999]] = 2.0  # three tied best
    row[0, 1000] = 3.0
    floors = torch.empty(1)
    one, half = torch.ones(1), torch.full((1,), 0.5, dtype=torch.float64)
    kernels.sample_rows(row, one, torch.tensor([2]), None, None, half, floors)
    assert (row[0] >= floors).nonzero().flatten().tolist() == [3, 700, 1000, 1999]
    mass = row.softmax(-1)[0]  # top-p: 1000 alone holds less than 0.5 here, so the tie joins
    assert float(mass[1000]) < 0.5 < float(mass[1000] + mass[3])
    kernels.sample_rows(row, one, None, torch.tensor([0.5]), None, half, floors)
    assert (row[0] >= floors).nonzero().flatten().tolist() == [3, 700, 1000, 1999]
    masked = torch.full((3, 2100), float("-inf"))
    masked[:, 5], masked[:, 1030], masked[:, 2050] = 0.0, 1.0, -30.0
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0 ** -53], dtype=torch.float64)
    assert kernels.sample_rows(masked, torch.ones(3), None, None, None, u).tolist() == [5, 1030, 2050]
    assert kernels.sample_rows(masked, torch.ones(3), None, None, torch.full((3,), 1e-3), u).tolist() == [5, 1030, 1030]
    nan = torch.randn(2, 50)
    nan[1, 7] = float("nan")
    assert kernels.sample_rows(nan, torch.ones(2), None, None, None, torch.zeros(2, dtype=torch.float64))[1] == 7


def test_sample_rows_at_the_limits(kernels):
    """+inf logits, and temperatures so small that logits / T overflow, give the argmax (the limit
    of a vanishing temperature); tokens far below the best still rank by value in the rows' scalar
    tails (V = 9: eight in vector lanes, one after them); out-of-range parameters raise."""
    row = torch.randn(3, 1000)
    row[0, 17] = float("inf")
    u = torch.full((3,), 0.5, dtype=torch.float64)
    tokens = kernels.sample_rows(row, torch.tensor([1.0, 1e-39, 1.0]), torch.tensor([1, 5, 1000]), None, None, u)
    assert tokens.tolist()[:2] == [17, int(row[1].argmax())]
    far = torch.tensor([[0.0, *[-300.0] * 7, -200.0]])
    floors = torch.empty(1)
    kernels.sample_rows(far, torch.ones(1), torch.tensor([2]), None, None, u[:1], floors)
    assert (far[0] >= floors).nonzero().flatten().tolist() == [0, 8]
    one = torch.ones(1)
    for bad in [dict(top_k=torch.tensor([0])), dict(top_p=torch.tensor([0.0])), dict(min_p=torch.tensor([1.5])),
                dict(u=torch.ones(1, dtype=torch.float64)), dict(temperature=-one)]:
        args = dict(temperature=one, top_k=None, top_p=None, min_p=None, u=u[:1]) | bad
        with pytest.raises(RuntimeError):
            kernels.sample_rows(far, args["temperature"], args["top_k"], args["top_p"], args["min_p"], args["u"])


def test_sample_rows_draws_from_the_kept_distribution(kernels):
    """Many rows with one row's logits: the draws follow its top-k / top-p set's renormalized
    probabilities (chi-square), across the blocks of 256 tokens the draw walks."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.full((1, 1000), -20.0)
    best = [10, 300, 301, 600, 999]
    logits[0, best] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0])
    n = 20000
    rows = logits.repeat(n, 1)
    u = torch.rand(n, dtype=torch.float64, generator=gen)
    tokens = kernels.sample_rows(rows, torch.ones(n), torch.full((n,), 4), torch.full((n,), 0.99), None, u)
    probs = logits[0, best[:4]].softmax(-1).tolist()  # top-k 4 drops 999; top-p 0.99 keeps the four
    counts = torch.bincount(tokens, minlength=1000)
    assert int(counts[best[:4]].sum()) == n
    chi2 = sum((int(counts[t]) - p * n) ** 2 / (p * n) for t, p in zip(best, probs))
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def test_min_p_drops_tokens_below_a_share_of_the_top_probability(filter_):
    logits = probs_logits([0.5, 0.3, 0.15, 0.05]).repeat(2, 1)
    kept = filter_(logits, SamplingMetadata.build([req("a", min_p=0.2), req("b", min_p=0.2, top_k=3)], {}, 4,
                                                  CPU)).isfinite()
    assert kept[0].nonzero().flatten().tolist() == [0, 1, 2]   # threshold 0.1
    assert kept[1].nonzero().flatten().tolist() == [0, 1, 2]   # top-k 3 first: 0.15 of 0.95 stays


def test_sampling_matches_the_softmax_distribution(sampler):
    probs = [0.4, 0.3, 0.2, 0.1]
    n = 20000
    logits = probs_logits(probs).repeat(n, 1)
    tokens = sampler(0)(logits, SamplingMetadata.build([req(str(i)) for i in range(n)], {}, 4, CPU)).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    chi2 = float(sum((f - p) ** 2 / p for f, p in zip(freq.tolist(), probs)) * n)
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def test_cpu_draw_never_picks_a_token_of_zero_probability(monkeypatch):
    """The CPU draw (draw_by_sums) takes the first token whose running sum exceeds u times the
    row's sum, through blocks of 1,024 tokens: u = 0 skips leading zeros, and the largest u
    lands on the last token of nonzero probability, in its block or in a later one (2,100
    tokens: a partial third block), never on the zeros after it. In the last row the block's
    float32 sum (1 + 7e-8 rounds up to 1 + 2^-23) exceeds its float64 running sum, so u times it
    runs past the block's end without the cap."""
    probs = torch.zeros(4, 2100)
    probs[:3, 1], probs[:3, 1030] = 0.25, 0.75
    probs[3, 0], probs[3, 1] = 1.0, 7e-8
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0 ** -53, 1.0 - 2.0 ** -53], dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: u.clone())
    meta = SamplingMetadata.build([req(str(i)) for i in range(4)], {}, 2100, CPU)
    assert Sampler(0, CPU).draw(probs, meta).tolist() == [1, 1030, 1030, 1]


def test_cpu_draw_matches_the_distribution_across_blocks():
    from tokenmill.sampler import draw_by_sums
    n, vocab = 20000, 2500  # blocks of 1,024, 1,024 and 452 tokens
    tokens, probs = [5, 1500, 2400, 2499], [0.2, 0.3, 0.4, 0.1]
    rows = torch.zeros(n, vocab)
    rows[:, tokens] = torch.tensor(probs) * 3  # any scale: drawn against the row's sum
    drawn = draw_by_sums(rows, torch.rand(n, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    counts = torch.bincount(drawn, minlength=vocab)
    assert int(counts.sum()) == n and int(counts[tokens].sum()) == n
    chi2 = sum((int(counts[t]) - p * n) ** 2 / (p * n) for t, p in zip(tokens, probs))
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def test_top_k_sampling_never_leaves_the_top_k(sampler):
    logits = torch.randn(1, V).repeat(500, 1)
    top3 = set(logits[0].topk(3).indices.tolist())
    tokens = sampler(0)(logits, meta_for([req(str(i), top_k=3) for i in range(500)])).token_ids
    assert set(tokens) <= top3 and len(set(tokens)) > 1


def test_penalties_change_only_the_right_logits():
    from tokenmill.sampler import apply_penalties
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 1.0, 1.0, 1.0]])
    r = req("a", prompt=(0, 1), output=(4, 4, 5), repetition_penalty=2.0, presence_penalty=0.5,
            frequency_penalty=0.25)
    out = logits.clone()
    apply_penalties(out, meta_for([r]))
    # prompt tokens 0, 1: repetition only (2 -> 1, -2 -> -4); output 4 (twice), 5 (once):
    # repetition then frequency * count + presence.
    expected = [1.0, -4.0, 2.0, -2.0, 0.5 - 0.5 - 0.5, 0.5 - 0.25 - 0.5, 1.0, 1.0]
    assert out[0].tolist() == pytest.approx(expected)


def test_min_tokens_masks_eos_and_stop_tokens(sampler):
    logits = torch.zeros(2, V)
    logits[:, 1] = 10.0   # EOS would win
    logits[:, 6] = 9.0    # a stop token, next best
    logits[:, 2] = 8.0
    requests = [req("a", temperature=0.0, min_tokens=3, stop_token_ids=[6], output=(5,)),
                req("b", temperature=0.0, min_tokens=1, stop_token_ids=[6], output=(5,))]
    assert sampler(0)(logits, meta_for(requests)).token_ids == [2, 1]
    sampled = [req(str(i), temperature=1.0, min_tokens=3, stop_token_ids=[6], output=(5,)) for i in range(300)]
    drawn = set(sampler(0)(torch.zeros(300, V).index_fill_(1, torch.tensor([1, 6]), 9.0), meta_for(sampled)).token_ids)
    assert not drawn & {1, 6} and len(drawn) > 1


def test_logprobs_report_the_sampled_token_and_top_n():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    out = Sampler(0, CPU)(logits, meta_for([req("a", temperature=0.0, logprobs=2)]))
    lp = out.logprobs[0]
    ref = logits.log_softmax(-1)[0]
    assert list(lp) == [0, 2] and lp[0] == pytest.approx(float(ref[0])) and lp[2] == pytest.approx(float(ref[2]))


def test_logit_bias_forces_and_bans_tokens_and_logprobs_stay_raw(sampler):
    """logit_bias is added before sampling: +100 forces a token (greedy or sampled), -100 bans the
    best one; logprobs are still the model's own (raw, as every other transform leaves them)."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    best = int(logits[1].argmax())
    reqs = [req("a", temperature=0.0, logit_bias={5: 100.0}, logprobs=0),
            req("b", temperature=0.0, logit_bias={best: -100}), req("c", temperature=1.0, logit_bias={2: 100})]
    out = sampler(0)(logits, meta_for(reqs))
    assert out.token_ids[0] == 5 and out.token_ids[1] == int(logits[1].topk(2).indices[1]) and out.token_ids[2] == 2
    assert out.logprobs[0][5] == pytest.approx(float(logits[0].log_softmax(-1)[5]))


def test_allowed_token_ids_are_the_only_tokens_sampled(sampler):
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(5))
    worst = int(logits[0].argmin())
    reqs = [req("a", temperature=0.0, allowed_token_ids=[worst, 6] if worst != 6 else [worst]),
            req("b", temperature=1.0, allowed_token_ids=[3, 4])]
    expected = max(reqs[0].params.allowed_token_ids, key=lambda t: float(logits[0, t]))
    for seed in range(20):
        out = sampler(seed)(logits, meta_for(reqs))
        assert out.token_ids[0] == expected and out.token_ids[1] in (3, 4)


def test_bans_that_leave_no_allowed_token_give_way_to_the_allowed_ones(sampler):
    """min_tokens (EOS) and a longer bad word can ban every allowed token of a row at some step:
    the row then keeps its allowed tokens (before this, all -inf, it sampled token 0)."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(6))
    under_min = req("a", temperature=0.0, allowed_token_ids=[1], min_tokens=3)       # 1 is EOS
    word = req("b", output=(6,), temperature=1.0, allowed_token_ids=[7], seed=3)
    word.bad_words_token_ids = [[6, 7]]
    for seed in range(5):
        assert sampler(seed)(logits, meta_for([under_min, word])).token_ids == [1, 7]


def test_bad_words_ban_the_token_that_would_complete_them(sampler):
    """A one-token word is never sampled; a longer one's last token only where the output ends in
    the tokens before it (so the same token stays free elsewhere)."""
    from tokenmill.sampler import bad_word_ends
    assert bad_word_ends([[5], [6, 7]], [3, 6]) == {5, 7} and bad_word_ends([[5], [6, 7]], [6, 3]) == {5}
    assert bad_word_ends([[2, 6, 7]], [6]) == set() and bad_word_ends([[2, 6, 7]], [9, 2, 6]) == {7}
    logits = torch.zeros(2, V)
    logits[:, 7] = 5.0                                          # the best token in both rows
    reqs = [req("a", output=(6,), temperature=0.0), req("b", output=(3,), temperature=0.0)]
    for r in reqs:
        r.bad_words_token_ids = [[6, 7]]
    out = sampler(0)(logits, meta_for(reqs))
    assert out.token_ids[0] != 7 and out.token_ids[1] == 7


def test_bad_words_are_tokenized_alone_and_after_a_space():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tokenmill.sampler import bad_words_token_ids
    vocab = {"Paris": 0, "Ġ": 1, "ĠParis": 2, "hello": 3, "Ġhello": 4, "Ġworld": 5, "x": 6}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="x"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert bad_words_token_ids(fast, ["Paris"]) == [[0], [2]]
    assert bad_words_token_ids(fast, [" hello world"]) == [[3, 5], [4, 5]]
