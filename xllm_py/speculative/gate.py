"""The draft gate of --speculative_confidence=auto: whether a step drafts at all.

A step that drafts runs the MTP passes for every decoding request and verifies the
drafts the step before proposed (as many as speculative/confidence.py's plan keeps); a
step that does not is a plain decoding step: the MTP passes are skipped, so the next step
has nothing to verify. Which one emits more tokens per second depends on the model (on
a small model an MTP pass, with its full-vocabulary head, costs a large share of a target
step; on DeepSeek-V3 about a sixtieth), the device, the batch size and the text, so the
gate measures both, as a user would: tokens emitted per second.

The gate decides for a PERIOD of steps at a time, not step by step: a decision per step
follows the batch size from one step to the next (a request finishing, the next one
admitted) and pays a switch each time, which no step measures. A period's sample is

    rate     tokens the period's steady decode steps emitted (accepted drafts plus one
             per request) / their seconds (start to next start: the passes and the
             engine's own work around them, as speculative/adaptive.py times steps),
             divided by their mean batch size: tokens per second per request

Steady decode steps: no prompt chunk in the step (its cost is the prompt's), and the step
before drafted or not as this one does (the step that turns drafting on pays for passes
whose drafts the next step verifies; the one that turns it off verifies drafts it did not
pay for). A period with fewer than PERIOD / 2 of them (prompts arriving) is not counted.

Samples are kept per batch-size bucket (speculative/adaptive.py's: 1, 2, 3-4, 5-8, ...),
the last KEEP of each kind; a bucket's rate of a kind is their median (a collector pause
or another process moves one sample, not the decision). A period's bucket is the batch
size at its start. Each bucket first measures each kind for MEASURE periods (drafting
first), then runs the kind with the higher rate: drafting must beat plain decoding by
MARGIN to take over, and keeps the bucket while it is not slower, so MTP is never chosen
on a measurement that cannot tell it from plain. Every EXPLORE_EVERY periods of a bucket
(up to 8 times that, the more the kinds' rates differ) the other kind runs one period,
so its rate stays current; a trial that measures faster than the incumbent is run again
at once, so two fresh samples of three decide, not the stale ones: a workload that starts
to accept drafts (or stops) is noticed within some hundreds of steps. What exploring
costs when drafting does not pay: one period in EXPLORE_EVERY x (1 + gap in tenths), at
a rate lower by that gap (at a gap of 20%: one period in 24, about 0.8% of the tokens).

Whether a step drafts depends on batch sizes, timings and the tokens earlier steps
emitted, never on a draft the step verifies, so the gate cannot bias the output
(speculative/confidence.py says why that matters). While drafting is off the decoding
requests' MTP latent cache gets no entries for the positions they decode; drafts
proposed after the gate turns it back on attend over those slots as they are (lossless
still, acceptance lower on those requests), as with adaptive k = 0. Prompt chunks always
run the MTP layer, so a request admitted while drafting is off drafts well once it is on.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from xllm_py.speculative.adaptive import batch_bucket

logger = logging.getLogger(__name__)

PERIOD = 16  # steps one decision holds
MEASURE = 3  # periods of each kind a bucket measures before it compares them
KEEP = 3  # rate samples kept per bucket and kind
EXPLORE_EVERY = 8  # bucket periods between trials of the kind not running
MARGIN = 0.03  # drafting must measure this much faster than plain decoding to take over


@dataclass
class _Period:
    drafting: bool
    bucket: int
    left: int = PERIOD
    steps: int = 0  # steady decode steps measured
    requests: int = 0  # their batch sizes, summed
    tokens: float = 0.0
    seconds: float = 0.0


@dataclass
class _Bucket:
    rates: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    periods: int = 0  # periods started in this bucket
    incumbent: bool | None = None  # the kind this bucket runs between trials
    confirm: bool = False  # the last trial measured faster than the incumbent: run another


class DraftGate:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self.period: _Period | None = None
        self.steps = {True: 0, False: 0}  # steps chosen with drafting on and off

    def drafting(self, requests: int) -> bool:
        """Whether the next step, with `requests` requests running, drafts."""
        if requests == 0:
            return True
        if self.period is None or self.period.left == 0:
            self._close()
            self.period = self._open(requests)
        self.period.left -= 1
        self.steps[self.period.drafting] += 1
        return self.period.drafting

    def observe(self, requests: int, drafting: bool, tokens: float, seconds: float) -> None:
        """A steady decode step of `requests` requests that emitted `tokens` tokens."""
        p = self.period
        if p is None or drafting != p.drafting:
            return
        p.steps += 1
        p.requests += requests
        p.tokens += tokens
        p.seconds += seconds

    def rates(self, bucket: _Bucket) -> tuple[float, float] | None:
        """Tokens per second per request (drafting, plain), once both are measured."""
        on, off = bucket.rates[True], bucket.rates[False]
        if len(on) < MEASURE or len(off) < MEASURE:
            return None
        return statistics.median(on), statistics.median(off)

    # ---- periods --------------------------------------------------------------------------

    def _open(self, requests: int) -> _Period:
        key = batch_bucket(requests)
        bucket = self.buckets.setdefault(key, _Bucket())
        bucket.periods += 1
        rates = self.rates(bucket)
        if rates is None:  # each kind measured first, drafting first
            return _Period(len(bucket.rates[True]) < MEASURE, key)
        best = self._best(bucket, rates, requests)
        explore = bucket.confirm or bucket.periods % self._explore_every(rates) == 0
        bucket.confirm = False
        return _Period(best != explore, key)

    def _close(self) -> None:
        p = self.period
        if p is None or p.steps < PERIOD // 2 or p.seconds <= 0.0:
            return
        bucket = self.buckets[p.bucket]
        rate = p.tokens / p.seconds / (p.requests / p.steps)
        rates = self.rates(bucket)
        if rates is not None and bucket.incumbent is not None and p.drafting != bucket.incumbent:
            on, off = rates  # a trial: faster than the incumbent? then confirm it at once
            bucket.confirm = rate > off * (1.0 + MARGIN) if p.drafting else rate > on
        samples = bucket.rates[p.drafting]
        samples.append(rate)
        del samples[:-KEEP]

    @staticmethod
    def _explore_every(rates: tuple[float, float]) -> int:
        """EXPLORE_EVERY periods, times 1 + the measured gap between the kinds in tenths: a
        kind 30% slower is re-measured every 4 x EXPLORE_EVERY periods, since a trial of it
        costs in proportion to the gap and is less likely to change the decision."""
        gap = abs(rates[0] / max(rates[1], 1e-12) - 1.0)
        return EXPLORE_EVERY * (1 + min(int(gap * 10), 7))

    @staticmethod
    def _best(bucket: _Bucket, rates: tuple[float, float], requests: int) -> bool:
        """Drafting if it measures MARGIN faster, or is the incumbent and not slower."""
        on, off = rates
        drafting = on >= off * (1.0 if bucket.incumbent else 1.0 + MARGIN)
        if drafting != bucket.incumbent:
            logger.info(
                "speculative gate, batch %d: drafting %s (%.1f tok/s with drafts, %.1f "
                "without, as measured)",
                requests,
                "on" if drafting else "off",
                on * requests,
                off * requests,
            )
        bucket.incumbent = drafting
        return drafting
