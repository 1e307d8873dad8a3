"""Per-request sampling and stopping parameters (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

GREEDY_EPS = 1e-5  # temperatures below this sample greedily
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow (xllm_py/structured/): a JSON schema (text), any
    JSON object, a regular expression, a choice among strings (a JSON list), an EBNF
    grammar, or an xgrammar structural tag (JSON: tool calls, a grammar after reasoning)."""

    kind: str
    spec: str = ""  # "" for json_object
    strict: bool = True  # json: no properties beyond the schema's unless it allows them

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"structured_outputs: unknown kind {self.kind!r} (one of {STRUCTURED_KINDS})"
            )


@dataclass(frozen=True)
class KVPush:
    """Prefill/decode disaggregation (xllm_py/pd): where a prefill instance writes the
    prompt's full blocks once it has computed them. Set by the PD prefill route only, never
    from a request body: the decode instance's transfer session, its cache tensors'
    addresses, the blocks it reserved and their prefix hashes, and its compatibility record
    (CompatRecord's fields)."""

    session_id: str
    addresses: list[int]
    block_ids: list[int]
    hashes: list[int]
    record: dict


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context; 0: score the prompt only
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
    # None: none; N: for every prompt token after the first, its logprob given the tokens
    # before it, and the top N there (vLLM's prompt_logprobs)
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # the output follows this grammar
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's meanings: presence and frequency penalise tokens of the output so far (by
    # 1 / by count), repetition divides positive logits (multiplies negative ones) of
    # tokens of the prompt or the output; logit_bias adds to the raw logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    kv_push: KVPush | None = None  # internal: the PD prefill route's (KVPush)
    # internal, on a PD decode instance: the prefill instance the router chose (a URL of
    # --pd_prefill; "" when it saw none live: computed here); None: the instance chooses
    kv_source: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n == 1, "n", "only n=1 is supported"),
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens", "must be >= 0"),
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
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "prompt_logprobs",
                "must be >= 0",
            ),
            (all(s for s in self.stop), "stop", "must not contain empty strings"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 2, "repetition_penalty", "must be in (0, 2]"),
            (
                all(-100 <= v <= 100 for v in self.logit_bias.values()),
                "logit_bias",
                "biases must be in [-100, 100]",
            ),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias: the sampler changes this request's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )
