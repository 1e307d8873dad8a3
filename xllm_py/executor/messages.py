"""Typed messages across the executor boundary.

    engine core --SchedulerOutput--> Executor --> worker(s) --ModelRunnerOutput--> engine core

Workers cache each request's tokens and block table; a step carries only what
changed since the previous one: requests seen for the first time (or again,
after preemption), tokens appended, blocks added, and ids to forget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xllm_py.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt, plus outputs so far when resumed after preemption
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the cache (prefix-cache hits)


@dataclass
class CachedRequestData:
    req_id: str
    new_token_ids: list[int]  # tokens appended since the worker last saw this request
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> tokens this step
    # req_id -> draft tokens to verify this step; they are the last tokens of the request's
    # num_scheduled_tokens (after its last verified token), at positions past its length
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)  # finished, aborted or preempted
    # Drafts per request the workers propose after this step (adaptive speculation);
    # None = num_speculative_tokens. 0 also skips the MTP pass of decoding requests.
    num_draft_tokens: int | None = None


TokenLogprobs = dict[int, float]  # token id -> logprob; the chosen token first, then the top N


@dataclass
class PromptLogprobs:
    """Prompt logprobs of the positions a step computed: entry i is prompt token
    `start + i` given the tokens before it (its logprob first, then the top N), with the
    1-based rank of that token among all the vocabulary's logprobs there."""

    start: int  # >= 1: the first prompt token has nothing before it
    logprobs: list[TokenLogprobs]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # [R] every scheduled request, in scheduling order
    # [R][0 .. k+1]: empty while a prompt is still being prefilled; with drafts, the accepted
    # drafts then one token from the target (bonus or correction)
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]  # [R]: per sampled token, when requested
    # [R][0 or k]: MTP drafts proposed for the request's next step
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # per request, the top probability of the distribution each draft was drawn from (the
    # scheduler's confidence policy calibrates these: speculative/confidence.py); [] with
    # draft_token_ids
    draft_scores: list[list[float]] = field(default_factory=list)
    # [R] or []: the prompt logprobs a step computed, for the requests that asked
    prompt_logprobs: list[PromptLogprobs | None] = field(default_factory=list)
    # seconds of this step's MTP passes spent on prompt positions (the pass's time times
    # their share of its rows): what drafting costs beyond the decode steps, which "auto"'s
    # gate charges to drafting (speculative/gate.py); 0.0 where the step ran none
    mtp_prompt_seconds: float = 0.0
