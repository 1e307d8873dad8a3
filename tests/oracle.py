"""An oracle draft, for benchmarks and tests: it proposes the next k tokens of a known
greedy continuation, so every draft is accepted (acceptance 1.0, k + 1 tokens per target
pass) whatever the model's weights.

Install it in place of the runner's proposer (the in-process worker's
`ModelRunner.proposer`). `reference` maps each prompt (a tuple of its token ids) to the
prompt followed by its greedy continuation from plain decoding. With `inner` (the real
`MTPProposer`), the MTP draft still runs every step, for its cost and its cache writes,
and its tokens are dropped: the step then costs what an MTP step costs when every draft
is right (perf/gpu_report.py). Without it, drafting costs nothing but a lookup.
"""

from __future__ import annotations


class OracleProposer:
    """Proposes the next k tokens of the known greedy continuation: always accepted."""

    def __init__(self, runner, reference: dict[tuple, list[int]], k: int, inner=None) -> None:
        self.runner, self.reference, self.k, self.inner = runner, reference, k, inner

    def propose(self, items, hidden, k: int | None = None):
        """Like MTPProposer.propose: k (adaptive speculation) caps the drafts."""
        if self.inner is not None:
            self.inner.propose(items, hidden, k)  # paid for; its drafts are replaced below
        k = self.k if k is None else min(k, self.k)
        out = []
        for it in items:
            req = self.runner.requests[it.req_id]
            full = self.reference[tuple(req.token_ids[: req.num_prompt_tokens])]
            n = it.start + len(it.rows) + 1  # verified tokens + the one just sampled
            out.append(full[n : n + k] if it.wants_drafts else [])
        return out
