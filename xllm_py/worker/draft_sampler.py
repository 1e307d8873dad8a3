"""Sampled MTP drafts (--speculative_draft_sampling=sampled, the default), and the
distributions they were drawn from, kept until the next step verifies them.

A draft is drawn the way the target's verification row will sample that position: the
draft's logits (over the hot tokens only with a hot-vocabulary head, and masked by the
request's grammar) go through the request's own processing (logit bias, penalties over
its outputs and the drafts before, min_tokens bans, temperature, top-k, top-p, min-p:
worker/sampler.py) into a distribution q. Three kinds of row:

  greedy request     the argmax of the draft logits (one-hot q); verification keeps it
                     while it equals the target's argmax: token-identical to k = 0.
  seeded sampling    coupled: d = argmax(q / E), where E is the exponential noise plain
                     sampling uses for that output index of that seed. Verification keeps
                     d iff the target's own race on the same E picks it, and emits that
                     pick otherwise, so the request emits exactly the tokens it would
                     emit without drafts, whatever the drafts, k or the batch. It is kept
                     with probability P(argmax q/E = argmax p/E), which is 1 when q = p
                     (a greedy draft: p(d) at most).
  other sampling     d drawn from q afresh; q is kept here, and verification
                     accepts with min(1, p(d) / q(d)) and on rejection draws from
                     normalise(max(p - q, 0)) (worker/rejection_sampler.py): kept with
                     probability 1 - TV(p, q), the most any rule can keep. The output is
                     distributed as the target's but, unlike the seeded case, depends on
                     the drafts: a request without a seed is not reproducible anyway.

Under tensor parallelism every rank holds the gathered logits, draws the same numbers from
the same generator and keeps the same q.
"""

from __future__ import annotations

import torch

from xllm_py.worker.row_sampling import RowSampling
from xllm_py.worker.runner_request import RunnerRequest
from xllm_py.worker.sampler import Sampler


class DraftSampler:
    def __init__(self, sampler: Sampler, rows: RowSampling) -> None:
        """The model runner's sampler and row builder: a draft row is processed as the
        verification row of its position will be."""
        self.sampler = sampler
        self.rows = rows
        # req_id -> (request, tokens this step emitted for it), for the step being drafted
        self._context: dict[str, tuple[RunnerRequest, list[int]]] = {}
        # req_id -> (drafts, q of each) of the last drafting pass; replaced every step, so it
        # holds at most one entry per request of that step
        self.pending: dict[str, tuple[list[int], list[torch.Tensor]]] = {}

    def begin(self, context: dict[str, tuple[RunnerRequest, list[int]]]) -> None:
        """A drafting pass starts: the q kept from the last one has been used (or dropped)."""
        self._context = context
        self.pending = {}

    def choose(
        self, logits: torch.Tensor, req_ids: list[str], step: int, drafts: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft step `step` (0-based) of each row's request: logits [T, V] of the draft
        (-inf outside the hot tokens and the grammar), drafts: each row's drafts so far.
        Returns the draft tokens [T] and their scores [T], and keeps q for the unseeded
        sampled rows. A score is the top probability of the row's distribution (q, or the
        draft's softmax on a greedy row), never q(d) of the token drawn: which drafts get
        verified must not depend on the draw (speculative/confidence.py)."""
        logits = logits.float()
        raw_score, raw_argmax = torch.softmax(logits, dim=-1).max(dim=-1)
        rows = [(self._context[r][0], len(self._context[r][1]) + step) for r in req_ids]
        batch = self.rows.batch(rows)
        batch.adjust = self.rows.adjust(
            rows, [self._context[r][1] + d for r, d in zip(req_ids, drafts)]
        )
        probs = self.sampler.probabilities(logits, batch)  # one-hot on greedy rows
        # A row whose every token is masked (no hot token the grammar allows): uniform q, a
        # draft that verification will reject, as it would any draft there.
        dead = ~(probs.sum(dim=-1) > 0)
        if dead.any():
            probs[dead] = 1.0 / probs.shape[1]
        # seeded rows race on that output's noise, the others draw fresh from q
        tokens = self.sampler.draws(probs, batch).pick(probs)
        score = probs.max(dim=-1).values
        if not batch.all_greedy:
            tokens = torch.where(batch.greedy, raw_argmax, tokens)
            score = torch.where(batch.greedy, raw_score.nan_to_num(0.0), score)
        for n, (req_id, (req, _)) in enumerate(zip(req_ids, rows)):
            if req.sampling.greedy:
                continue
            kept = self.pending.setdefault(req_id, ([], []))
            kept[0].append(int(tokens[n]))
            if req.sampling.seed is None:
                kept[1].append(probs[n])
        return tokens, score

    def q_for(self, req_id: str, drafts: list[int]) -> torch.Tensor | None:
        """q [len(drafts), V] of the drafts this step verifies, if they were drawn from it
        (an unseeded sampled request's, as proposed or a prefix of them); None: verify as
        one-hot drafts (greedy or coupled), which is exact for any draft."""
        kept = self.pending.get(req_id)
        if not drafts or kept is None or len(kept[1]) < len(drafts):
            return None
        if kept[0][: len(drafts)] != drafts:
            return None
        return torch.stack(kept[1][: len(drafts)])
