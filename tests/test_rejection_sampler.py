"""Draft verification keeps the target's distribution exactly (Leviathan et al.):
checked by frequencies on a 4-token vocabulary with known target and draft
distributions, for greedy (one-hot) drafts and for drafts sampled from q."""

from __future__ import annotations

import torch

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
    out = verify(
        sampler, logits_for(N), batch(2 * N), [2] * N, [[t] for t in d], draft_probs=q.repeat(N, 1)
    )
    assert torch.allclose(freqs([o[0] for o in out]), P0, atol=TOL)


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
