"""OpenAI request bodies (pydantic) and the OpenAI error shape.

Bodies are validated strictly: a wrong type is an error (no "5" -> 5), and an
unknown field is an error, as OpenAI's own API does. Fields OpenAI defines but
this server does not implement (penalties, logit_bias, echo, suffix, tools,
...) are accepted only at their neutral value; anything else is a 400 that
says the feature is not supported, never a silent ignore.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xllm_py.sampling_params import SamplingParams

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 16
INT32_MAX = 2**31 - 1
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
}


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    @classmethod
    def invalid(cls, e: ValueError) -> APIError:
        """A 400 from the engine's own ValueError, which starts with the field's name."""
        name = str(e).split(":")[0].split("=")[0].strip()
        return cls(400, str(e), param={"prompt_token_ids": "prompt"}.get(name, name))

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error answer (what `APIError.body` writes), for /openapi.json."""

    error: ErrorDetail


ERROR_STATUSES = {
    400: "Bad input: a malformed body, a wrong type or value (`param` names the field), or a "
    "prompt that does not fit the context",
    401: "Missing or wrong API key (the server runs with --api_key)",
    404: "Unknown model or route",
    413: "Request body larger than --max_request_body_bytes",
    429: "More requests in flight than --max_concurrent_requests; retry later",
    500: "This request failed while it was being served; the other requests go on",
    503: "The server is shutting down or its engine has stopped",
}


def from_validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"] if p not in ("body",))
    # strip pydantic's union-member tags ("prompt.str", "prompt.list[int]") from the name
    param = loc.split(".")[0] if loc else None
    msg = err["msg"]
    if err["type"] == "json_invalid":
        return APIError(400, f"body: not valid JSON ({msg})")
    if param in UNION_FIELDS and len(err["loc"]) > 1:  # say what fits, not one member's error
        return APIError(400, f"{param}: must be {UNION_FIELDS[param]}", param=param)
    if err["type"] == "extra_forbidden":
        msg = "unknown field (not part of the OpenAI API or not supported here)"
    return APIError(400, f"{loc or 'body'}: {msg}", param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63 - MAX_N)  # choice i samples with seed + i
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    # OpenAI fields without an implementation: only their neutral values are accepted.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def check_unsupported(self) -> None:
        neutral = {
            "frequency_penalty": (None, 0, 0.0),
            "presence_penalty": (None, 0, 0.0),
            "repetition_penalty": (None, 1, 1.0),
        }
        for name, ok in neutral.items():
            if getattr(self, name) not in ok:
                raise APIError(400, f"{name}: not supported by this server", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias: not supported by this server", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed with stream=true", param="stream")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings", param="stop")

    def sampling(self, max_tokens: int | None, logprobs: int | None, index: int) -> SamplingParams:
        """SamplingParams for choice `index` (seeded choices get seed + index, so n > 1
        seeded choices differ from each other and repeat across calls)."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=None if self.seed is None else self.seed + index,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
            )
        except ValueError as e:
            raise APIError.invalid(e) from e


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError(400, "echo: not supported by this server", param="echo")
        if self.suffix:
            raise APIError(400, "suffix: not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of: only best_of == n is supported", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools or self.tool_choice not in (None, "none"):
            raise APIError(
                400, "tools: tool calling is not supported by this server", param="tools"
            )
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError(
                400, "response_format: only {'type': 'text'} is supported", param="response_format"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
