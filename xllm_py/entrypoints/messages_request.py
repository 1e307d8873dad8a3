"""The Messages API's request body (`MessagesRequest`, `CountTokensRequest`), Anthropic's error
shape, and the conversion into a chat request (`to_chat`): system, content blocks, tools,
tool_choice and thinking as chat messages and options; chat's errors renamed to the Messages
fields."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from xllm_py.entrypoints.openai_protocol import (
    INT32_MAX,
    MAX_STOP,
    APIError,
    ChatCompletionRequest,
    _Body,
    from_validation_error,
)
from xllm_py.formats import reasoning

PREFIX = "/v1/messages"
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # what chat's FunctionDef accepts
BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")
# Anthropic's fields that cannot change the tokens here (hints, routing, bookkeeping;
# prompt caching is automatic: the prefix cache)
IGNORED = frozenset({"cache_control", "container", "diagnostics", "inference_geo", "speed",
                     "user_profile_id", "workspace_id"})  # fmt: skip
# Anthropic's fields that would change the output, not implemented: the accepted values
REFUSED: dict[str, tuple] = {"mcp_servers": (None, []), "context_management": (None,)}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
# chat's field names in errors -> the Messages body's
RENAMED = {"stop": "stop_sequences", "response_format": "output_config"}


def owns(path: str) -> bool:
    """Whether `path` is one of this API's routes (its errors take Anthropic's shape)."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_body(e: APIError) -> dict:
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """The body of every error answer on /v1/messages (what `error_body` writes)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


# ---- the request ---------------------------------------------------------------------------------


def _supported(blocks: Any, kinds: tuple[str, ...]) -> Any:
    """A before-validator's check: every block's type is one of `kinds` (others, such as
    image and document, named in a 400 rather than a pydantic union error)."""
    if isinstance(blocks, list):
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if isinstance(kind, str) and kind not in kinds:
                raise ValueError(
                    f"block {j} is of type {kind!r}, which this server does not support "
                    f"(text only; the types it takes here: {', '.join(kinds)})"
                )
    return blocks


class AnthropicTextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # ignored (prompt caching is automatic)
    citations: list[dict[str, Any]] | None = None  # ignored


class AnthropicThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicRedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


class AnthropicToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class AnthropicToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicTextBlock] | None = None
    is_error: bool = False  # ignored: the content says what went wrong
    cache_control: dict[str, Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        return _supported(v, ("text",))


Block = Annotated[
    AnthropicTextBlock | AnthropicThinkingBlock | AnthropicRedactedThinkingBlock
    | AnthropicToolUseBlock | AnthropicToolResultBlock,
    Field(discriminator="type"),
]  # fmt: skip


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, v: Any) -> Any:
        return _supported(v, BLOCKS)


class AnthropicTool(_Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, v: Any) -> Any:
        kind = v.get("type") if isinstance(v, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"type: server tool {kind!r} is not supported (custom tools only)")
        return v


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type tool: the tool
    disable_parallel_tool_use: bool = False


class AnthropicThinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking text ""


class AnthropicJSONFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(_Body):
    format: AnthropicJSONFormat | None = None
    effort: str | None = None  # ignored: an effort hint


class _Conversation(_Body):
    """What both routes take: the conversation and what renders it."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicTextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, v: Any) -> Any:
        return _supported(v, ("text",))

    # chat's policy for undeclared fields, with Anthropic's ignored and refused ones
    IGNORED: ClassVar[frozenset[str]] = IGNORED
    REFUSED: ClassVar[dict[str, tuple]] = REFUSED


class MessagesRequest(_Conversation):
    """POST /v1/messages (docs/api_fields.md, section "messages")."""

    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    metadata: dict[str, Any] | None = None  # ignored
    service_tier: str | None = None  # ignored

    def check_unsupported(self) -> None:
        if len(self.stop_sequences or ()) > MAX_STOP:
            msg = f"stop_sequences: at most {MAX_STOP} stop sequences"
            raise APIError(400, msg, param="stop_sequences")


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the conversation, counted as it would be rendered."""


# ---- the request as a chat request ---------------------------------------------------------------


def block_text(content: str | list[AnthropicTextBlock] | None) -> str:
    """Text blocks joined with newlines (as vLLM flattens text parts)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content)


