"""What the model runner keeps of one request between steps (the scheduler's diffs applied)."""

from __future__ import annotations

from dataclasses import dataclass

from xllm_py.sampling_params import SamplingParams
from xllm_py.structured import Matcher


@dataclass
class RunnerRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    matcher: Matcher | None = None  # structured output: the grammar state after token_ids

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
