"""The draft gate of --speculative_confidence=auto: whether a step drafts at all.

A step that drafts runs the MTP passes for every decoding request and verifies the
drafts the step before proposed (as many as speculative/confidence.py's plan keeps); a
step that does not is a plain decoding step: the MTP passes are skipped, so the next step
has nothing to verify. Which one emits more tokens per second depends on the model (on
the bundled small model an MTP pass costs a quarter of a target step, on DeepSeek-V3 a
sixtieth), the device, the batch size and the text, so the gate measures both kinds:

    cost     seconds of a step, start to next start (the passes and the engine's own work
             around them, as speculative/adaptive.py times its steps), fitted per kind as
             S(R) = a + b * R over the batch sizes R measured (least squares, decayed by
             FIT_DECAY per step of that kind): every batch size informs the others, and a
             step far above the fit (a collector pause, another thread) is clipped to
             CLIP times it before it counts
    yield    tokens a step was expected to emit per request: 1 without drafts; with them,
             1 plus the chances of its verified drafts (speculative/confidence.py's
             calibrated C_j: the mean of the tokens emitted, without the noise of each
             step's few acceptances), the mean of the last WINDOW drafting steps of the
             batch-size bucket (speculative/adaptive.py's buckets: 1, 2, 3-4, 5-8, ...),
             since the plan keeps fewer drafts under load
    rate     R * yield / S(R), per kind, at the step's batch size

Only steady decode steps count: no prompt chunk in the step, and the step before drafted
or not as this one does (the step that turns drafting on pays for passes whose drafts the
next step verifies; the one that turns it off verifies drafts it did not pay for).

Each bucket first holds each kind for HOLD steps (drafting first), then runs the kind
with the higher rate; drafting must beat plain decoding by MARGIN to take over, and keeps
the step while it is not slower, so MTP is never chosen on a measurement that cannot
tell it from plain. Every EXPLORE_EVERY steps of a bucket (up to 8 times that, the more
the kinds' rates differ) the other kind is held for HOLD steps, so its fit stays
current: a workload that starts to accept drafts (or stops) is noticed within some
hundreds of steps. What exploring costs when drafting does not pay: HOLD steps in
EXPLORE_EVERY x (1 + gap in tenths) at a rate lower by that gap.

Whether a step drafts depends on batch sizes and timings only, never on any draft, so
the gate cannot bias the output (speculative/confidence.py says why that matters).
While drafting is off the decoding requests' MTP latent cache gets no entries for the
positions they decode; drafts proposed after the gate turns it back on attend over
those slots as they are (lossless still, acceptance lower on those requests), as with
adaptive k = 0. Prompt chunks always run the MTP layer, so a request admitted while
drafting is off drafts well once it is on.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from xllm_py.speculative.adaptive import batch_bucket

logger = logging.getLogger(__name__)

HOLD = 4  # steps a trial holds one kind: a transition, then HOLD - 1 steady samples
EXPLORE_EVERY = 96  # bucket steps between trials of the kind not running
WINDOW = 12  # drafting yields kept per bucket
FIT_DECAY = 0.98  # the cost fits, per step of their kind: a window of about 50 steps
CLIP = 2.0  # a step over CLIP times its fitted cost counts as CLIP times it
MARGIN = 0.03  # drafting must measure this much faster than plain decoding to take over


class _CostFit:
    """S(R) = a + b * R for one kind of step, by decayed least squares."""

    def __init__(self) -> None:
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0.0

    def observe(self, requests: int, seconds: float) -> None:
        guess = self.predict(requests)
        if guess is not None:
            seconds = min(seconds, CLIP * guess)
        x = float(requests)
        self.n = self.n * FIT_DECAY + 1.0
        self.sx = self.sx * FIT_DECAY + x
        self.sxx = self.sxx * FIT_DECAY + x * x
        self.sy = self.sy * FIT_DECAY + seconds
        self.sxy = self.sxy * FIT_DECAY + x * seconds

    def predict(self, requests: int) -> float | None:
        """Seconds of a step of `requests` requests; None before HOLD - 1 steps. Batch
        sizes with no spread fit a flat cost per request (b = mean / R, a = 0)."""
        if self.n < HOLD - 1 - 1e-9:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        spread = self.sxx / self.n - mean_x * mean_x
        if spread < 0.25:  # (nearly) one batch size so far: cost in proportion to it
            return max(mean_y * requests / max(mean_x, 1.0), 1e-9)
        b = (self.sxy / self.n - mean_x * mean_y) / spread
        return max(mean_y + b * (requests - mean_x), 1e-9)


@dataclass
class _Bucket:
    samples: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    yields: list[float] = field(default_factory=list)  # drafting steps' yield per request
    steps: int = 0  # steps chosen in this bucket
    trial: tuple[bool, int] | None = None  # (kind, steps left)
    incumbent: bool | None = None  # the kind this bucket runs between trials


class DraftGate:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self.fits = {True: _CostFit(), False: _CostFit()}  # drafting, plain
        self.steps = {True: 0, False: 0}  # steps chosen with drafting on and off

    def drafting(self, requests: int) -> bool:
        """Whether the next step, with `requests` requests running, drafts."""
        if requests == 0:
            return True
        bucket = self.buckets.setdefault(batch_bucket(requests), _Bucket())
        bucket.steps += 1
        kind = self._next(bucket, requests)
        self.steps[kind] += 1
        return kind

    def _next(self, bucket: _Bucket, requests: int) -> bool:
        if bucket.trial is not None:
            kind, left = bucket.trial
            bucket.trial = (kind, left - 1) if left > 1 else None
            return kind
        for kind in (True, False):
            if bucket.samples[kind] < HOLD - 1:
                return self._start_trial(bucket, kind)
        best = self.best(bucket, requests)
        if bucket.steps % self._explore_every(bucket, requests) == 0:
            return self._start_trial(bucket, not best)
        return best

    def _explore_every(self, bucket: _Bucket, requests: int) -> int:
        """EXPLORE_EVERY steps, times 1 + the measured gap between the kinds in tenths: a
        kind 30% slower is re-measured every 4 x EXPLORE_EVERY steps, since a trial of it
        costs in proportion to the gap and is less likely to change the decision."""
        rates = self.rates(bucket, requests)
        if rates is None:
            return EXPLORE_EVERY
        gap = abs(rates[0] / max(rates[1], 1e-9) - 1.0)
        return EXPLORE_EVERY * (1 + min(int(gap * 10), 7))

    @staticmethod
    def _start_trial(bucket: _Bucket, kind: bool) -> bool:
        bucket.trial = (kind, HOLD - 1)
        return kind

    def rates(self, bucket: _Bucket, requests: int) -> tuple[float, float] | None:
        """Tokens per second at this batch size (drafting, plain), once both are measured."""
        on, off = self.fits[True].predict(requests), self.fits[False].predict(requests)
        if on is None or off is None or not bucket.yields:
            return None
        return requests * statistics.fmean(bucket.yields) / on, requests / off

    def best(self, bucket: _Bucket, requests: int) -> bool:
        """Drafting if it measures MARGIN faster, or is the incumbent and not slower."""
        rates = self.rates(bucket, requests)
        if rates is None:
            return bucket.incumbent is not False
        on, off = rates
        drafting = on >= off * (1.0 if bucket.incumbent else 1.0 + MARGIN)
        if drafting != bucket.incumbent:
            logger.info(
                "speculative gate, batch %d: drafting %s (%.1f tok/s with drafts, %.1f "
                "without, as measured)",
                requests,
                "on" if drafting else "off",
                on,
                off,
            )
        bucket.incumbent = drafting
        return drafting

    def observe(self, requests: int, drafting: bool, tokens: float, seconds: float) -> None:
        """A steady decode step of `requests` requests, expected to emit `tokens` tokens."""
        bucket = self.buckets.setdefault(batch_bucket(requests), _Bucket())
        bucket.samples[drafting] += 1
        self.fits[drafting].observe(requests, seconds)
        if drafting:
            bucket.yields.append(tokens / requests)
            del bucket.yields[:-WINDOW]
