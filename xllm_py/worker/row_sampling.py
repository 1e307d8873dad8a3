"""The sampling parameters of a step's rows, as tensors: the model runner's verification
rows and the draft sampler's draft rows are built the same way, so a draft is drawn from
the distribution its verification row samples (worker/draft_sampler.py)."""

from __future__ import annotations

import torch

from xllm_py.worker.runner_request import RunnerRequest
from xllm_py.worker.sampler import LogitAdjust, SamplingBatch, token_seed

Row = tuple[RunnerRequest, int]  # a request and j: the row samples its output num_outputs + j


class RowSampling:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device

    def adjust(
        self, rows: list[tuple[RunnerRequest, int]], drafts_before: list[list[int]]
    ) -> LogitAdjust | None:
        """Bias and penalties of the rows whose requests have any. Row (request, j) is
        judged after the request's outputs so far and its drafts d_1..d_j: the tokens
        plain decoding would have produced before that position if they are accepted."""
        picked = [row for row, (r, _) in enumerate(rows) if r.sampling.adjusts_logits]
        if not picked:
            return None
        dev, vocab = self.device, self.vocab_size
        counts = torch.zeros(len(picked), vocab, device=dev)
        seen = torch.zeros(len(picked), vocab, dtype=torch.bool, device=dev)
        bias = None
        for a, row in enumerate(picked):
            r = rows[row][0]
            outputs = r.token_ids[r.num_prompt_tokens :] + drafts_before[row]
            if outputs:
                counts[a] = torch.bincount(
                    torch.tensor(outputs, device=dev), minlength=vocab
                ).float()
            seen[a, torch.tensor(r.token_ids[: r.num_prompt_tokens], device=dev)] = True
            if r.sampling.logit_bias:
                bias = torch.zeros(len(picked), vocab, device=dev) if bias is None else bias
                ids, vals = zip(*r.sampling.logit_bias.items())
                bias[a, list(ids)] = torch.tensor(vals, device=dev)
        params = [rows[row][0].sampling for row in picked]

        def column(name: str) -> torch.Tensor:
            return torch.tensor([[getattr(p, name)] for p in params], device=dev)

        return LogitAdjust(
            torch.tensor(picked, device=dev),
            counts,
            seen | (counts > 0),
            column("presence_penalty"),
            column("frequency_penalty"),
            column("repetition_penalty"),
            bias,
        )

    def batch(self, rows: list[tuple[RunnerRequest, int]]) -> SamplingBatch:
        """Per-row parameters; row (request, j) samples the request's output number
        num_outputs + j (j > 0 only on draft-verification rows)."""
        dev = self.device
        params = [r.sampling for r, _ in rows]
        all_greedy = all(p.greedy for p in params)
        wants = [p.logprobs for p in params if p.logprobs is not None]
        banned = []
        for row, (r, j) in enumerate(rows):
            if r.num_outputs + j < r.sampling.min_tokens:
                ids = (
                    [] if r.sampling.ignore_eos else self.eos_token_ids
                ) + r.sampling.stop_token_ids
                if ids:
                    banned.append((row, ids))
        batch = SamplingBatch.greedy_rows(banned, max(wants) if wants else None)
        if all_greedy:
            return batch
        batch.all_greedy = False
        batch.greedy = torch.tensor([p.greedy for p in params], device=dev)
        batch.some_greedy = any(p.greedy for p in params)
        batch.temperature = torch.tensor(
            [1.0 if p.greedy else p.temperature for p in params], device=dev
        )
        if any(p.top_k > 0 for p in params):
            batch.top_k = torch.tensor(
                [p.top_k if p.top_k > 0 else self.vocab_size for p in params], device=dev
            )
        if any(p.top_p < 1 for p in params):
            batch.top_p = torch.tensor([p.top_p for p in params], device=dev)
        if any(p.min_p > 0 for p in params):
            batch.min_p = torch.tensor([p.min_p for p in params], device=dev)
        batch.seeds = [
            (row, token_seed(r.sampling.seed, r.num_outputs + j))
            for row, (r, j) in enumerate(rows)
            if r.sampling.seed is not None and not r.sampling.greedy
        ]
        return batch
