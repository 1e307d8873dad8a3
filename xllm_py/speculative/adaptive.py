"""Adaptive speculation: how many MTP drafts (0..K) the next step should carry.

A step with k drafts per request costs c(b, k) seconds at decode batch size b and
yields, per request, the expected number of tokens

    E(k) = 1 + sum_{j=1..k} a_1 * a_2 * ... * a_j

where a_j is the running rate at which draft j is accepted given drafts 1..j-1 were.
The controller picks the k that maximises E(k) / c(b, k), i.e. tokens per second.

* Acceptance: counts per draft position, decayed by DECAY at every step (a window
  of roughly 1 / (1 - DECAY) steps), so a change of workload shows within a few
  dozen steps. Before any draft has been seen, a_j = PRIOR_ACCEPTANCE.
* Cost: measured, never modelled. The engine times every step from its start to the
  next step's start (the model's passes and the engine's own work per step, which a
  larger k shares among more tokens; the passes alone made k = 0 look best on the
  bundled model, where that work is a third of a plain step); only "clean" steps
  count (every request decoding, every one verifying exactly the k drafts the step
  also proposes; prefill chunks and transitions between k values are left out). Batch
  sizes share a cost per power-of-two bucket (1, 2, 3-4, 5-8, ...). A cost is the median
  of the last COST_WINDOW clean steps of the last STALE_AFTER steps of its bucket: a
  step stalled by another thread, a collector pause or a first-use compilation must
  not move k, and on a shared machine costs drift, so k values are compared on costs
  measured close together (a k whose samples are all stale is tried again).
* Exploration: a bucket first tries every k from K down to 0 for HOLD steps each
  (the first of them is a transition, so HOLD - 1 clean samples). Afterwards, every
  EXPLORE_EVERY steps in a bucket, one neighbour of the best k (alternately below
  and above) is held for HOLD steps to refresh its cost; a k not measured within
  STALE_AFTER steps is tried like a new one. A new best must beat the
  current k by SWITCH_MARGIN, so noise does not make k flap.

With k = 0 the worker skips the MTP pass of the requests that are decoding: that is
what makes a step as cheap as plain decoding. Their MTP latent cache then has no
entries for the positions decoded at k = 0; drafts proposed later attend over those
slots as they are (still lossless: the target verifies every draft, but acceptance
can be lower on such requests until they finish). Prompt chunks still run through
the MTP layer, so requests admitted at k = 0 draft well once k rises.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

DECAY = 0.98
PRIOR_ACCEPTANCE = 0.7
HOLD = 4
EXPLORE_EVERY = 64
STALE_AFTER = 256
SWITCH_MARGIN = 0.10
COST_WINDOW = 9


def batch_bucket(batch: int) -> int:
    """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...: batch sizes that share a step cost."""
    return max(batch - 1, 0).bit_length()


@dataclass
class _Bucket:
    # k -> (bucket step, seconds) of its last clean steps
    recent: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    steps: int = 0  # steps chosen in this bucket
    explore_up: bool = False  # which neighbour the next refresh tries
    incumbent: int | None = None  # the k this bucket runs between trials

    def fresh(self, k: int) -> list[float]:
        return [s for at, s in self.recent.get(k, ()) if self.steps - at <= STALE_AFTER]

    @property
    def costs(self) -> dict[int, float]:
        """k -> seconds per clean step: the median of the fresh ones."""
        return {k: statistics.median(v) for k in self.recent if (v := self.fresh(k))}


class AdaptiveSpeculation:
    def __init__(self, max_k: int) -> None:
        if max_k < 1:
            raise ValueError(f"adaptive speculation needs num_speculative_tokens >= 1, got {max_k}")
        self.max_k = max_k
        self.reached = [0.0] * max_k  # decayed count of drafts at position j that were judged
        self.accepted = [0.0] * max_k  # ... and accepted
        self.buckets: dict[int, _Bucket] = {}
        self.k = max_k  # the k of the current step (read by /metrics)
        self._trial: tuple[int, int, int] | None = None  # (bucket, k, steps left)
        self.steps_by_k = [0] * (max_k + 1)

    # ---- what the scheduler asks ----------------------------------------------------------

    def choose(self, batch: int) -> int:
        """The k for a step whose decode batch has `batch` requests."""
        b = batch_bucket(batch)
        bucket = self.buckets.setdefault(b, _Bucket())
        bucket.steps += 1
        k = self._next(b, bucket)
        self.k = k
        self.steps_by_k[k] += 1
        return k

    def _next(self, b: int, bucket: _Bucket) -> int:
        if self._trial is not None and self._trial[0] == b and self._trial[2] > 0:
            _, k, left = self._trial
            self._trial = (b, k, left - 1)
            return k
        untried = [k for k in range(self.max_k, -1, -1) if len(bucket.fresh(k)) < HOLD - 1]
        if untried:
            return self._start_trial(b, untried[0])
        best = self.best(b)
        if bucket.steps % EXPLORE_EVERY == 0:
            bucket.explore_up = not bucket.explore_up
            other = best + 1 if bucket.explore_up else best - 1
            if 0 <= other <= self.max_k:
                return self._start_trial(b, other)
        return best

    def _start_trial(self, b: int, k: int) -> int:
        self._trial = (b, k, HOLD - 1)
        return k

    def best(self, batch_bucket_index: int) -> int:
        """The k with the most expected tokens per second among those measured."""
        bucket = self.buckets[batch_bucket_index]
        rates = {k: self.expected_tokens(k) / c for k, c in bucket.costs.items() if c > 0}
        if not rates:
            return self.k
        best = max(rates, key=rates.get)
        current = bucket.incumbent if bucket.incumbent in rates else best
        if rates[best] > rates[current] * (1 + SWITCH_MARGIN):
            current = best
        bucket.incumbent = current  # a trial's k does not become the incumbent by running
        return current

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens one request gains from a step with k drafts."""
        total, run = 1.0, 1.0
        for j in range(k):
            run *= self.acceptance(j)
            total += run
        return total

    def acceptance(self, j: int) -> float:
        """Rate at which draft j (0-based) is accepted when drafts 0..j-1 were."""
        if self.reached[j] < 1.0:
            return PRIOR_ACCEPTANCE
        return self.accepted[j] / self.reached[j]

    # ---- what the step reports ------------------------------------------------------------

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        """A clean step: `batch` requests each verified and proposed `k` drafts."""
        bucket = self.buckets.setdefault(batch_bucket(batch), _Bucket())
        recent = bucket.recent.setdefault(k, [])
        recent.append((bucket.steps, seconds))
        del recent[:-COST_WINDOW]

    def observe_acceptance(self, results: list[tuple[int, int]]) -> None:
        """One step's (drafts verified, drafts accepted) per request."""
        for j in range(self.max_k):
            self.reached[j] *= DECAY
            self.accepted[j] *= DECAY
        for drafts, accepted in results:
            for j in range(min(drafts, accepted + 1)):  # judged: every draft up to the first miss
                self.reached[j] += 1.0
                if j < accepted:
                    self.accepted[j] += 1.0
