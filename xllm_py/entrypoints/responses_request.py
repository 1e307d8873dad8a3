"""The Responses API's request body (`ResponsesRequest`) and its conversion into a chat request
(`to_chat`): the input items, instructions, tools and text format as chat messages, tools,
tool_choice and response_format; chat's errors renamed to the Responses fields."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from xllm_py.entrypoints.openai_protocol import (
    MAX_LOGPROBS,
    APIError,
    ChatCompletionRequest,
    _Body,
    from_validation_error,
)

LOGPROBS = "message.output_text.logprobs"  # the `include` value that returns logprobs
TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
# pydantic's names of union members in an error's location: not fields
TYPE_TAGS = {"str", "list[InputItem]", "list[ContentPart]"}
MAX_WARNED_TOOLS = 64
OTHER_METHODS = [
    "HEAD",
    "OPTIONS",
    "POST",
    "PUT",
    "PATCH",
    "TRACE",
]  # on /responses/{id}  # hosted tool types remembered (and logged once each)
# chat's field names in errors from the chat path, as the Responses body names them
RENAMED = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}


# ---- the request ---------------------------------------------------------------------------


class ContentPart(_Body):
    """A part of an item's content: text (input_text, output_text, ...) or a refusal;
    images, files and audio are refused by name when the item is read."""

    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # output items sent back: not read
    logprobs: list[Any] | None = None


class InputItem(_Body):
    """One item of `input`: a message (type "message", or none), a function_call, a
    function_call_output or a reasoning item. Which fields each needs is checked when it
    becomes a chat message (`_messages`)."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class ResponsesTool(_Body):
    """A function tool (name, description, parameters, strict); other types are OpenAI's
    hosted tools (web_search, file_search, mcp, ...): skipped, with one warning per type."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(_Body):
    type: str  # only "function" (with its name) runs here
    name: str | None = None


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: ignored


class ResponsesRequest(_Body):
    """POST /v1/responses (docs/api_fields.md, "responses", says what each field does)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    # ignored: bookkeeping and hints that cannot change the tokens
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(None, ge=0)  # hosted tools' calls: none run here
    stream_options: dict[str, Any] | None = None
    # refused unless neutral: they would change the output and are not implemented
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    context_management: list[Any] | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _one_input(cls, value: Any, handler: Callable) -> Any:
        """Say which item is wrong, not that the list is not a string."""
        try:
            return handler(value)
        except ValidationError as e:
            if not isinstance(value, list):
                raise PydanticCustomError("input", "must be a string or a list of items") from None
            err = max(e.errors(), key=lambda x: len(x["loc"]))  # the most specific
            loc = [p for p in err["loc"][1:] if isinstance(p, int) or p not in TYPE_TAGS]
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
            msg = f"input{where}: {err['msg']}"
            raise PydanticCustomError("input", "{msg}", {"msg": msg}) from None

    def extra_fields(self, prefix: str = "") -> dict[str, Any]:
        out = super().extra_fields(prefix)
        for item in self.input if isinstance(self.input, list) else []:
            out.update(item.extra_fields("input."))
            for part in item.content if isinstance(item.content, list) else []:
                out.update(part.extra_fields("input.content."))
        if self.text is not None:
            out.update(self.text.extra_fields("text."))
        return out

    def check_unsupported(self) -> None:
        refused = {
            "background": self.background,
            "conversation": self.conversation,
            "prompt": self.prompt,
            "truncation": self.truncation == "auto" or None,
            "context_management": self.context_management or None,
        }
        for name, value in refused.items():
            if value not in (None, False):
                msg = f"{name}: {getattr(self, name)!r} is not supported by this server"
                raise APIError(400, msg, param=name)
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceObject):
            if choice.type != "function":
                msg = f"tool_choice: type {choice.type!r} is not supported (only function tools)"
                raise APIError(400, msg, param="tool_choice")
            if not choice.name:
                raise APIError(400, "tool_choice: a function needs its name", param="tool_choice")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise APIError(400, "text.format: json_schema needs a schema", param="text")

    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or [])


