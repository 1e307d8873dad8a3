"""Confidence-scheduled draft length: how many of its drafts each request verifies.

Every draft comes with a score: the top probability of the distribution it was drawn from
(the draft's processed distribution q for a sampled draft, worker/draft_sampler.py; the
draft logits' softmax for a greedy one, which is the probability of the draft itself).
The policy turns scores into chances of acceptance:

    a_j(s)   the measured rate at which a draft at position j (0-based) with a score in s's
             bin is accepted when the drafts before it were; BINS bins per position,
             counts decayed by DECAY per step, plus PRIOR pseudo-counts of acceptance: a bin
             without data is optimistic (1), so its drafts are verified and measured, and
             one that decayed back to few counts is measured again
    C_j      a_0(s_0) * ... * a_j(s_j): the chance draft j is accepted, i.e. the expected
             tokens it adds to the request's step

A request verifies its drafts while C_j is at least the threshold, so the run stops where
the draft stops being sure. Fewer drafts never change what is emitted: the target verifies
whatever is sent (worker/rejection_sampler.py).

Why a score may describe q but never the token drawn from it: a sampled draft d ~ q is
accepted with min(1, p(d)/q(d)) and replaced from normalise(max(p - q, 0)) otherwise, and
that emits exactly p only if d is verified whatever d is. A rule that looks at q(d) (keep
the drafts whose own probability is high) verifies high-q tokens and sends the rest back
to a plain draw from p; the verified ones are accepted most often, so confident tokens
come out more often than p gives them (measured on the bundled model: TV 0.16 from plain
decoding at T = 0.7). A decision made from the context and from q as a whole (its top
probability here; the scores of the drafts before j, which are context once those drafts
are accepted) is independent of d given them, and each position still emits p. A greedy
draft is the argmax of its distribution, so its own probability is that top probability.

The threshold is fixed (--speculative_confidence=FLOAT) or follows load ("auto"). With a
step cost of S seconds for R requests and N verification rows, yielding T expected tokens,
one more row costs d = dS/dN and adds C_j tokens; it raises tokens per second iff
C_j * S > d * T. "auto" fits S = s0 + s_req * R + s_row * N to the measured decode steps
that drafted (least squares with decay; steps with a prompt chunk are left out) and admits
drafts in order of C_j for as long as that holds. At batch 1 a row is nearly free and the
runs go deep; under load each row costs about S / N and only sure drafts are verified, the
least sure rows going to k = 0 first. Until MIN_STEPS steps are measured it uses
START_THRESHOLD. Whether a step drafts at all is "auto"'s gate (speculative/gate.py): it
measures tokens per second with and without drafting, per batch size, and runs the faster,
so drafts that do not pay (an expensive MTP layer, a busy device, text the draft does not
predict) leave the step as cheap as plain decoding.
"""

from __future__ import annotations

from xllm_py.speculative.gate import DraftGate

BINS = 10  # score bins per draft position
DECAY = 0.995  # acceptance counts, per step: a window of about 200 steps
PRIOR = 2.0  # pseudo-counts of acceptance in every bin
COST_DECAY = 0.98  # the step-cost fit, per decode step
MIN_STEPS = 16  # decode steps measured before "auto" trusts its fit
START_THRESHOLD = 0.3  # "auto" until then


def _bin(score: float) -> int:
    return min(max(int(score * BINS), 0), BINS - 1)


class _LinearCost:
    """S ~ s0 + s_req * requests + s_row * rows, by decayed least squares."""

    def __init__(self) -> None:
        self.xtx = [[0.0] * 3 for _ in range(3)]
        self.xty = [0.0] * 3
        self.steps = 0

    def observe(self, requests: int, rows: int, seconds: float) -> None:
        x = (1.0, float(requests), float(rows))
        for i in range(3):
            self.xty[i] = self.xty[i] * COST_DECAY + x[i] * seconds
            for j in range(3):
                self.xtx[i][j] = self.xtx[i][j] * COST_DECAY + x[i] * x[j]
        self.steps += 1

    def coefficients(self) -> tuple[float, float, float] | None:
        """(s0, s_req, s_row), or None before MIN_STEPS steps or when they do not tell the
        cost of a row from the cost of a request (no spread in rows per request)."""
        if self.steps < MIN_STEPS:
            return None
        a = [row[:] + [b] for row, b in zip(self.xtx, self.xty)]
        ridge = 1e-9 * max(a[0][0], 1.0)
        for i in range(3):
            a[i][i] += ridge
        for col in range(3):  # Gauss-Jordan with partial pivoting
            pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
            if abs(a[pivot][col]) < 1e-12:
                return None
            a[col], a[pivot] = a[pivot], a[col]
            for r in range(3):
                if r != col:
                    f = a[r][col] / a[col][col]
                    a[r] = [v - f * w for v, w in zip(a[r], a[col])]
        return tuple(a[i][3] / a[i][i] for i in range(3))


