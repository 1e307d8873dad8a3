"""Per-request sampling and stopping parameters (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

GREEDY_EPS = 1e-5  # temperatures below this sample greedily


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N: the chosen token's and the top N
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n == 1, "n", "only n=1 is supported"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (0 <= self.min_tokens < 2**31, "min_tokens", "must be in [0, 2^31)"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "must be <= max_tokens",
            ),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (-1 <= self.top_k < 2**31, "top_k", "must be -1 (disabled) or in [1, 2^31)"),
            (
                self.seed is None or -(2**63) <= self.seed < 2**63,
                "seed",
                "must fit in 64 bits",
            ),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "must be >= 0"),
            (all(s for s in self.stop), "stop", "must not contain empty strings"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS
