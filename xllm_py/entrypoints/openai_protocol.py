"""OpenAI request bodies (pydantic) and the OpenAI error shape.

Known fields are validated strictly: a wrong type is an error (no "5" -> 5) and so is an
out-of-range value, each a 400 naming the field. Other fields follow the policy tools
that talk to vLLM expect (docs/api_fields.md has the table):

- a field OpenAI or vLLM defines that cannot change the tokens (`metadata`, `store`,
  `service_tier`, ...) is ignored;
- one they define that would change the output and is not implemented here (beam
  search, `suffix`, guided decoding, ...) is accepted only at its neutral value;
  anything else is a 400 saying it is not supported, never a silent ignore;
- a field neither defines is ignored, with one warning line per field name (the server
  logs it), unless the server runs with --strict_request_fields=true: then it is a 400.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xllm_py.sampling_params import SamplingParams, StructuredOutput

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

    def renamed(self, names: dict[str, str], spelled: dict[str, str] | None = None) -> APIError:
        """This error (from the chat path, naming a chat field) naming instead the field of
        the body the request came in: `names` maps chat fields to that body's, `spelled`
        says how the message names one where that differs. Unchanged for other fields."""
        new = names.get(self.param or "")
        if new is None:
            return self
        said = (spelled or {}).get(new, new)
        message = self.message.replace(self.param or "", said, 1)
        return APIError(self.status, message, self.type, new, self.code)

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
    return APIError(400, f"{loc or 'body'}: {msg}", param=param)


# Fields of OpenAI's or vLLM's bodies this server accepts and does not act on: none of
# them can change the tokens (bookkeeping, routing and effort hints).
IGNORED_FIELDS = frozenset(
    {
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",  # completions (chat honours it)
        "prompt_cache_key",
        "safety_identifier",
        "request_id",
        "priority",
        "cache_salt",
        "reasoning_effort",
        "verbosity",
        "messages.refusal",
        "messages.reasoning_content",
    }
)
# Fields of OpenAI's or vLLM's bodies that would change the output and are not
# implemented: name -> the neutral values that are accepted.
REFUSED_FIELDS: dict[str, tuple] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "guided_decoding_backend": (None, "xgrammar", "auto"),
    "guided_whitespace_pattern": (None,),
    "logits_processors": (None,),
    "prompt_embeds": (None,),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    "add_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
}


class _Body(BaseModel):
    """A request body or part of one: known fields strict, other fields kept for
    `extra_fields` to sort out (ignored, refused, or unknown)."""

    model_config = ConfigDict(extra="allow", strict=True)
    # undeclared fields this API lets pass (a warning-free no-op) or refuses unless neutral
    IGNORED: ClassVar[frozenset[str]] = IGNORED_FIELDS
    REFUSED: ClassVar[dict[str, tuple]] = REFUSED_FIELDS

    def extra_fields(self, prefix: str = "") -> dict[str, Any]:
        return {prefix + k: v for k, v in (self.model_extra or {}).items()}

    def check_unsupported(self) -> None:
        """Refuse values of declared fields this server does not implement."""

    def unknown_fields(self, strict: bool) -> list[str]:
        """Names of fields neither OpenAI nor vLLM defines (the caller warns about them);
        a 400 for a refused field at a non-neutral value, or for any field this model
        does not declare when `strict` (--strict_request_fields)."""
        unknown = []
        for name, value in self.extra_fields().items():
            param = name.split(".")[0]
            if strict:
                raise APIError(400, f"{name}: unknown field (--strict_request_fields)", param=param)
            if name in self.REFUSED:
                if not any(value == v and type(value) is type(v) for v in self.REFUSED[name]):
                    raise APIError(400, f"{name}: not supported by this server", param=param)
            elif name not in self.IGNORED:
                unknown.append(name)
        return unknown


class StreamOptions(_Body):
    include_usage: bool = False
    # with include_usage: every chunk carries the usage so far (vLLM's extension)
    continuous_usage_stats: bool = False


class _Common(_Body):
    """Fields both endpoints take."""

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
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # keep the prompt's last N tokens
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)  # vLLM
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> [-100, 100]
    # vLLM: each prompt token's logprob given the tokens before it, and the top N there
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # structured outputs (at most one): OpenAI's, then vLLM's older and newer forms
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    structural_tag: str | None = None  # vLLM (older form of structured_outputs.structural_tag)

    def structured_output(self) -> tuple[str, StructuredOutput] | None:
        """(the field that asked, the constraint), or None; a 400 naming the field for a
        malformed one, or for a second constraint in one request."""
        found = [c for c in self._constraints() if c is not None]
        if len(found) > 1:
            raise APIError(
                400,
                f"{found[1][0]}: one structured-output constraint per request "
                f"({found[0][0]} is given too)",
                param=found[1][0],
            )
        return found[0] if found else None

    def _constraints(self):
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            yield "response_format", _response_format(rf)
        if self.guided_json is not None:
            yield "guided_json", _json_constraint("guided_json", self.guided_json)
        if self.guided_regex is not None:
            yield "guided_regex", StructuredOutput("regex", self.guided_regex)
        if self.guided_choice is not None:
            yield "guided_choice", _choice("guided_choice", self.guided_choice)
        if self.guided_grammar is not None:
            yield "guided_grammar", StructuredOutput("grammar", self.guided_grammar)
        if self.structural_tag is not None:
            yield "structural_tag", _structural_tag("structural_tag", self.structural_tag)
        so = self.structured_outputs
        if so:
            given = {k: v for k, v in so.items() if v not in (None, False)}
            if len(given) != 1:
                raise APIError(
                    400,
                    "structured_outputs: give exactly one of json, json_object, regex, choice, "
                    f"grammar, structural_tag (got {sorted(given) or 'none'})",
                    param="structured_outputs",
                )
            ((key, value),) = given.items()
            name = f"structured_outputs.{key}"
            if key == "json":
                yield "structured_outputs", _json_constraint(name, value)
            elif key == "json_object":
                yield "structured_outputs", StructuredOutput("json_object")
            elif key == "choice":
                yield "structured_outputs", _choice(name, value)
            elif key == "structural_tag" and isinstance(value, str):
                yield "structured_outputs", _structural_tag(name, value)
            elif key in ("regex", "grammar") and isinstance(value, str):
                yield "structured_outputs", StructuredOutput(key, value)
            else:
                raise APIError(
                    400, f"{name}: not supported here (or not a string)", param="structured_outputs"
                )

    def extra_fields(self, prefix: str = "") -> dict[str, Any]:
        out = super().extra_fields(prefix)
        if self.stream_options is not None:
            out.update(self.stream_options.extra_fields("stream_options."))
        return out

    def check_unsupported(self) -> None:
        for key in self.logit_bias or {}:
            if not key.lstrip("-").isdigit():
                raise APIError(
                    400, f"logit_bias: key {key!r} is not a token id", param="logit_bias"
                )
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(
                400, "prompt_logprobs: not available with stream=true", param="prompt_logprobs"
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed with stream=true", param="stream")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings", param="stop")

    def sampling(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        index: int,
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
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
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                prompt_logprobs=self.scored_prompt_logprobs(),
                structured=structured,
            )
        except ValueError as e:
            raise APIError.invalid(e) from e

    def scored_prompt_logprobs(self) -> int | None:
        """The prompt logprobs the engine computes for this request."""
        return self.prompt_logprobs


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 scores the prompt without generating (with echo or prompt_logprobs)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before the output: its text, and with logprobs, theirs
    suffix: str | None = None
    best_of: int | None = None

    def scored_prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise APIError(
                400,
                "max_tokens: 0 generates nothing; it is only allowed with echo=true or "
                "prompt_logprobs (scoring the prompt)",
                param="max_tokens",
            )
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


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text; HF templates also take a dict


class ToolCallIn(_Body):
    """A call an earlier assistant turn made (rendered by the chat template)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class _Chat(_Body):
    """What chat rendering takes (chat completions and /tokenize)."""

    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: more template variables

    def message_dicts(self) -> list[dict]:
        """Messages as the chat template takes them (HF's shape: a tool-calling assistant
        turn without text has content None, as DeepSeek-V3's template expects)."""
        out = []
        for m in self.messages or []:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
                if m.content is None:
                    d["content"] = None
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def extra_fields(self, prefix: str = "") -> dict[str, Any]:
        out = super().extra_fields(prefix)
        for m in self.messages or []:
            out.update(m.extra_fields("messages."))
            if isinstance(m.content, list):
                for part in m.content:
                    out.update(part.extra_fields("messages.content."))
        return out