# ---- the request as a chat request ----------------------------------------------------------


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, part in enumerate(content):
        text = part.refusal if part.type == "refusal" else part.text
        if part.type not in TEXT_PARTS | {"refusal"}:
            msg = f"{where}[{j}]: {part.type!r} content is not supported (text only)"
            raise APIError(400, msg, param="input")
        if text is None:
            raise APIError(400, f"{where}[{j}]: a {part.type} part needs its text", param="input")
        out.append(text)
    return "".join(out)


def _messages(req: ResponsesRequest) -> list[dict]:
    """The input as chat messages (dicts ChatMessage takes): a function_call joins the
    assistant message before it (or starts one), a reasoning item becomes the next
    assistant message's reasoning_content."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    thought = ""
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        needs = {"message": ("role",), "function_call": ("call_id", "name", "arguments"),
                 "function_call_output": ("call_id", "output"), "reasoning": ()}  # fmt: skip
        if item.type not in needs:
            msg = f"{where}: item type {item.type!r} is not supported (one of {list(needs)})"
            raise APIError(400, msg, param="input")
        missing = [f for f in needs[item.type] if getattr(item, f) is None]
        if missing:
            raise APIError(400, f"{where}: a {item.type} needs {missing}", param="input")
        if item.type == "reasoning":
            thought += _text(item.content or item.summary, where + ".content")
            continue
        if item.type == "function_call_output":
            text = _text(item.output, where + ".output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
            continue
        if item.type == "message":
            out.append({"role": item.role, "content": _text(item.content, where + ".content")})
        else:  # a function_call: the assistant turn's tool_calls
            function = {"name": item.name, "arguments": item.arguments}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            call = {"id": item.call_id, "type": "function", "function": function}
            out[-1].setdefault("tool_calls", []).append(call)
        if out[-1]["role"] == "assistant" and thought:
            out[-1]["reasoning_content"], thought = thought, ""
    return out


def _tools(req: ResponsesRequest, warn: Callable[[str], None]) -> list[dict] | None:
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            warn(tool.type)
            continue
        if tool.name is None:
            raise APIError(400, f"tools[{i}]: a function tool needs a name", param="tools")
        function = tool.model_dump(include={"name", "description", "parameters", "strict"})
        function = {k: v for k, v in function.items() if v is not None}
        tools.append({"type": "function", "function": function})
    return tools or None


def _tool_choice(req: ResponsesRequest, tools: list[dict] | None) -> Any:
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceObject):
        return {"type": "function", "function": {"name": choice.name}}
    if choice == "auto" and tools is None:
        return None  # only hosted tools were given: nothing to call
    return choice


def _response_format(req: ResponsesRequest, tool_choice: Any) -> dict | None:
    """text.format as chat's response_format; none when tool_choice forces a call (the
    format is that of text, and a forced call's output is a call, not text)."""
    fmt = req.text.format if req.text is not None else None
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if fmt is None or fmt.type == "text" or forced:
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "response", "schema": fmt.json_schema, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": schema}


def to_chat(
    req: ResponsesRequest, history: tuple[dict, ...], warn: Callable[[str], None]
) -> tuple[ChatCompletionRequest, list[dict]]:
    """(the chat request, the input's own messages): instructions first, then `history`
    (the stored conversation of previous_response_id), then the input."""
    new = _messages(req)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = [*system, *history, *new]
    if not messages:
        raise APIError(400, "input: no items (and no previous_response_id)", param="input")
    tools = _tools(req, warn)
    choice = _tool_choice(req, tools)
    body = {
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req, choice),
        "logprobs": req.logprobs(),
        "top_logprobs": (req.top_logprobs or 0) if req.logprobs() else None,
    }
    try:
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as e:
        raise renamed(from_validation_error(e)) from e
    return chat, new


def renamed(e: APIError) -> APIError:
    """An error from the chat path, naming the Responses body's field instead."""
    return e.renamed(RENAMED, {"text": "text.format"})
