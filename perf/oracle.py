"""An oracle draft, for benchmarks and tests: it proposes the next k tokens of a known
greedy continuation, so every draft is accepted (acceptance 1.0, k + 1 tokens per target
pass) whatever the model's weights.

Install it in place of the runner's proposer (the in-process worker's
`ModelRunner.proposer`), or with `install_oracle`. `reference` maps each prompt (a tuple
of its token ids) to the prompt followed by its greedy continuation from plain decoding.
With `inner` (the real `MTPProposer`), the MTP draft still runs every step, for its cost
and its cache writes, and its tokens are dropped: the step then costs what an MTP step
costs when every draft is right (perf/gpu_report.py). Without it, drafting costs nothing
but a lookup.
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
        return out, [[1.0] * len(d) for d in out]  # scores: the oracle is sure of each


def install_oracle(llm, reference: dict, k: int) -> list[int]:
    """The oracle draft in front of the real MTP proposer of an in-process `LLM`, and every
    emitted token pinned to the reference (the plain run's): the verification still runs at
    full cost, but a near-tie that rounds the other way in a (k + 1)-row pass (bfloat16; on
    a GPU the MoE sums by atomics) cannot put a request off the reference, after which the
    oracle could propose nothing right. Returns [tokens the verification chose itself,
    tokens emitted], counted as they go."""
    runner = llm.engine.core.executor.worker.runner
    runner.proposer = OracleProposer(runner, reference, k, inner=runner.proposer)
    sample, tally = runner._sample, [0, 0]

    def pinned(req_ids, sample_reqs, logits, spec, grammar=None):
        out = sample(req_ids, sample_reqs, logits, spec, grammar)
        for i, got in enumerate(out.sampled_token_ids):
            req = runner.requests[req_ids[i]]
            n, full = len(req.token_ids), reference[tuple(req.token_ids[: req.num_prompt_tokens])]
            want = (full[n : n + len(spec.get(req_ids[i], [])) + 1] or got) if got else got
            same = [a == b for a, b in zip(got, want)] + [False]
            tally[0] += same.index(False)  # the verification's own tokens, up to a difference
            tally[1] += len(want)
            out.sampled_token_ids[i] = want
        return out

    runner._sample = pinned
    return tally