class ChatCompletionRequest(_Chat, _Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")

    def tool_mode(self, parser: str, auto_enabled: bool) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function): what this request
        asks of tool calls on a server with `parser` (--tool_call_parser) and
        --enable_auto_tool_choice; a 400 naming the field when it cannot be done."""
        choice = self.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice == "none":
            return "none", None
        if not self.tools:
            raise APIError(400, "tool_choice: needs tools", param="tool_choice")
        if not parser:
            raise APIError(
                400,
                "tools: this server parses no tool calls (start it with "
                "--tool_call_parser=deepseek_v3, deepseek_v31, kimi_k2 or deepseek_v32), so "
                "only "
                "tool_choice none is possible",
                param="tools",
            )
        if choice == "auto":
            if not auto_enabled:
                raise APIError(
                    400,
                    'tool_choice: "auto" needs a server started with --enable_auto_tool_choice '
                    '(the default when tools are given; "none", "required" or a named function '
                    "work without it)",
                    param="tool_choice",
                )
            return "auto", None
        if choice == "required":
            return "required", None
        names = [t.function.name for t in self.tools]
        if choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice: function {choice.function.name!r} is not among the tools {names}",
                param="tool_choice",
            )
        return "named", choice.function.name

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Chat):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check_unsupported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", param="prompt")


class DetokenizeRequest(_Body):
    """vLLM's /detokenize: token ids in, text out."""

    model: str | None = None
    tokens: list[int]


