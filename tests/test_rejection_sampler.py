"""Draft verification keeps the target's distribution exactly (Leviathan et al.):
checked by frequencies on a 4-token vocabulary with known target and draft
distributions, for greedy (one-hot) drafts and for drafts sampled from q; and, under
temperature, top-k, top-p and min-p, the exact distribution of emitted sequences against a
reference written in this file from the rejection-sampling rule."""

from __future__ import annotations

import math

import pytest
import torch

from tests.chisquare import ALPHA, goodness_of_fit
from xllm_py.worker.rejection_sampler import verify
from xllm_py.worker.sampler import Sampler, SamplingBatch

P0 = torch.tensor([0.5, 0.3, 0.15, 0.05])  # target at the row judging the draft
P1 = torch.tensor([0.1, 0.2, 0.3, 0.4])  # target at the bonus row
N = 40_000  # requests; a frequency's standard error is <= 0.0025
TOL = 0.012


def batch(rows: int, seeds=()) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.ones(rows),
        greedy=torch.zeros(rows, dtype=torch.bool),
        all_greedy=False,
        top_k=None,
        top_p=None,
        min_p=None,
        seeds=list(seeds),
        banned=[],
        max_logprobs=None,
    )


def logits_for(n: int) -> torch.Tensor:
    rows = torch.stack([P0.log(), P1.log()]).repeat(n, 1)  # request i: rows 2i, 2i + 1
    return rows.clone()


def freqs(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=4).float() / len(tokens)


def test_greedy_draft_keeps_target_distribution():
    sampler = Sampler(torch.Generator().manual_seed(0))
    drafts = [[1]] * N  # always propose token 1 (q one-hot)
    out = verify(sampler, logits_for(N), batch(2 * N), [2] * N, drafts)
    first = [o[0] for o in out]
    assert torch.allclose(freqs(first), P0, atol=TOL)
    accepted = [o for o in out if len(o) == 2]  # draft kept: a bonus token follows
    assert abs(len(accepted) / N - P0[1].item()) < TOL  # accepted with probability p(1)
    assert torch.allclose(freqs([o[1] for o in accepted]), P1, atol=2 * TOL)


def test_sampled_draft_with_its_distribution_keeps_target_distribution():
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])
    g = torch.Generator().manual_seed(1)
    d = torch.multinomial(q, N, replacement=True, generator=g).tolist()
    sampler = Sampler(torch.Generator().manual_seed(2))
    qs = [q.unsqueeze(0)] * N
    out = verify(sampler, logits_for(N), batch(2 * N), [2] * N, [[t] for t in d], draft_probs=qs)
    assert torch.allclose(freqs([o[0] for o in out]), P0, atol=TOL)
    # Kept with probability sum min(p, q) = 1 - TV(p, q) (0.75 here), the most any rule
    # keeps; verifying these drafts as if they were greedy (one-hot q) keeps sum q p = 0.29.
    kept = sum(len(o) == 2 for o in out) / N
    assert abs(kept - torch.minimum(P0, q).sum().item()) < TOL


def test_seeded_requests_repeat_whatever_the_batch():
    sampler = Sampler(torch.Generator().manual_seed(3))
    seeded = [(0, 11), (1, 12)]  # both rows of request 0 are seeded
    a = verify(sampler, logits_for(1), batch(2, seeded), [2], [[1]])
    big = logits_for(50)
    b = verify(sampler, big, batch(100, seeded), [2] * 50, [[1]] * 50)
    assert a[0] == b[0]


def test_greedy_rows_verify_like_plain_greedy():
    sampler = Sampler(torch.Generator().manual_seed(4))
    logits = logits_for(3)
    greedy = SamplingBatch.greedy_rows()
    out = verify(sampler, logits, greedy, [2, 2, 2], [[0], [1], [3]])
    # argmax of P0 is 0: draft 0 accepted, then argmax of P1 (3); others corrected to 0
    assert out == [[0, 3], [0], [0]]