def _assistant(m: AnthropicMessage) -> tuple[dict, set[str]]:
    """An assistant turn as chat's message (thinking dropped, as the chat templates drop
    earlier turns' reasoning; tool_use blocks as tool_calls), and its tool_use ids."""
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}, set()
    texts = [b.text for b in m.content if b.type == "text"]
    calls = [
        {"id": b.id, "type": "function",
         "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
        for b in m.content if b.type == "tool_use"
    ]  # fmt: skip
    out: dict = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        out["tool_calls"] = calls
        out["content"] = out["content"] or None
    return out, {c["id"] for c in calls}


def _user(m: AnthropicMessage, i: int, calls: set[str]) -> list[dict]:
    """A user turn as chat's messages: each tool_result a `tool` message (answering a
    tool_use of the assistant turn just before), the text around them user messages."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[dict] = []
    texts: list[str] = []
    for j, b in enumerate(m.content):
        if b.type == "text":
            texts.append(b.text)
        elif b.type == "tool_result":
            if b.tool_use_id not in calls:
                where = f"messages[{i}].content[{j}].tool_use_id"
                msg = (f"{where}: {b.tool_use_id!r} answers no tool_use block of the assistant "
                       f"message before it (its tool_use ids: {sorted(calls)})")  # fmt: skip
                raise APIError(400, msg, param="messages")
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(
                {"role": "tool", "tool_call_id": b.tool_use_id, "content": block_text(b.content)}
            )
        else:
            raise APIError(
                400,
                f"messages[{i}].content[{j}]: a {b.type} block in a user turn",
                param="messages",
            )
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def chat_messages(req: _Conversation) -> list[dict]:
    """The conversation in chat's shape (what the chat template renders)."""
    out = [{"role": "system", "content": block_text(req.system)}] if req.system else []
    calls: set[str] = set()
    for i, m in enumerate(req.messages):
        if m.role == "assistant":
            message, calls = _assistant(m)
            out.append(message)
        else:
            out += _user(m, i, calls)
            calls = set()
    if req.messages[-1].role == "assistant":
        msg = (f"messages[{len(req.messages) - 1}]: the last message is the assistant's "
               "(prefill: continuing it is not supported); end with a user message")  # fmt: skip
        raise APIError(400, msg, param="messages")
    return out


def _tools(req: _Conversation) -> dict:
    """tools, tool_choice and parallel_tool_calls in chat's shape."""
    out: dict = {}
    for i, t in enumerate(req.tools or ()):
        if t.input_schema.get("type") != "object":
            msg = f'tools[{i}].input_schema: must be a JSON schema with "type": "object"'
            raise APIError(400, msg, param="tools")
    if req.tools:
        out["tools"] = [
            {"type": "function", "function": {"name": t.name, "parameters": t.input_schema}
             | ({"description": t.description} if t.description is not None else {})}
            for t in req.tools
        ]  # fmt: skip
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise APIError(
                    400, "tool_choice.name: required with type tool", param="tool_choice"
                )
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        out["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return out


def _thinking(req: _Conversation, parser: str, max_tokens: int | None) -> dict | None:
    """The chat template's thinking switch for `thinking` (the module docstring says
    which budgets are kept and which refused)."""
    t = req.thinking
    if t is None or t.type == "adaptive":
        return None
    if t.type == "disabled":
        if parser and reasoning.thinks(parser, {"thinking": False}):
            msg = f"thinking.type: 'disabled': --reasoning_parser={parser} always thinks"
            raise APIError(400, msg, param="thinking")
        return {"thinking": False} if parser else None
    if not parser:
        msg = ("thinking.type: 'enabled' needs a server started with --reasoning_parser "
               "(deepseek_r1, deepseek_v3 or kimi_k2)")  # fmt: skip
        raise APIError(400, msg, param="thinking")
    if t.budget_tokens is None:
        raise APIError(400, "thinking.budget_tokens: required with type enabled", param="thinking")
    if max_tokens is not None and t.budget_tokens < max_tokens:
        msg = (f"thinking.budget_tokens: {t.budget_tokens} is below max_tokens ({max_tokens}); "
               "this server cannot stop the reasoning at a token budget, only the whole answer "
               "at max_tokens: send budget_tokens >= max_tokens, or thinking type adaptive"
               )  # fmt: skip
        raise APIError(400, msg, param="thinking")
    return {"thinking": True}


def to_chat(req: _Conversation, parser: str) -> ChatCompletionRequest:
    """The chat request this Messages request is (a 400 naming the field if it cannot be)."""
    is_create = isinstance(req, MessagesRequest)
    body: dict = {"messages": chat_messages(req), **_tools(req)}
    kwargs = _thinking(req, parser, req.max_tokens if is_create else None)
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    fmt = req.output_config.format if req.output_config else None
    if fmt is not None:
        spec = {"name": "output", "schema": fmt.schema_, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    if is_create:
        body |= {"max_tokens": req.max_tokens, "stream": req.stream, "stop": req.stop_sequences}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
    try:
        chat = ChatCompletionRequest.model_validate(body)
        chat.check_unsupported()
    except ValidationError as e:
        raise anthropic_names(from_validation_error(e)) from e
    except APIError as e:
        raise anthropic_names(e) from e
    return chat


def anthropic_names(e: APIError) -> APIError:
    """A chat error that names a chat field, renamed to the Messages body's field."""
    return e.renamed(RENAMED)
