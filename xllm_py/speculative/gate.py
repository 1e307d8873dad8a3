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

Drafting also costs outside those steps: a step that drafts runs the MTP layer over the
prompt chunks it carries (so that their requests' drafts attend over the prompt), and one
that does not skips them. On a small model that pass is a large share of a prompt's cost
(the bundled 4-layer models: about a quarter; DeepSeek-V3: a sixty-first), enough to
turn decode steps that measure a few percent faster into fewer tokens per second end to
end. So the gate keeps the seconds those passes took per token emitted, over the steps
that drafted (decayed by PROMPT_DECAY a step), and a drafting period's rate is charged
that much per token it emitted:

    drafting rate   tokens / (seconds + tokens x prompt pass seconds per token) / batch

The two kinds are compared in PAIRS of adjacent periods, not as two averages: the machine
a daemon shares (other processes, the clock, the host's other tenants) moves a period's
rate by 10-30% over minutes, several times the gap being measured, so a drafting period
is only compared with the plain period just before or just after it in the same batch
bucket (speculative/adaptive.py's buckets: 1, 2, 3-4, 5-8, ...), whatever the load was
then. Each pair gives a ratio, drafting rate / plain rate; a bucket keeps its last KEEP
ratios, and their median decides. A bucket first alternates the kinds, drafting first,
until it has MEASURE ratios, then runs the kind the median favours: drafting must measure
MARGIN faster than plain decoding to take over, and keeps the bucket while it is not
slower, so MTP is never chosen on a measurement that cannot tell it from plain. Every
EXPLORE_EVERY periods of a bucket (up to 8 times that, the further the median ratio is
from 1) the other kind runs one period as a trial; with the incumbent periods on either
side of it, a trial gives two ratios, a majority of KEEP, so one trial that agrees with
both of its neighbours changes the decision: a workload that starts to accept drafts (or
stops) is noticed within some hundreds of steps. What exploring costs when drafting does
not pay: one period in EXPLORE_EVERY x (1 + gap in tenths), at a rate lower by that gap
(at a gap of 20%: one period in 24, about 0.8% of the tokens).

Whether a step drafts depends on batch sizes, timings and the tokens earlier steps
emitted, never on a draft the step verifies, so the gate cannot bias the output
(speculative/confidence.py says why that matters). While drafting is off the requests'
MTP latent cache gets no entries for the positions they decode or prefill; drafts
proposed after the gate turns it back on attend over those slots as they are (lossless
still, acceptance lower on those requests), as with adaptive k = 0. A request admitted
during a plain trial in a bucket that drafts therefore drafts worse for its life, which
makes drafting measure a little slower: the gate errs towards plain decoding.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from xllm_py.speculative.adaptive import batch_bucket

logger = logging.getLogger(__name__)

PERIOD = 16  # steps one decision holds
MEASURE = 3  # ratios a bucket measures (alternating the kinds) before it decides
KEEP = 3  # ratios kept per bucket
ADJACENT = 2  # a pair's periods are at most this many periods apart (of any bucket)
EXPLORE_EVERY = 8  # bucket periods between trials of the kind not running
MARGIN = 0.03  # drafting must measure this much faster than plain decoding to take over
PROMPT_DECAY = 0.999  # per drafting step, of the prompt passes' seconds and tokens kept


@dataclass
class _Period:
    drafting: bool
    bucket: int
    left: int = PERIOD
    steps: int = 0  # steady decode steps measured
    requests: int = 0  # their batch sizes, summed
    tokens: float = 0.0
    seconds: float = 0.0
    index: int = 0  # the gate's period count when this one opened


@dataclass
class _Bucket:
    last: dict[bool, tuple[int, float]] = field(default_factory=dict)  # kind: (period, rate)
    ratios: list[float] = field(default_factory=list)  # drafting / plain, adjacent pairs
    periods: int = 0  # periods started in this bucket
    incumbent: bool | None = None  # the kind this bucket runs between trials


class DraftGate:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self.period: _Period | None = None
        self.opened = 0  # periods opened so far, of every bucket
        self.steps = {True: 0, False: 0}  # steps chosen with drafting on and off
        # decayed sums over the steps that drafted: MTP prompt-pass seconds, tokens emitted
        self.prompt_seconds = 0.0
        self.prompt_tokens = 0.0

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

    def charge(self, tokens: float, seconds: float) -> None:
        """A step that drafted: the tokens it emitted and its MTP prompt passes' seconds."""
        self.prompt_seconds = self.prompt_seconds * PROMPT_DECAY + seconds
        self.prompt_tokens = self.prompt_tokens * PROMPT_DECAY + tokens

    def prompt_cost(self) -> float:
        """Seconds of MTP prompt passes per token emitted while drafting (0 before any)."""
        return self.prompt_seconds / self.prompt_tokens if self.prompt_tokens > 0 else 0.0

    @staticmethod
    def ratio(bucket: _Bucket) -> float | None:
        """Drafting's rate over plain decoding's (the median pair), once MEASURE are in."""
        if len(bucket.ratios) < MEASURE:
            return None
        return statistics.median(bucket.ratios)

    # ---- periods --------------------------------------------------------------------------

    def _open(self, requests: int) -> _Period:
        self.opened += 1
        key = batch_bucket(requests)
        bucket = self.buckets.setdefault(key, _Bucket())
        bucket.periods += 1
        ratio = self.ratio(bucket)
        if ratio is None:  # alternate the kinds, drafting first
            measured = max(bucket.last, key=lambda kind: bucket.last[kind][0], default=False)
            return _Period(not measured, key, index=self.opened)
        best = self._best(bucket, ratio, requests)
        explore = bucket.periods % self._explore_every(ratio) == 0
        return _Period(best != explore, key, index=self.opened)

    def _close(self) -> None:
        p = self.period
        if p is None or p.steps < PERIOD // 2 or p.seconds <= 0.0:
            return
        bucket = self.buckets[p.bucket]
        seconds = p.seconds + (p.tokens * self.prompt_cost() if p.drafting else 0.0)
        rate = p.tokens / seconds / (p.requests / p.steps)
        other = bucket.last.get(not p.drafting)
        if other is not None and p.index - other[0] <= ADJACENT:
            on, off = (rate, other[1]) if p.drafting else (other[1], rate)
            bucket.ratios.append(on / max(off, 1e-12))
            del bucket.ratios[:-KEEP]
        bucket.last[p.drafting] = (p.index, rate)

    @staticmethod
    def _explore_every(ratio: float) -> int:
        """EXPLORE_EVERY periods, times 1 + the measured gap between the kinds in tenths: a
        kind 30% slower is re-measured every 4 x EXPLORE_EVERY periods, since a trial of it
        costs in proportion to the gap and is less likely to change the decision."""
        return EXPLORE_EVERY * (1 + min(int(abs(ratio - 1.0) * 10), 7))

    @staticmethod
    def _best(bucket: _Bucket, ratio: float, requests: int) -> bool:
        """Drafting if it measures MARGIN faster, or is the incumbent and not slower."""
        drafting = ratio >= (1.0 if bucket.incumbent else 1.0 + MARGIN)
        if drafting != bucket.incumbent:
            logger.info(
                "speculative gate, batch %d: drafting %s (%.2fx plain decoding's tokens per "
                "second, the median of the last %d adjacent pairs of periods)",
                requests,
                "on" if drafting else "off",
                ratio,
                len(bucket.ratios),
            )
        bucket.incumbent = drafting
        return drafting
