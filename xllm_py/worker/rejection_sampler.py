"""Verify draft tokens against the target so the output distribution is exactly
the target's (Leviathan et al. 2023).

Terms, for one request with k drafts in a step:
  draft      d_1..d_k, proposed by the MTP layer; q_j is the distribution d_j was
             drawn from (worker/draft_sampler.py): one-hot at d_j for a greedy draft
  target     p_0..p_k, the target's distributions at the k + 1 verification rows
             (temperature, top-k, top-p, min-p applied), p_{j-1} judging d_j
  accepted   d_j is kept with probability min(1, p_{j-1}(d_j) / q_j(d_j)), in order,
             until the first rejection
  recovered  at the first rejection j, a token drawn from normalise(max(p_{j-1} - q_j, 0))
  bonus      when all k are accepted, a token drawn from p_k
A request emits accepted + 1 tokens. Greedy requests have one-hot p, so this is
"accept while d_j == argmax, then the argmax": token-identical to plain decoding.

Draws for a seeded request come from a generator seeded by (seed, output index),
like the plain sampler, so a seeded request repeats whatever else is batched.

A request whose drafts come without q (greedy requests, and seeded ones, whose drafts race
on the noise their verification rows use) is verified as a coupling: each row draws x from
p_{j-1} exactly as plain sampling would, d_j is kept iff it equals x, and at the first miss
x itself is the recovered token. For a draft that does not depend on that noise this is
the rule above with one-hot q (kept with probability p_{j-1}(d_j)); for any draft the
emitted tokens are exactly the ones plain sampling draws from the same noise, so a seeded
request's output does not depend on the drafts, on k, or on adaptive speculation changing
k from step to step. A request whose drafts carry q (unseeded sampling) gets the rule
above with that q: kept with probability sum min(p, q) = 1 - TV(p, q).
"""

from __future__ import annotations

import torch

from xllm_py.worker.sampler import Sampler, SamplingBatch


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    batch: SamplingBatch,
    row_counts: list[int],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None] | None = None,
) -> list[list[int]]:
    """logits [R, V] for all verification rows, request after request (request i owns
    row_counts[i] = len(drafts[i]) + 1 consecutive rows). draft_probs[i]: q of request i's
    drafts [len(drafts[i]), V], or None to verify them as a coupling (see above); None: no
    request has any. Returns the emitted tokens per request."""
    has_q = [q is not None for q in draft_probs] if draft_probs else [False] * len(drafts)
    if batch.all_greedy and not any(has_q):
        return _verify_greedy(sampler.greedy(logits, batch).tolist(), row_counts, drafts)
    probs = sampler.probabilities(logits, batch)  # [R, V]; one-hot on greedy rows
    starts = [0]
    for c in row_counts[:-1]:
        starts.append(starts[-1] + c)
    judge_rows = [s + j for s, d in zip(starts, drafts) for j in range(len(d))]
    flat = [t for d in drafts for t in d]
    dev = logits.device
    draws = sampler.draws(probs, batch)
    final_rows = [s + len(d) for s, d in zip(starts, drafts)]
    bonus = draws.pick(probs[torch.tensor(final_rows, device=dev)], final_rows).tolist()
    if not flat:
        return [[b] for b in bonus]
    rows = torch.tensor(judge_rows, device=dev)
    ids = torch.tensor(flat, device=dev)
    p = probs[rows]  # [D, V]
    drawn = [h for h, d in zip(has_q, drafts) for _ in d]
    accept = torch.zeros(len(flat), dtype=torch.bool, device=dev)
    recovered = torch.empty_like(ids)
    if not all(drawn):
        # The coupled rule: x = the token plain sampling draws at this row (for a seeded row
        # the same exponential race on the same noise); keep d iff d == x, else emit x.
        at = torch.tensor([i for i, h in enumerate(drawn) if not h], device=dev)
        x = draws.pick(p[at], [judge_rows[i] for i in at.tolist()])
        accept[at], recovered[at] = x == ids[at], x
    if any(drawn):
        at = torch.tensor([i for i, h in enumerate(drawn) if h], device=dev)
        q = torch.cat([qi for qi in draft_probs if qi is not None]).to(p.dtype)
        p = p[at]
        p_d = p.gather(1, ids[at].unsqueeze(1)).squeeze(1)
        q_d = q.gather(1, ids[at].unsqueeze(1)).squeeze(1)
        accept[at] = draws.uniform[rows[at]] * q_d < p_d  # u < p/q without dividing by zero
        residual = (p - q).clamp(min=0)
        # Rows where p <= q everywhere cannot reject; keep a valid distribution there anyway.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
        recovered[at] = draws.pick(residual, [judge_rows[i] for i in at.tolist()])
    accept, recovered = accept.tolist(), recovered.tolist()
    out, d_at = [], 0
    for i, d in enumerate(drafts):
        emitted = []
        for j, tok in enumerate(d):
            if accept[d_at + j]:
                emitted.append(tok)
            else:
                emitted.append(recovered[d_at + j])
                break
        else:
            emitted.append(bonus[i])
        out.append(emitted)
        d_at += len(d)
    return out


def _verify_greedy(argmax: list[int], row_counts: list[int], drafts: list[list[int]]):
    """All rows greedy: keep drafts while they equal the target's argmax, then its argmax.
    (What the general path computes with one-hot p, without building [R, V] tensors.)"""
    out, row = [], 0
    for count, d in zip(row_counts, drafts):
        emitted = []
        for j in range(count):
            emitted.append(argmax[row + j])
            if j == len(d) or d[j] != argmax[row + j]:
                break
        out.append(emitted)
        row += count
    return out