class ConfidencePolicy:
    def __init__(self, max_k: int, threshold: float | str = "auto") -> None:
        self.max_k = max_k
        self.threshold = threshold  # a number, or "auto"
        self.judged = [[0.0] * BINS for _ in range(max_k)]
        self.accepted = [[0.0] * BINS for _ in range(max_k)]
        self.undecayed = 0  # steps whose DECAY the counts still owe (steps without drafts)
        self.cost = _LinearCost()
        self.gate = DraftGate() if threshold == "auto" else None

    def chance(self, j: int, score: float) -> float:
        """a_j(score): calibrated chance that draft j is accepted given the ones before."""
        self._decay()
        b = _bin(score)
        return (self.accepted[j][b] + PRIOR) / (self.judged[j][b] + PRIOR)

    def runs(self, scores: list[float]) -> list[float]:
        """C_j for each draft of one request."""
        out, run = [], 1.0
        for j, s in enumerate(scores[: self.max_k]):
            run *= self.chance(j, s)
            out.append(run)
        return out

    def plan(self, scores: list[list[float]]) -> list[int]:
        """How many of its drafts each request (scores of its drafts, in order) verifies."""
        if not scores:
            return []
        runs = [self.runs(s) for s in scores]
        fit = self.cost.coefficients() if self.threshold == "auto" else None
        if fit is None:  # a fixed threshold, or "auto" before its fit
            threshold = START_THRESHOLD if self.threshold == "auto" else float(self.threshold)
            return [sum(1 for c in r if c >= threshold) for r in runs]
        requests = len(scores)
        row_cost, seconds = self._costs(fit, requests)
        tokens = float(requests)
        take = [0] * requests
        ranked = sorted(
            ((c, i, j) for i, r in enumerate(runs) for j, c in enumerate(r)),
            key=lambda t: (-t[0], t[2]),
        )
        for c, i, j in ranked:
            if c * seconds <= row_cost * tokens or j != take[i]:
                continue  # does not pay, or an earlier draft of the run was left out
            take[i] += 1
            tokens += c
            seconds += row_cost
        return take

    def drafting(self, requests: int) -> bool:
        """Whether the next step, with `requests` requests running, should draft at all
        (False: its MTP passes are skipped). Always with a fixed threshold."""
        return self.gate is None or self.gate.drafting(requests)

    @staticmethod
    def _costs(fit: tuple[float, float, float], requests: int) -> tuple[float, float]:
        """(cost of one more row, cost of a step of `requests` rows without drafts). A row
        costs at least nothing and at most a whole step per request: a fit on steps with
        little spread in rows can say anything about rows alone."""
        s0, s_req, s_row = fit
        seconds = max(s0 + (s_req + max(s_row, 0.0)) * requests, 1e-9)
        return min(max(s_row, 0.0), seconds / max(requests, 1)), seconds

    # ---- what the step reports ------------------------------------------------------------

    def observe_acceptance(self, results: list[tuple[list[float], int]]) -> None:
        """One step's (scores of the drafts verified, drafts accepted) per request. A step
        without drafts only counts: its decay is applied with the next one that has them
        (or when a chance is read), one multiplication for the lot."""
        self.undecayed += 1
        if not results:
            return
        self._decay()
        for scores, accepted in results:
            for j in range(min(len(scores), accepted + 1, self.max_k)):
                b = _bin(scores[j])
                self.judged[j][b] += 1.0
                if j < accepted:
                    self.accepted[j][b] += 1.0

    def _decay(self) -> None:
        if not self.undecayed:
            return
        f = DECAY**self.undecayed
        self.undecayed = 0
        for j in range(self.max_k):
            self.judged[j] = [c * f for c in self.judged[j]]
            self.accepted[j] = [c * f for c in self.accepted[j]]

    def observe_prompt_passes(self, drafted: bool, tokens: float, seconds: float) -> None:
        """Any step: whether it drafted, the tokens it emitted, and the seconds its MTP
        passes spent on prompt positions (which a step that does not draft skips)."""
        if self.gate is not None and drafted:
            self.gate.charge(tokens, seconds)

    def observe_step(
        self, requests: int, rows: int, seconds: float, tokens: float, drafted: bool, steady: bool
    ) -> None:
        """A decode step (no prompt chunk): `requests` requests, `rows` verification rows,
        `tokens` it emitted (one per request and its accepted drafts); `drafted`: it ran the
        MTP passes; `steady`: so did the step before it (or neither did)."""
        if drafted:
            self.cost.observe(requests, rows, seconds)
        if self.gate is not None and steady:
            self.gate.observe(requests, drafted, tokens, seconds)
