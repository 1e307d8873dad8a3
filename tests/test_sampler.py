"""Sampler on hand-made logits: what each filter keeps, greedy rows in mixed batches,
min_tokens bans, seeded reproducibility independent of the batch, the sampled
distribution itself, and logprobs taken from the raw logits."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.chisquare import ALPHA, goodness_of_fit
from xllm_py.worker.sampler import (
    BLOCK,
    Sampler,
    SamplingBatch,
    _filter_top_k_top_p,
    token_seed,
)

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

NEG_INF = float("-inf")


def make_batch(
    rows: int,
    *,
    temperature: float | list[float] = 1.0,
    greedy: bool | list[bool] = False,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    seeds: list[tuple[int, int]] = (),
    banned: list[tuple[int, list[int]]] = (),
    max_logprobs: int | None = None,
) -> SamplingBatch:
    temps = temperature if isinstance(temperature, list) else [temperature] * rows
    greedy = greedy if isinstance(greedy, list) else [greedy] * rows
    return SamplingBatch(
        temperature=torch.tensor(temps, dtype=torch.float32),
        greedy=torch.tensor(greedy),
        all_greedy=all(greedy),
        top_k=None if top_k is None else torch.tensor(top_k),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        seeds=list(seeds),
        banned=list(banned),
        max_logprobs=max_logprobs,
    )


def log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def kept(filtered: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(filtered)).view(-1).tolist())


def frequencies(tokens: torch.Tensor, vocab: int) -> list[float]:
    return (torch.bincount(tokens, minlength=vocab).double() / tokens.numel()).tolist()


# ---- top-k ------------------------------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest_in_vocabulary_order():
    g = torch.Generator().manual_seed(0)
    V = 50
    logits = torch.stack([torch.randperm(V, generator=g).float() for _ in range(4)])  # distinct
    ks = [1, 3, 17, V]
    out = _filter_top_k_top_p(logits.clone(), torch.tensor(ks), None)
    for row, k in enumerate(ks):
        want = set(logits[row].topk(k).indices.tolist())
        assert kept(out[row]) == want
        keep = torch.isfinite(out[row])
        assert torch.equal(out[row][keep], logits[row][keep])  # survivors untouched, in place


def test_top_k_with_ties_at_the_threshold_keeps_the_k_largest():
    logits = torch.tensor([[5.0, 3.0, 1.0, 3.0, 0.0]])
    survivors = kept(_filter_top_k_top_p(logits, torch.tensor([2]), None)[0])
    assert 0 in survivors and survivors & {1, 3}  # the two largest values survive
    assert survivors <= {0, 1, 3}  # nothing below the 2nd largest value does


def test_top_k_larger_than_vocabulary_keeps_everything():
    logits = torch.randn(1, 5)
    assert kept(_filter_top_k_top_p(logits, torch.tensor([10]), None)[0]) == set(range(5))


# ---- top-p ------------------------------------------------------------------------------------


def _nucleus(probs: list[float], p: float) -> set[int]:
    """Smallest set of most likely tokens whose mass reaches p (at least the top token)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    out, mass = set(), 0.0
    for i in order:
        out.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return out