def _json_constraint(name: str, schema: Any) -> StructuredOutput:
    """A JSON schema given as an object or as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise APIError(400, f"{name}: not valid JSON ({e})", param=name.split(".")[0]) from e
    if not isinstance(schema, dict):
        raise APIError(400, f"{name}: a JSON schema must be an object", param=name.split(".")[0])
    return StructuredOutput("json", json.dumps(schema), strict=True)


def _structural_tag(name: str, text: str) -> StructuredOutput:
    """vLLM's structural tag: xgrammar's own JSON, or vLLM's first form (`structures` of
    begin, JSON schema, end, and `triggers` that start them), which is made xgrammar's."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"{name}: not valid JSON ({e})", param=name.split(".")[0]) from e
    if isinstance(tag, dict) and "structures" in tag:
        try:
            tags = [
                {
                    "type": "tag",
                    "begin": s["begin"],
                    "content": {"type": "json_schema", "json_schema": s["schema"]},
                    "end": s["end"],
                }
                for s in tag["structures"]
            ]
            fmt = {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}
        except (KeyError, TypeError) as e:
            msg = f"{name}: structures need begin, schema and end, and triggers are needed ({e})"
            raise APIError(400, msg, param=name.split(".")[0]) from e
        tag = {"type": "structural_tag", "format": fmt}
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
        msg = f'{name}: must be a JSON object with "type": "structural_tag"'
        raise APIError(400, msg, param=name.split(".")[0])
    return StructuredOutput("structural_tag", json.dumps(tag, ensure_ascii=False))


def _choice(name: str, choices: Any) -> StructuredOutput:
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        msg = f"{name}: must be a non-empty list of strings"
        raise APIError(400, msg, param=name.split(".")[0])
    return StructuredOutput("choice", json.dumps(choices))


def _response_format(rf: dict[str, Any]) -> StructuredOutput:
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise APIError(
                400,
                "response_format: json_schema needs {'name': ..., 'schema': {...}}",
                param="response_format",
            )
        # OpenAI's strict: no properties beyond the schema's; non-strict allows extra ones
        schema = js.get("schema", {})
        return StructuredOutput("json", json.dumps(schema), strict=bool(js.get("strict")))
    raise APIError(
        400,
        f"response_format: type {kind!r} is not one of text, json_object, json_schema",
        param="response_format",
    )