def test_greedy_verification_of_long_draft_runs():
    """Each draft is checked against the argmax of its own row: runs of 3 drafts that are
    all right (bonus token from the last row), right then wrong at position 1 or 2."""
    logits = torch.randn(12, 7, generator=torch.Generator().manual_seed(6))
    best = logits.argmax(dim=-1).tolist()
    wrong = [(t + 1) % 7 for t in best]
    drafts = [best[0:3], [best[4], wrong[5], best[6]], [best[8], best[9], wrong[10]]]
    out = verify(Sampler(), logits, SamplingBatch.greedy_rows(), [4, 4, 4], drafts)
    assert out == [best[0:4], [best[4], best[5]], [best[8], best[9], best[10]]]


def test_general_path_with_greedy_rows_matches_the_greedy_fast_path():
    sampler = Sampler(torch.Generator().manual_seed(5))
    logits = torch.randn(9, 4)
    drafts = [[2, 1], [0, 3], [1, 1]]
    fast = SamplingBatch.greedy_rows()
    general = batch(9)
    general.greedy = torch.ones(9, dtype=torch.bool)  # greedy rows through the [R, V] path
    a = verify(sampler, logits.clone(), fast, [3, 3, 3], drafts)
    b = verify(sampler, logits.clone(), general, [3, 3, 3], drafts)
    assert a == b


# ---- verification with temperature, top-k, top-p and min-p, against the paper's rule -----------
#
# The reference below is written from the definitions, not from xllm_py: the target
# distribution of a row after each processor, and the exact probability of every sequence
# a request can emit under speculative sampling (Leviathan et al. 2023, Algorithm 1):
# draft j is kept with probability min(1, p_{j-1}(d_j) / q_j(d_j)); at the first rejection
# a token comes from normalise(max(p_{j-1} - q_j, 0)); after k acceptances, one from p_k.

V = 6
SETTINGS = {
    "t0.7-topk3": dict(temperature=0.7, top_k=3),
    "t0.5-topp0.8": dict(temperature=0.5, top_p=0.8),
    "t1.3-minp0.2": dict(temperature=1.3, min_p=0.2),
    "t0.9-all": dict(temperature=0.9, top_k=4, top_p=0.9, min_p=0.1),
    "t0.3": dict(temperature=0.3),
}