@pytest.mark.parametrize(
    "p, want",
    [
        (1e-6, {2}),
        (0.4, {2}),
        (0.5, {2}),  # token 2 alone reaches exactly p: the next one is not needed
        (0.6, {2, 0}),
        (0.75, {2, 0}),
        (0.8, {2, 0, 4}),
        (0.9, {2, 0, 4, 1}),
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(p, want):
    probs = [0.25, 0.0625, 0.5, 0.0625, 0.125]  # sorted: 2 (.5), 0 (.25), 4 (.125), 1, 3
    out = _filter_top_k_top_p(log_probs(probs).unsqueeze(0), None, torch.tensor([p]))
    assert kept(out[0]) == want == _nucleus(probs, p)


def test_top_p_matches_reference_on_random_rows():
    g = torch.Generator().manual_seed(1)
    V, R = 40, 64
    logits = torch.randn(R, V, generator=g) * 2
    ps = torch.rand(R, generator=g) * 0.98 + 0.01
    out = _filter_top_k_top_p(logits.clone(), None, ps)
    probs = torch.softmax(logits.double(), dim=-1)
    checked = 0
    for row in range(R):
        cum = probs[row].sort(descending=True).values.cumsum(0)
        if (cum - ps[row].item()).abs().min() < 1e-4:
            continue  # too close to a boundary for float32 to decide
        assert kept(out[row]) == _nucleus(probs[row].tolist(), ps[row].item()), row
        checked += 1
    assert checked > 50


def _sorted_reference(logits, top_k, top_p):
    """The filters by a stable sort of the whole vocabulary (what _filter_top_k_top_p gives
    while sorting only the candidates): top-k by value, ties kept; the nucleus over the
    float32 probabilities after top-k, equal ones in vocabulary order."""
    V = logits.shape[1]
    out = []
    for row in range(logits.shape[0]):
        x = logits[row]
        k = min(int(top_k[row]), V)
        keep = x >= x.sort(descending=True).values[k - 1]
        probs = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
        if top_p[row] < 1:
            top, order = probs.sort(descending=True, stable=True)
            inside = top.cumsum(0) - top < top_p[row]
            keep = torch.zeros(V, dtype=torch.bool)
            keep[order[inside]] = True
        out.append(set(torch.nonzero(keep).flatten().tolist()))
    return out


def test_sorting_only_the_candidates_keeps_what_a_full_sort_keeps():
    """Many rows over a vocabulary of 3,000 (the candidates are doubled from 64 for rows
    without top-k), logits on a grid of 0.25 so equal probabilities straddle every cut:
    the kept sets equal a full stable sort's, row by row."""
    g = torch.Generator().manual_seed(5)
    R, V = 96, 3000
    logits = (torch.randn(R, V, generator=g) * 3 / 0.25).round() * 0.25
    top_k = torch.randint(1, 200, (R,), generator=g)
    top_k[::3] = V  # no top-k on every third row
    top_p = torch.rand(R, generator=g) * 0.99 + 0.005
    top_p[::4] = 1.0  # no top-p on every fourth
    out = _filter_top_k_top_p(logits.clone(), top_k, top_p)
    assert [kept(r) for r in out] == _sorted_reference(logits, top_k, top_p)
    only_p = _filter_top_k_top_p(logits.clone(), None, top_p)
    assert [kept(r) for r in only_p] == _sorted_reference(logits, torch.full((R,), V), top_p)
    # 100 equal tokens among 3,000 and a nucleus of 64 of them: the first 64 in vocabulary
    # order, whichever the top 65 by value happen to be
    flat = torch.full((1, V), -30.0)
    flat[0, torch.randperm(V, generator=g)[:100]] = 0.0
    nucleus = kept(_filter_top_k_top_p(flat.clone(), None, torch.tensor([0.635]))[0])
    assert nucleus == _sorted_reference(flat, torch.tensor([V]), torch.tensor([0.635]))[0]
    assert len(nucleus) == 64


def test_top_p_applies_to_the_distribution_left_by_top_k():
    probs = [0.4, 0.3, 0.2, 0.1]
    logits = log_probs(probs).unsqueeze(0)
    # after top-k=2 the distribution is (4/7, 3/7): the top token alone reaches p=0.5
    assert kept(_filter_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]))[0]) == {0}
    assert kept(_filter_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))[0]) == {0, 1}


def test_top_p_rows_are_independent():
    probs = [0.5, 0.25, 0.125, 0.125]
    logits = log_probs(probs).expand(3, 4).clone()
    out = _filter_top_k_top_p(logits, torch.tensor([4, 1, 4]), torch.tensor([0.6, 1.0, 0.3]))
    assert [kept(r) for r in out] == [{0, 1}, {0}, {0}]


def test_top_p_of_one_keeps_every_token():
    logits = torch.tensor([[0.0, -20.0]])  # p(1) ~ 2e-9: 1 - p(1) rounds to 1.0 in float32
    assert kept(_filter_top_k_top_p(logits, None, torch.tensor([1.0]))[0]) == {0, 1}


# ---- sampling ---------------------------------------------------------------------------------


def _draw(probs: list[float], n: int, seed: int = 0, **params) -> torch.Tensor:
    logits = log_probs(probs).expand(n, len(probs)).contiguous()
    sampler = Sampler(torch.Generator().manual_seed(seed))
    tokens, _, _ = sampler(logits, make_batch(n, **params))
    return tokens


def test_sampling_at_temperature_one_matches_the_distribution():
    target = [0.1, 0.2, 0.3, 0.4]
    freq = frequencies(_draw(target, 20_000), 4)  # binomial sd <= 0.0035: 0.02 is > 5 sd
    for f, t in zip(freq, target):
        assert abs(f - t) < 0.02, (freq, target)


