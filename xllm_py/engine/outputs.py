"""What users get back (vLLM's shapes): one RequestOutput per prompt."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per generated token: id -> logprob (chosen + top N)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # prompt_logprobs asked for: entry i is prompt token i's logprob given the tokens before
    # it, then the top N there (entry 0 is None), and prompt_ranks[i - 1] that token's
    # 1-based rank; set once the whole prompt has been computed
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int] | None = None
    # set when handling this request's own data failed (finish_reason "error"): the request
    # was ended and its blocks freed; the engine and the other requests went on
    error: str | None = None
    # speculative decoding (MTP): the request's draft tokens verified so far, and how many
    # of them the target accepted (acceptance rate = num_accepted_tokens / num_draft_tokens);
    # both 0 without speculation
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
