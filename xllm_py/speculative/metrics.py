"""Speculative-decoding counters, as data (engine/metrics.py exports them).

acceptance rate          = accepted_tokens / draft_tokens
mean acceptance length   = 1 + accepted_tokens / drafts   (tokens per target pass)
acceptance at position j = accepted_per_position[j] / drafts

Per request (Request.num_draft_tokens / num_accepted_tokens, counted by the scheduler):
when a request that had drafts verified finishes, its acceptance rate goes into a
histogram of bounded size (`acceptance_buckets`: counts of rates <= 0.0, 0.1, ..., 1.0,
each rate in the first bucket that holds it; `acceptance_sum`: the sum of the rates).

With adaptive speculation (speculative/adaptive.py) the snapshot also carries the k each
replica chose for its latest step and how many steps ran at each k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xllm_py.speculative.adaptive import AdaptiveSpeculation

# upper bounds of the per-request acceptance-rate histogram: 0.0, 0.1, ..., 1.0
ACCEPTANCE_BUCKETS = tuple(i / 10 for i in range(11))


@dataclass
class SpecDecodeStats:
    drafts: int = 0  # verification passes that carried drafts (one per request per step)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    adaptive_k: list[int] = field(default_factory=list)  # per replica: k of its latest step
    steps_by_k: list[int] = field(default_factory=list)  # adaptive steps run at k = 0, 1, ...
    # finished requests by acceptance rate (one count per ACCEPTANCE_BUCKETS bound, not
    # cumulative), and the sum of their rates
    acceptance_buckets: list[int] = field(default_factory=lambda: [0] * len(ACCEPTANCE_BUCKETS))
    acceptance_sum: float = 0.0
    # the confidence policy (speculative/confidence.py): drafts it left unverified, and
    # steps its gate ran without the MTP passes (speculative/gate.py)
    cut_draft_tokens: int = 0
    undrafted_steps: int = 0

    def record(self, drafts: list[int], accepted: int) -> None:
        if not drafts:
            return
        self.drafts += 1
        self.draft_tokens += len(drafts)
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < len(drafts):
            self.accepted_per_position += [0] * (len(drafts) - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def record_request(self, draft_tokens: int, accepted_tokens: int) -> None:
        """A finished request's acceptance rate, into the histogram (none without drafts)."""
        if draft_tokens <= 0:
            return
        # the first bound >= accepted / draft_tokens, in integers: ceil(10 * rate)
        self.acceptance_buckets[-(-10 * accepted_tokens // draft_tokens)] += 1
        self.acceptance_sum += accepted_tokens / draft_tokens

    def snapshot(self, adaptive: AdaptiveSpeculation | None = None) -> SpecDecodeStats:
        """A copy that later steps do not change (for before/after differences)."""
        return SpecDecodeStats(
            self.drafts,
            self.draft_tokens,
            self.accepted_tokens,
            list(self.accepted_per_position),
            [adaptive.k] if adaptive is not None else [],
            list(adaptive.steps_by_k) if adaptive is not None else [],
            list(self.acceptance_buckets),
            self.acceptance_sum,
            self.cut_draft_tokens,
            self.undrafted_steps,
        )

    @property
    def finished_requests(self) -> int:
        """Finished requests the histogram counted (those that had drafts verified)."""
        return sum(self.acceptance_buckets)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0
