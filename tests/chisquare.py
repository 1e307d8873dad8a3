"""Chi-square tests for the sampling tests: counts against exact probabilities
(goodness of fit) and two samples against each other (homogeneity).

Bins whose expected count is below MIN_EXPECTED are pooled into one, so the chi-square
approximation holds; the p-value is the upper tail of the chi-square distribution,
gammaincc(df / 2, x / 2). Tests fix their seeds, so a verdict is reproducible; ALPHA is
small enough that correct code passes every test in a run (dozens of comparisons) with
high probability, and the broken variants these tests exist for fail by many orders.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

MIN_EXPECTED = 5.0
ALPHA = 1e-4


@dataclass
class Verdict:
    p_value: float
    statistic: float
    df: int
    total_variation: float  # between the two (empirical or exact) distributions

    def __str__(self) -> str:
        return (
            f"p={self.p_value:.2e} (chi2={self.statistic:.1f}, df={self.df}), "
            f"total variation {self.total_variation:.3f}"
        )


def _p_value(statistic: float, df: int) -> float:
    if df <= 0:
        return 1.0
    x = torch.tensor(statistic, dtype=torch.float64)
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), x / 2).item()


def goodness_of_fit(samples: list, probs: dict) -> Verdict:
    """Do `samples` (hashable outcomes) come from `probs` (outcome -> probability)?
    An outcome missing from `probs` has probability 0 and fails the test outright."""
    n = len(samples)
    counts = Counter(samples)
    impossible = [o for o in counts if probs.get(o, 0.0) <= 0.0]
    tv = 0.5 * sum(abs(counts.get(o, 0) / n - probs.get(o, 0.0)) for o in set(counts) | set(probs))
    if impossible:
        return Verdict(0.0, float("inf"), 0, tv)
    big = [o for o in probs if probs[o] * n >= MIN_EXPECTED]
    small = [o for o in probs if o not in big]
    observed = [counts.get(o, 0) for o in big] + [sum(counts.get(o, 0) for o in small)]
    expected = [probs[o] * n for o in big] + [sum(probs[o] for o in small) * n]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    df = sum(1 for e in expected if e > 0) - 1
    return Verdict(_p_value(stat, df), stat, df, tv)


def homogeneity(a: list, b: list) -> Verdict:
    """Do samples `a` and `b` come from the same distribution (2 x bins contingency test)?"""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    outcomes = set(ca) | set(cb)
    tv = 0.5 * sum(abs(ca.get(o, 0) / na - cb.get(o, 0) / nb) for o in outcomes)
    pooled = {o: (ca.get(o, 0) + cb.get(o, 0)) / (na + nb) for o in outcomes}
    big = [o for o in outcomes if pooled[o] * min(na, nb) >= MIN_EXPECTED]
    small = [o for o in outcomes if o not in big]
    rows = []
    for c in (ca, cb):
        rows.append([c.get(o, 0) for o in big] + [sum(c.get(o, 0) for o in small)])
    cols = [x + y for x, y in zip(*rows)]
    stat, df = 0.0, -1
    for j, col in enumerate(cols):
        if col == 0:
            continue
        df += 1
        for row, n in zip(rows, (na, nb)):
            e = n * col / (na + nb)
            stat += (row[j] - e) ** 2 / e
    return Verdict(_p_value(stat, df), stat, df, tv)
