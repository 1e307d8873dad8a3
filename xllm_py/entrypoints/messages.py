"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens, what
the `anthropic` SDK and Claude Code send, over the same conversation model as chat.

    Messages body ─MessagesRequest─▶ ChatCompletionRequest (to_chat: system, turns,
        tool_use / tool_result, tools, tool_choice, thinking, stop_sequences, sampling)
      ─chat.chat_outputs─▶ one ChatChoice (the chat template renders: nothing twice)
      ─its chat deltas (reasoning_content, content, tool_calls)─▶ _Blocks
      ─▶ content blocks thinking | text | tool_use, and the events that build them
         (a stream sends the events; a whole answer returns the blocks)

A stream is Anthropic's SSE (`event: NAME` + `data: {...}`): message_start, ping,
content_block_start / _delta (text_delta, thinking_delta, input_json_delta) / _stop per
block, message_delta (stop_reason, usage), message_stop. Both forms come from the same
deltas, so a stream's blocks put together are the whole answer. Errors on these routes
have Anthropic's shape `{"type": "error", "error": {"type", "message"}}` (api_server's
handlers ask `owns`), the message starting with the field it is about.

thinking: `enabled` turns the template's thinking on (chat_template_kwargs thinking=true)
under --reasoning_parser. The sampler cannot stop the reasoning at a token budget, so a
`budget_tokens` below `max_tokens` (which bounds the reasoning too) is refused rather than
ignored; `adaptive` leaves the parser's default; `disabled` turns it off where the
model can think without it (not deepseek_r1, which always thinks).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from xllm_py.engine.engine_client import Update
from xllm_py.entrypoints.chat import ChatChoice, chat_outputs
from xllm_py.entrypoints.messages_request import (
    AnthropicError,
    CountTokensRequest,
    MessagesRequest,
    anthropic_names,
    error_body,
    to_chat,
)
from xllm_py.entrypoints.openai_protocol import (
    ERROR_STATUSES,
    APIError,
)
from xllm_py.entrypoints.route_docs import post_doc
from xllm_py.entrypoints.serving import (
    Answer,
    OpenAIServer,
)