def reference_target(logits: list[float], temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """{token: probability} after temperature, top-k, top-p (smallest head of the sorted
    distribution whose mass reaches top_p), then min-p (drop p < min_p * max p)."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = order[:top_k] if top_k > 0 else order

    def normalise(ids):
        m = max(scaled[i] for i in ids)
        w = {i: math.exp(scaled[i] - m) for i in ids}
        s = sum(w.values())
        return {i: w[i] / s for i in ids}

    p = normalise(keep)
    head, mass = [], 0.0
    for i in keep:  # already sorted, largest first
        head.append(i)
        mass += p[i]
        if mass >= top_p:
            break
    p = normalise(head)
    top = max(p.values())
    return normalise([i for i in p if p[i] >= min_p * top])


def reference_outcomes(targets: list[dict], drafts: list[int], q: list[dict] | None = None):
    """{emitted tuple: probability} for one request with drafts d_1..d_k judged by targets
    p_0..p_{k-1} and p_k for the bonus; q[j] is d_{j+1}'s draft distribution (None: one-hot,
    i.e. greedy drafting)."""
    out: dict[tuple, float] = {}

    def add(seq, pr):
        if pr > 0:
            out[seq] = out.get(seq, 0.0) + pr

    reach = 1.0
    for j, d in enumerate(drafts):
        p = targets[j]
        qj = q[j] if q else {d: 1.0}
        accept = min(1.0, p.get(d, 0.0) / qj[d])
        residual = {t: max(p.get(t, 0.0) - qj.get(t, 0.0), 0.0) for t in range(V)}
        total = sum(residual.values())
        for t, r in residual.items():
            add((*drafts[:j], t), reach * (1 - accept) * r / total if total else 0.0)
        reach *= accept
    for t, pr in targets[len(drafts)].items():
        add((*drafts, t), reach * pr)
    return out


def sampling_batch(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> SamplingBatch:
    b = batch(rows)
    b.temperature = torch.full((rows,), float(temperature))
    b.top_k = torch.full((rows,), top_k) if top_k else None
    b.top_p = torch.full((rows,), float(top_p)) if top_p < 1 else None
    b.min_p = torch.full((rows,), float(min_p)) if min_p else None
    return b


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_drafts_verified_under_logits_processors_match_the_paper(setting):
    kw = SETTINGS[setting]
    k, n = 2, 30_000
    g = torch.Generator().manual_seed(10)
    rows = torch.randn(k + 1, V, generator=g) * 2  # one request's verification rows
    targets = [reference_target(r.tolist(), **kw) for r in rows]
    # drafts: row 0's top token (accepted often), row 1's second (filtered out by some settings)
    drafts = [int(rows[0].argmax()), int(rows[1].argsort(descending=True)[1])]
    sampler = Sampler(torch.Generator().manual_seed(11))
    out = verify(
        sampler, rows.repeat(n, 1), sampling_batch((k + 1) * n, **kw), [k + 1] * n, [drafts] * n
    )
    verdict = goodness_of_fit([tuple(o) for o in out], reference_outcomes(targets, drafts))
    assert verdict.p_value > ALPHA, f"{setting}: {verdict}"


@pytest.mark.parametrize("setting", ["t0.7-topk3", "t1.2"])
def test_three_drafts_per_request_match_the_paper(setting):
    """k = 3: every draft is judged by its own row, and so is every recovery (with k = 2 and
    identical requests, reading a neighbour's verdict would go unnoticed)."""
    kw = SETTINGS.get(setting, dict(temperature=1.2))
    k, n = 3, 30_000
    g = torch.Generator().manual_seed(12)
    rows = torch.randn(k + 1, V, generator=g) * 2
    targets = [reference_target(r.tolist(), **kw) for r in rows]
    ranked = [r.argsort(descending=True).tolist() for r in rows]
    drafts = [ranked[0][0], ranked[1][1], ranked[2][0]]
    sampler = Sampler(torch.Generator().manual_seed(13))
    out = verify(
        sampler, rows.repeat(n, 1), sampling_batch((k + 1) * n, **kw), [k + 1] * n, [drafts] * n
    )
    verdict = goodness_of_fit([tuple(o) for o in out], reference_outcomes(targets, drafts))
    assert verdict.p_value > ALPHA, f"{setting}: {verdict}"


@pytest.mark.parametrize("setting", ["t0.7-topk3", "t1.3-minp0.2", "t0.3"])
def test_sampled_drafts_verified_under_logits_processors_match_the_paper(setting):
    kw = SETTINGS[setting]
    n = 30_000
    g = torch.Generator().manual_seed(20)
    rows = torch.randn(2, V, generator=g) * 2
    q = torch.softmax(torch.randn(V, generator=g), dim=-1)
    targets = [reference_target(r.tolist(), **kw) for r in rows]
    d = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    sampler = Sampler(torch.Generator().manual_seed(21))
    out = verify(
        sampler,
        rows.repeat(n, 1),
        sampling_batch(2 * n, **kw),
        [2] * n,
        [[t] for t in d],
        draft_probs=[q.unsqueeze(0)] * n,
    )
    qd = {t: q[t].item() for t in range(V)}
    expected: dict[tuple, float] = {}
    for t in range(V):  # the draft itself is random: mix the outcomes over q
        for seq, pr in reference_outcomes(targets, [t], [qd]).items():
            expected[seq] = expected.get(seq, 0.0) + qd[t] * pr
    verdict = goodness_of_fit([tuple(o) for o in out], expected)
    assert verdict.p_value > ALPHA, f"{setting}: {verdict}"


def test_reference_target_agrees_with_the_plain_samplers_distribution():
    """The sampler's own distribution (what plain decoding draws from) is the reference's:
    the two verification tests above compare against a correct target, not a copy."""
    g = torch.Generator().manual_seed(30)
    rows = torch.randn(len(SETTINGS), V, generator=g) * 2
    sampler = Sampler()
    for row, kw in zip(rows, SETTINGS.values()):
        probs = sampler.probabilities(row.unsqueeze(0).clone(), sampling_batch(1, **kw))[0]
        ref = reference_target(row.tolist(), **kw)
        assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)
        assert probs.tolist() == pytest.approx([ref.get(t, 0.0) for t in range(V)], abs=1e-6)