def test_unseeded_draws_follow_the_distribution_across_blocks():
    """The two-level draw (a block of BLOCK tokens, then a token in it) over a vocabulary
    that is not a whole number of blocks: mass in many blocks, the short last block
    included, tokens a thousand times rarer than others, and zero-weight tokens, in a
    zero-weight block and beside weighted ones, that are never drawn."""
    vocab = 5 * BLOCK + 7
    weights = torch.zeros(vocab)
    weights[[0, 5, BLOCK - 1, BLOCK, 2 * BLOCK + 3, 5 * BLOCK + 6]] = torch.tensor(
        [3.0, 0.004, 2.0, 1.0, 0.003, 1.5]
    )  # block 3 and 4 hold nothing; the last token has weight
    n = 60_000
    rows = weights.expand(n, -1)
    drawn = Sampler(torch.Generator().manual_seed(7)).draws(rows, make_batch(n)).pick(rows).tolist()
    positive = weights.nonzero().squeeze(1).tolist()
    assert set(drawn) <= set(positive)
    total = float(weights.sum())
    verdict = goodness_of_fit(drawn, {t: float(weights[t]) / total for t in positive})
    assert verdict.p_value > ALPHA, verdict


def test_temperature_sharpens_and_flattens():
    target = [0.1, 0.2, 0.3, 0.4]
    for temp in (0.5, 2.0):
        powered = [t ** (1 / temp) for t in target]
        want = [x / sum(powered) for x in powered]
        freq = frequencies(_draw(target, 20_000, temperature=temp), 4)
        for f, w in zip(freq, want):
            assert abs(f - w) < 0.02, (temp, freq, want)


def test_sampling_after_top_k_is_renormalised():
    freq = frequencies(_draw([0.1, 0.2, 0.3, 0.4], 20_000, top_k=[2] * 20_000), 4)
    assert freq[0] == freq[1] == 0.0
    assert abs(freq[2] - 3 / 7) < 0.02 and abs(freq[3] - 4 / 7) < 0.02


def test_min_p_removes_tokens_below_fraction_of_the_top_probability():
    probs = [0.05, 0.5, 0.15, 0.3]  # min_p=0.2: floor 0.1, so token 0 goes
    freq = frequencies(_draw(probs, 20_000, min_p=[0.2] * 20_000), 4)
    assert freq[0] == 0.0
    for f, p in zip(freq[1:], probs[1:]):
        assert abs(f - p / 0.95) < 0.02, freq


def test_min_p_of_one_keeps_only_the_top_token():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 50, generator=g)
    logits[:, 0] = -10.0  # the top token is never token 0
    tokens, _, _ = Sampler(torch.Generator().manual_seed(0))(
        logits.clone(), make_batch(8, min_p=[1.0] * 8)
    )
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_filters_never_sample_a_removed_token():
    g = torch.Generator().manual_seed(2)
    V, n = 30, 2000
    logits = torch.randn(1, V, generator=g).expand(n, V).contiguous()
    sampler = Sampler(torch.Generator().manual_seed(3))
    for params, allowed in [
        (dict(top_k=[5] * n), set(logits[0].topk(5).indices.tolist())),
        (
            dict(top_p=[0.5] * n),
            kept(_filter_top_k_top_p(logits[:1], None, torch.tensor([0.5]))[0]),
        ),
    ]:
        tokens, _, _ = sampler(logits.clone(), make_batch(n, **params))
        assert set(tokens.tolist()) <= allowed


# ---- greedy, bans -----------------------------------------------------------------------------


def test_greedy_rows_return_argmax_in_a_mixed_batch():
    g = torch.Generator().manual_seed(4)
    R, V = 8, 100
    logits = torch.randn(R, V, generator=g)
    greedy = [i % 2 == 0 for i in range(R)]
    batch = make_batch(
        R,
        greedy=greedy,
        temperature=[1.0 if gr else 5.0 for gr in greedy],
        top_k=[V if gr else 50 for gr in greedy],
        top_p=[1.0 if gr else 0.9 for gr in greedy],
        seeds=[(1, 123)],
    )
    want = logits.argmax(dim=-1)
    for trial in range(5):
        tokens, _, _ = Sampler(torch.Generator().manual_seed(trial))(logits.clone(), batch)
        assert tokens[0::2].tolist() == want[0::2].tolist()
    assert not torch.equal(tokens[1::2], want[1::2])  # the hot rows really sample


def test_all_greedy_batch_is_argmax():
    logits = torch.randn(6, 40)
    tokens, chosen, top = Sampler()(logits.clone(), make_batch(6, greedy=True))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert chosen is None and top is None


def test_banned_ids_are_never_chosen():
    V, n = 10, 4000
    logits = torch.zeros(n, V)
    logits[:, 3] = 10.0  # the favourite, e.g. EOS under min_tokens
    logits[:, 7] = 9.0
    banned = [(row, [3, 7]) for row in range(n)]
    greedy = [row < 10 for row in range(n)]
    tokens, _, _ = Sampler(torch.Generator().manual_seed(0))(
        logits, make_batch(n, greedy=greedy, banned=banned)
    )
    assert not set(tokens.tolist()) & {3, 7}
    assert set(tokens.tolist()) == set(range(V)) - {3, 7}  # the rest are all still possible


