"""A request's state as the scheduler sees it.

Phase-agnostic: a request is `num_tokens` long (prompt + outputs) of which
`num_computed_tokens` have their KV in the cache. Prefill, chunked prefill,
decode and recompute after preemption are all "schedule the difference".
"""

from __future__ import annotations

import enum

from xllm_py.executor.messages import TokenLogprobs
from xllm_py.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.eos_token_ids = () if sampling.ignore_eos else eos_token_ids
        limit = max_model_len if sampling.max_tokens is None else sampling.max_tokens
        self.max_output = min(limit, max_model_len - len(prompt_token_ids))
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_tokens_sent = 0  # tokens the worker already holds
        self.num_blocks_sent = 0  # block ids the worker already holds
        self.spec_token_ids: list[int] = []  # drafts proposed for the next step
        self.spec_scores: list[float] = []  # top probability of each draft's distribution
        # drafts verified for this request so far, and how many of them the target accepted
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks of all_token_ids
        # PD decode: the blocks moved for its prompt, held until it is admitted (pd/roles.py)
        self.prefix_hold = None
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # prompt tokens 1.. scored so far (prompt_logprobs), and the ranks of those tokens;
        # handed out with the request's first output
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            None if sampling.prompt_logprobs is None else []
        )
        self.prompt_ranks: list[int] = []

    @property
    def scoring_prompt(self) -> bool:
        """Prompt logprobs are still being collected: every prompt position must be
        computed (none may come from the prefix cache)."""
        return (
            self.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output(self, token_id: int) -> bool:
        """Add one generated token; return True (and set finish_reason) if it ends the request."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        n_out = len(self.output_token_ids)
        if n_out >= self.sampling.min_tokens:
            if token_id in self.eos_token_ids:
                self.finish_reason = "stop"
                return True
            if token_id in self.sampling.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token_id
                return True
        if n_out >= self.max_output:
            self.finish_reason = "length"
            return True
        return False