# ---- the answer ----------------------------------------------------------------------------------


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Blocks:
    """One answer's content blocks, built from its chat deltas in order (thinking, then
    text, then tool_use blocks: the order the model writes them), with the events that
    build them."""

    def __init__(self, show_thinking: bool) -> None:
        self.blocks: list[dict] = []
        self.args: dict[int, str] = {}  # a tool_use block's index -> its input's JSON so far
        self.open = False
        self.show_thinking = show_thinking

    def feed(self, delta: dict) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        if delta.get("reasoning_content"):
            events += self.block_text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self.block_text("text", delta["content"])
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"]}
                events += self._start(block | {"input": {}})
                self.args[len(self.blocks) - 1] = ""
            fragment = call["function"].get("arguments")
            i = len(self.blocks) - 1
            if fragment and i in self.args:
                self.args[i] += fragment
                delta_ = {"type": "input_json_delta", "partial_json": fragment}
                events.append(("content_block_delta", {"index": i, "delta": delta_}))
        return events

    def block_text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        """`text` added to the open block of `kind` ("text" or "thinking"), or a new one."""
        events = []
        if not (self.open and self.blocks[-1]["type"] == kind):
            extra = {"signature": ""} if kind == "thinking" else {}
            events += self._start({"type": kind, kind: ""} | extra)
        if kind == "thinking" and not self.show_thinking:
            return events  # display "omitted": the block, without its text
        self.blocks[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(("content_block_delta", {"index": len(self.blocks) - 1, "delta": delta}))
        return events

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        events = self.close()
        self.blocks.append(block)
        self.open = True
        start = {"index": len(self.blocks) - 1, "content_block": dict(block)}
        return [*events, ("content_block_start", start)]

    def close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open = False
        return [("content_block_stop", {"index": len(self.blocks) - 1})]

    def final(self) -> list[dict]:
        """The blocks, each tool_use's input parsed (a call whose arguments are no JSON
        object, as one cut short by max_tokens, has the input {})."""
        out = []
        for i, b in enumerate(self.blocks):
            if i in self.args:
                try:
                    parsed = json.loads(self.args[i])
                except json.JSONDecodeError:
                    parsed = None
                b = b | {"input": parsed if isinstance(parsed, dict) else {}}
            out.append(b)
        return out


def stop_of(out: ChatChoice) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if out.calls is not None and out.calls.calls:
        return "tool_use", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


@dataclass
class MessagesAnswer(Answer):
    """A Messages answer: Answer's plumbing (server.whole, merged updates), Anthropic's
    events per update and Anthropic's message as the whole answer."""

    blocks: _Blocks = field(default_factory=lambda: _Blocks(True))

    def anthropic_usage(self) -> dict:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": self.outputs[0].tokens}
        if self.speculative:  # --report_speculative_usage, as chat's usage carries it
            usage["speculative"] = self.usage_so_far()["speculative"]
        return usage

    def message(self, content: list[dict], stop: tuple[str | None, str | None]) -> dict:
        return {
            "id": self.head["id"], "type": "message", "role": "assistant",
            "model": self.head["model"], "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": self.anthropic_usage(),
        }  # fmt: skip

    def opening(self) -> Iterator[str]:
        message = self.message([], (None, None))
        message["usage"].pop("speculative", None)  # nothing drafted yet: message_delta has it
        start = {"type": "message_start", "message": message}
        yield _event("message_start", start) + _event("ping", {"type": "ping"})

    def step(self, out, u: Update) -> str | None:
        """The events update `u` of the only choice makes (None: nothing to send)."""
        body = out.feed(u)
        if body is None:
            return None
        events = self.blocks.feed(body["delta"])
        if u.finished:
            reason, sequence = stop_of(out)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            usage = self.anthropic_usage()
            events += [*self.blocks.close(), ("message_delta", {"delta": delta, "usage": usage}),
                       ("message_stop", {})]  # fmt: skip
        return "".join(_event(name, {"type": name, **data}) for name, data in events) or None

    def closing(self) -> Iterator[str]:
        return iter(())  # message_stop came with the last update

    def error(self, e: APIError) -> str:
        return _event("error", error_body(e))

    def end(self) -> str:
        return ""

    def whole(self) -> bytes:
        body = self.message(self.blocks.final(), stop_of(self.outputs[0]))  # type: ignore[arg-type]
        return json.dumps(body, ensure_ascii=False).encode()


async def serve_messages(server: OpenAIServer, request: Request) -> Response:
    req = await server.read_body(request, MessagesRequest)
    chat = to_chat(req, server.opts.reasoning_parser)
    try:
        outputs = await chat_outputs(server, chat)
    except APIError as e:
        raise anthropic_names(e) from e
    answer = MessagesAnswer.of(server, chat, "message", "msg_", outputs)
    show = req.thinking is None or req.thinking.display != "omitted"
    answer.blocks = _Blocks(show)
    return await server.respond(request, chat, answer)


async def count_tokens(server: OpenAIServer, request: Request) -> dict:
    req = await server.read_body(request, CountTokensRequest)
    chat = to_chat(req, server.opts.reasoning_parser)

    def run() -> dict:
        _, ids = server.tokenize(server.render_chat(chat))
        return {"input_tokens": len(ids)}

    return await server.run_blocking(run)


def _doc(body: type[BaseModel], what: str, stream: bool) -> dict:
    """route_docs.post_doc, with Anthropic's error shape and event stream."""
    doc = post_doc(body, what, stream)
    answers = dict(doc["responses"])
    for status in answers:
        if status != 200:
            answers[status] = {"model": AnthropicError, "description": ERROR_STATUSES[status]}
    if stream:
        answers[200] = {
            "description": f"{what}: one JSON object, or with `stream: true` server-sent events "
            "(`event: NAME` and `data: {...}`: message_start, ping, content_block_start, "
            "content_block_delta, content_block_stop, message_delta, message_stop)",
            "content": {"application/json": {}, "text/event-stream": {}},
        }
    return {**doc, "responses": answers}


def routes(server: OpenAIServer) -> APIRouter:
    """The Messages API's routes (api_server includes them under /v1, behind the key)."""
    router = APIRouter()

    @router.post("/messages", **_doc(MessagesRequest, "The message", stream=True))
    async def messages(request: Request):
        return await serve_messages(server, request)

    @router.post(
        "/messages/count_tokens",
        **_doc(CountTokensRequest, "`input_tokens`: the rendered prompt's tokens", stream=False),
    )
    async def messages_count_tokens(request: Request):
        return await count_tokens(server, request)

    return router