def test_bans_apply_only_to_their_row():
    logits = torch.zeros(2, 5)
    logits[:, 2] = 10.0
    tokens, _, _ = Sampler()(logits, make_batch(2, greedy=True, banned=[(0, [2])]))
    assert tokens[0].item() != 2 and tokens[1].item() == 2


# ---- seeds ------------------------------------------------------------------------------------


def test_same_seed_same_token_regardless_of_row_and_batch():
    g = torch.Generator().manual_seed(5)
    V = 1000
    target = torch.randn(V, generator=g)
    for s in range(10):
        seed = token_seed(1000 + s, 7)
        alone, _, _ = Sampler(torch.Generator().manual_seed(1))(
            target.unsqueeze(0).clone(), make_batch(1, seeds=[(0, seed)])
        )
        # Row 3 of a bigger batch with different neighbours, other seeded rows, greedy rows,
        # top-k on other rows (disabled, = V, on this one) and a different global generator.
        others = torch.randn(5, V, generator=g)
        logits = torch.cat([others[:3], target.unsqueeze(0), others[3:]])
        batch = make_batch(
            6,
            greedy=[False, True, False, False, False, True],
            temperature=[0.7, 1, 1.3, 1, 1, 1],
            top_k=[10, V, V, V, 3, V],
            seeds=[(0, 99), (3, seed), (4, 5)],
        )
        mixed, _, _ = Sampler(torch.Generator().manual_seed(2))(logits, batch)
        assert mixed[3].item() == alone[0].item()


def test_draws_come_from_the_samplers_own_generators():
    """The engine's generator (unseeded rows) and the per-token seeds (seeded rows) decide
    every draw, uniforms for verification included; the global torch RNG does not."""
    probs = torch.full((3, 5000), 1 / 5000)
    batch = make_batch(3, seeds=[(1, token_seed(123, 4))])

    def draw(engine_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        draws = Sampler(torch.Generator().manual_seed(engine_seed)).draws(probs, batch)
        return draws.uniform, torch.stack([draws.pick(probs) for _ in range(3)])

    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        runs.append(draw(4))
    (u1, t1), (u2, t2) = runs
    assert torch.equal(u1, u2) and torch.equal(t1, t2)
    assert len(set(t1[:, 0].tolist())) == 3  # each pick of an unseeded row is a fresh draw
    assert len(set(t1[:, 1].tolist())) == 1  # a seeded row races on one noise
    u3, t3 = draw(5)
    assert u3[0] != u1[0] and not torch.equal(t3[:, 0], t1[:, 0])  # unseeded: the engine's
    assert u3[1] == u1[1] and torch.equal(t3[:, 1], t1[:, 1])  # seeded rows are not


def test_seeded_rows_differ_across_seeds_and_token_index():
    V = 1000
    logits = torch.zeros(1, V)  # uniform: the draw is decided by the noise alone
    picks = set()
    for s in range(20):
        tok, _, _ = Sampler()(logits.clone(), make_batch(1, seeds=[(0, token_seed(s, 0))]))
        picks.add(tok.item())
    assert len(picks) > 10
    a = [
        Sampler()(logits.clone(), make_batch(1, seeds=[(0, token_seed(7, i))]))[0].item()
        for i in range(5)
    ]
    assert len(set(a)) > 1


def test_token_seed_is_deterministic_and_in_range():
    assert token_seed(3, 4) == token_seed(3, 4)
    seeds = {token_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= x < 1 << 63 for x in seeds)


# ---- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits():
    g = torch.Generator().manual_seed(6)
    R, V = 4, 64
    raw = torch.randn(R, V, generator=g) * 3
    batch = make_batch(
        R,
        greedy=[True, False, False, False],
        temperature=[1.0, 0.3, 2.0, 1.0],
        top_k=[V, 5, V, V],
        top_p=[1.0, 1.0, 0.5, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.3],
        banned=[(3, [int(raw[3].argmax())])],
        max_logprobs=4,
    )
    tokens, chosen, top = Sampler(torch.Generator().manual_seed(0))(raw.clone(), batch)
    want = torch.log_softmax(raw, dim=-1)
    torch.testing.assert_close(chosen, want.gather(1, tokens.unsqueeze(1)).squeeze(1))
    ref = want.topk(4, dim=-1)
    torch.testing.assert_close(top.values, ref.values)
    assert torch.equal(top.indices, ref.indices)


def test_logprobs_zero_gives_chosen_only_and_none_gives_nothing():
    raw = torch.randn(2, 16)
    _, chosen, top = Sampler()(raw.clone(), make_batch(2, max_logprobs=0))
    assert chosen is not None and chosen.shape == (2,) and top is None
    _, chosen, top = Sampler()(raw.clone(), make_batch(2, max_logprobs=None))
    assert chosen is None and top is None
