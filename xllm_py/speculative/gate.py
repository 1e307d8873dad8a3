"""The draft gate of --speculative_confidence=auto: whether a step drafts at all.

A step that drafts runs the MTP passes for every decoding request and verifies the
drafts the step before proposed (as many as speculative/confidence.py's plan keeps); a
step that does not is a plain decoding step: the MTP passes are skipped, so the next step
has nothing to verify. Which one emits more tokens per second depends on the model (on
the bundled small model an MTP pass costs a quarter of a target step, on DeepSeek-V3 a
sixtieth), the device, the batch size and the text, so the gate measures both:

    yield    tokens a step was expected to emit per request: 1 without drafts, 1 plus
             the chances of its verified drafts with them (speculative/confidence.py's
             calibrated C_j: the mean of the tokens emitted, without the noise of each
             step's few acceptances)
    cost     seconds per request of a step, start to next start (the passes and the
             engine's own work around them, as speculative/adaptive.py times its steps)
    rate     mean yield / median cost over the last WINDOW steady steps of that kind
             (the median: a step stalled by another thread or a collector must not decide)

per batch-size bucket (speculative/adaptive.py's: 1, 2, 3-4, 5-8, ...). Only steady
decode steps count: no prompt chunk in the step, and the step before drafted or not
as this one does (the step that turns drafting on pays for passes whose drafts the next
step verifies; the one that turns it off verifies drafts it did not pay for).

A bucket first measures both kinds for HOLD steps each (drafting first); afterwards
it runs the kind with the higher rate and, every EXPLORE_EVERY steps, holds the other
kind for HOLD steps so its rate stays current: the gate never goes on believing an old
measurement, and a workload that starts to accept drafts (or stops) is noticed within
some EXPLORE_EVERY steps. The incumbent is replaced only when the other kind measures
SWITCH_MARGIN better, so noise does not make it flap. What exploring costs when drafting
does not pay: HOLD steps in EXPLORE_EVERY at the slower rate.

Whether a step drafts depends on batch sizes and timings only, never on any draft, so
the gate cannot bias the output (speculative/confidence.py says why that matters).
While drafting is off the decoding requests' MTP latent cache gets no entries for the
positions they decode; drafts proposed after the gate turns it back on attend over
those slots as they are (lossless still, acceptance lower on those requests), as with
adaptive k = 0.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from xllm_py.speculative.adaptive import batch_bucket

HOLD = 4  # steps a trial holds one kind: a transition, then HOLD - 1 steady samples
EXPLORE_EVERY = 96  # bucket steps between trials of the kind not running
WINDOW = 12  # steady steps kept per kind and bucket
SWITCH_MARGIN = 0.03  # the other kind must measure this much faster to take over


@dataclass
class _Samples:
    """Steady steps of one kind in one bucket: yields (tokens per request) and costs
    (seconds per request), the latest last."""

    yields: list[float] = field(default_factory=list)
    costs: list[float] = field(default_factory=list)

    def add(self, tokens: float, seconds: float) -> None:
        self.yields.append(tokens)
        self.costs.append(seconds)
        del self.yields[:-WINDOW], self.costs[:-WINDOW]

    @staticmethod
    def both() -> dict[bool, _Samples]:
        """Drafting (True) and plain (False) steps."""
        return {True: _Samples(), False: _Samples()}

    @property
    def rate(self) -> float:
        """Tokens per second per request: mean yield over median cost."""
        return statistics.fmean(self.yields) / max(statistics.median(self.costs), 1e-9)


@dataclass
class _Bucket:
    kinds: dict[bool, _Samples] = field(default_factory=lambda: _Samples.both())
    steps: int = 0  # steps chosen in this bucket
    trial: tuple[bool, int] | None = None  # (kind, steps left)
    incumbent: bool | None = None  # the kind this bucket runs between trials


class DraftGate:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self.steps = {True: 0, False: 0}  # steps chosen with drafting on and off

    def drafting(self, requests: int) -> bool:
        """Whether the next step, with `requests` requests running, drafts."""
        if requests == 0:
            return True
        bucket = self.buckets.setdefault(batch_bucket(requests), _Bucket())
        bucket.steps += 1
        kind = self._next(bucket)
        self.steps[kind] += 1
        return kind

    def _next(self, bucket: _Bucket) -> bool:
        if bucket.trial is not None:
            kind, left = bucket.trial
            bucket.trial = (kind, left - 1) if left > 1 else None
            return kind
        for kind in (True, False):
            if len(bucket.kinds[kind].costs) < HOLD - 1:
                return self._start_trial(bucket, kind)
        best = self.best(bucket)
        if bucket.steps % EXPLORE_EVERY == 0:
            return self._start_trial(bucket, not best)
        return best

    @staticmethod
    def _start_trial(bucket: _Bucket, kind: bool) -> bool:
        bucket.trial = (kind, HOLD - 1)
        return kind

    @staticmethod
    def best(bucket: _Bucket) -> bool:
        """The kind with the higher measured rate (the incumbent unless beaten by a margin)."""
        on, off = bucket.kinds[True].rate, bucket.kinds[False].rate
        faster = on >= off
        if bucket.incumbent is None or bucket.incumbent == faster:
            bucket.incumbent = faster
        elif max(on, off) > min(on, off) * (1 + SWITCH_MARGIN):
            bucket.incumbent = faster
        return bucket.incumbent

    def observe(self, requests: int, drafting: bool, tokens: float, seconds: float) -> None:
        """A steady decode step of `requests` requests, expected to emit `tokens` tokens."""
        bucket = self.buckets.setdefault(batch_bucket(requests), _Bucket())
        bucket.kinds[drafting].add(tokens / requests, seconds / requests)
