"""The draft gate of --speculative_confidence=auto: whether a step drafts at all.

A step that drafts runs the MTP passes for every decoding request and verifies the
drafts the step before proposed (as many as speculative/confidence.py's plan keeps); a
step that does not is a plain decoding step: the MTP passes are skipped, so the next step
has nothing to verify. Which one emits more tokens per second depends on the model (on
a small model an MTP pass costs a large share of a target step, and verifying 1 + k rows
per request costs more than decoding one; on DeepSeek-V3 an MTP pass is about a
sixtieth), the device, the batch size and the text, so the gate measures both, as a user
would: tokens emitted per second.

The gate decides for a PERIOD of steps at a time, not step by step: a decision per step
follows the batch size from one step to the next (a request finishing, the next one
admitted) and pays a switch each time, which no step measures. (A period ends early only
when, a quarter of it gone, the batch has moved to a bucket that has decided on the other
kind: the ramp at the end of a wave of requests must not run the rest of a period chosen
for the batch size before it.) A period's sample, per batch size it ran at, is

    rate     tokens its steady decode steps of that size emitted (accepted drafts plus
             one per request) / their seconds (start to next start: the passes and the
             engine's own work around them, as speculative/adaptive.py times steps)

Steady decode steps: no prompt chunk in the step (its cost is the prompt's), and the step
before drafted or not as this one does (the step that turns drafting on pays for passes
whose drafts the next step verifies; the one that turns it off verifies drafts it did not
pay for).

Drafting also costs outside those steps: a step that drafts runs the MTP layer over the
prompt chunks it carries (so that their requests' drafts attend over the prompt), and one
that does not skips them. On a small model that pass is a large share of a prompt's cost
(the bundled 4-layer models: about a quarter; DeepSeek-V3: a sixty-first), enough to
turn decode steps that measure a few percent faster into fewer tokens per second end to
end. So the gate keeps the seconds those passes took per token emitted, over the steps
that drafted (decayed by PROMPT_DECAY a step), and a drafting period's rate is charged
that much per token it emitted:

    drafting rate   tokens / (seconds + tokens x prompt pass seconds per token)

The two kinds are compared in PAIRS of adjacent periods at the SAME BATCH SIZE, not as
two averages. The machine a daemon shares (other processes, the clock, the host's other
tenants) moves a period's rate by 10-30% over minutes, several times the gap being
measured; and within one bucket (speculative/adaptive.py's: 1, 2, 3-4, 5-8, ...) the
batch size itself moves the rate (on a small model on CPU a step of 3 requests costs
about what a step of 4 does, so per request it is a third faster). So a period keeps
its steps' tokens and seconds per batch size, and each batch size it ran for at least
PERIOD / 2 steps is compared with the last period of the other kind that did too, if
that one is at most ADJACENT periods back and no period of its own kind came between
(so a period makes at most two pairs, with its neighbours of the other kind):

    ratio   drafting's tokens per second / plain decoding's, at that batch size

A ratio belongs to that batch size's bucket, whichever bucket opened the period; a
bucket keeps its last KEEP ratios and their median decides. A bucket first alternates
the kinds, drafting first, until it has MEASURE ratios, then runs the kind the median
favours: drafting must measure MARGIN faster than plain decoding to take over, and keeps
the bucket while it is not slower, so MTP is never chosen on a measurement that cannot
tell it from plain. A bucket the batch only passes through (the ramp at the end of a wave
of requests: a few steps at each size) may never measure a pair; one that has opened
BORROW_AFTER periods without its MEASURE ratios runs on the median of the nearest bucket
that has them (the smaller batch on a tie), trials included, until its own ratios are in.
(Alternating there for good, it drafted half of every ramp on the bundled tiny model,
where drafting runs at 0.7x.)

Now and then the other kind runs one period of the bucket as a trial, which gives two
ratios (with the incumbent periods before and after it). One trial cannot change the
decision, since a lucky period is common on a shared machine: when both its ratios
disagree with the decision, a second trial runs at once, and if it agrees the two
together (a majority of the KEEP ratios) change it, so noise must fool two trials in a
row. Trials are spaced by what they cost: a period of the slower kind takes max(ratio,
1/ratio) - 1 of a period more than the incumbent would have, so a trial comes every that /
EXPLORE_COST periods of the bucket (at least EXPLORE_EVERY, at most EXPLORE_MOST), and
exploring costs about EXPLORE_COST of the time whatever the gap: at a median of 0.9 a trial
every 12 periods, at 0.8 every 25, at 0.7 every 43, below 0.61 every 64. (Spaced by the gap
in tenths alone, as the gate first did, trials came every 24 periods at 0.7: 1.7% of the
time. Spaced wider still, at half this cost, a wrong decision that noise made early lasts
longer: on a machine whose speed moves 12% from period to period, drafting 8% slower kept
the bucket for a hundred periods and cost 3%.) So a workload that starts to accept drafts
(or stops) is noticed within about 1,000 steps (2,000 when a second trial is due) where
the gap was wide, sooner where it was narrow. The ratio a trial measures is the one that
prices it: drafting's trials run on requests whose MTP cache has gaps (below) and include
the step that switches, so they measure a little below drafting's steady rate and space
themselves a little wider.

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
import math
import statistics
from dataclasses import dataclass, field

from xllm_py.speculative.adaptive import batch_bucket

logger = logging.getLogger(__name__)

PERIOD = 16  # steps one decision holds
MEASURE = 3  # ratios a bucket measures (alternating the kinds) before it decides
KEEP = 5  # ratios kept per bucket
ADJACENT = 2  # a pair's periods are at most this many periods apart (of any bucket)
EXPLORE_EVERY = 8  # fewest bucket periods between trials of the kind not running
EXPLORE_MOST = 64  # most bucket periods between trials
EXPLORE_COST = 0.01  # the share of a bucket's time its trials may cost
BORROW_AFTER = 4  # periods a bucket alternates without its MEASURE ratios, at most
MARGIN = 0.03  # drafting must measure this much faster than plain decoding to take over
PROMPT_DECAY = 0.999  # per drafting step, of the prompt passes' seconds and tokens kept


@dataclass
class _Period:
    drafting: bool
    bucket: int  # the batch bucket that chose its kind
    left: int = PERIOD
    index: int = 0  # the gate's period count when this one opened
    # batch size: [steady decode steps, tokens they emitted, their seconds]
    sizes: dict[int, list[float]] = field(default_factory=dict)


@dataclass
class _Bucket:
    ratios: list[float] = field(default_factory=list)  # drafting / plain, adjacent pairs
    incumbent: bool | None = None  # the kind this bucket runs between trials
    last_kind: bool | None = None  # the kind of the last period it opened (while measuring)
    measuring: int = 0  # periods it opened without MEASURE ratios of its own
    until_trial: int = 0  # periods of this bucket to its next trial


class DraftGate:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self.period: _Period | None = None
        self.opened = 0  # periods opened so far, of every bucket
        self.steps = {True: 0, False: 0}  # steps chosen with drafting on and off
        # (batch size, kind): (the period, its rate) of the last period measured at that size
        self.last: dict[tuple[int, bool], tuple[int, float]] = {}
        # decayed sums over the steps that drafted: MTP prompt-pass seconds, tokens emitted
        self.prompt_seconds = 0.0
        self.prompt_tokens = 0.0

    def drafting(self, requests: int) -> bool:
        """Whether the next step, with `requests` requests running, drafts."""
        if requests == 0:
            return True
        if self.period is None or self.period.left == 0 or self._moved(requests):
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
        size = p.sizes.setdefault(requests, [0, 0.0, 0.0])
        size[0] += 1
        size[1] += tokens
        size[2] += seconds

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
        ratio = self.ratio(bucket)
        if ratio is None:
            bucket.measuring += 1
            if bucket.measuring > BORROW_AFTER:
                ratio = self._borrowed(key)
        if ratio is None:  # alternate the kinds, drafting first
            bucket.last_kind = not bucket.last_kind if bucket.last_kind is not None else True
            return _Period(bucket.last_kind, key, index=self.opened)
        best = self._best(bucket, ratio, requests)
        bucket.until_trial -= 1
        trial = bucket.until_trial <= 0
        if trial:
            bucket.until_trial = self._explore_every(ratio)
        return _Period(best != trial, key, index=self.opened)

    def _borrowed(self, key: int) -> float | None:
        """The median ratio of the nearest bucket to `key` that has MEASURE ratios (the
        smaller batch on a tie), None while none has."""
        ratios = [(abs(k - key), k, self.ratio(b)) for k, b in self.buckets.items()]
        measured = [m for m in ratios if m[2] is not None]
        return min(measured)[2] if measured else None

    def _moved(self, requests: int) -> bool:
        """Whether the batch has moved, after at least a quarter of the period, to a bucket
        that has decided on the other kind (requests finishing at the end of a wave, new
        ones admitted): that bucket's decision takes over at once, rather than the rest
        of a period chosen for another batch size."""
        p = self.period
        key = batch_bucket(requests)
        if p.bucket == key or PERIOD - p.left < PERIOD // 4:
            return False
        bucket = self.buckets.get(key)
        decided = bucket.incumbent if bucket is not None else None
        return decided is not None and decided != p.drafting

    def _close(self) -> None:
        p = self.period
        if p is None:
            return
        cost = self.prompt_cost() if p.drafting else 0.0
        for size, (steps, tokens, seconds) in p.sizes.items():
            if steps < PERIOD // 2 or seconds <= 0.0:
                continue
            rate = tokens / (seconds + tokens * cost)
            other = self.last.get((size, not p.drafting))
            mine = self.last.get((size, p.drafting), (0, 0.0))
            if other is not None and mine[0] < other[0] and p.index - other[0] <= ADJACENT:
                on, off = (rate, other[1]) if p.drafting else (other[1], rate)
                self._add(self.buckets.setdefault(batch_bucket(size), _Bucket()), on / off)
            self.last[(size, p.drafting)] = (p.index, rate)

    def _add(self, bucket: _Bucket, ratio: float) -> None:
        """A pair's ratio. When the last two disagree with the bucket's decision (a trial
        and both its neighbours), the next period of the bucket is a second trial."""
        bucket.ratios.append(ratio)
        del bucket.ratios[:-KEEP]
        if bucket.incumbent is None or len(bucket.ratios) < 2:
            return
        if all(self._favours(bucket, r) != bucket.incumbent for r in bucket.ratios[-2:]):
            bucket.until_trial = 1

    @staticmethod
    def _explore_every(ratio: float) -> int:
        """Bucket periods to the next trial: a trial of the slower kind costs max(ratio,
        1/ratio) - 1 of a period, spaced so that trials cost about EXPLORE_COST."""
        cost = max(ratio, 1.0 / max(ratio, 1e-3)) - 1.0
        return min(max(math.ceil(cost / EXPLORE_COST), EXPLORE_EVERY), EXPLORE_MOST)

    @staticmethod
    def _favours(bucket: _Bucket, ratio: float) -> bool:
        """Whether `ratio` favours drafting: MARGIN faster, or not slower if it runs now."""
        return ratio >= (1.0 if bucket.incumbent else 1.0 + MARGIN)

    def _best(self, bucket: _Bucket, ratio: float, requests: int) -> bool:
        """The kind the median ratio (the bucket's own, or one it borrowed) favours; the
        bucket's trials start counting when it first decides."""
        drafting = self._favours(bucket, ratio)
        if bucket.incumbent is None:
            bucket.until_trial = self._explore_every(ratio)
        if drafting != bucket.incumbent:
            why = (
                f"the median of the last {len(bucket.ratios)} adjacent pairs of periods"
                if len(bucket.ratios) >= MEASURE
                else "the nearest measured batch size's, this one having measured too few pairs"
            )
            logger.info(
                "speculative gate, batch %d: drafting %s (%.2fx plain decoding's tokens per "
                "second, %s)",
                requests,
                "on" if drafting else "off",
                ratio,
                why,
            )
        bucket.incumbent = drafting
        return drafting
