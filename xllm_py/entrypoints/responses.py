"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

One conversation model underneath: a Responses body becomes a ChatCompletionRequest,
which chat.py renders, constrains (tool_choice, text.format) and admits; its choice's
chat deltas are then read back as Responses output items, in the order the model wrote
them:

    input items ──to_chat──▶ chat messages: instructions first (a system message), then the
        stored conversation of previous_response_id, then the input (function_call items:
        the assistant's tool_calls; function_call_output items: tool messages)
    chat deltas ──Items.take──▶ output items: reasoning ─▶ message (output_text) ─▶
        function_call ...; and, streamed, the events that build them

A whole answer and a stream build the same items from the same deltas, so a stream's
closing `response.completed` carries what the whole answer would be.

`store` (default true) keeps the response and the conversation it ends (its input and
output as chat messages, without its instructions, which OpenAI does not carry over) in a
ResponseStore: at most --responses_store_max entries, each for --responses_store_ttl
seconds. previous_response_id continues that conversation; GET returns the response;
DELETE removes it.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from xllm_py.entrypoints.chat import chat_outputs
from xllm_py.entrypoints.openai_protocol import (
    APIError,
)
from xllm_py.entrypoints.responses_request import (
    MAX_WARNED_TOOLS,
    OTHER_METHODS,
    ResponsesRequest,
    ToolChoiceObject,
    renamed,
    to_chat,
)
from xllm_py.entrypoints.route_docs import error_docs, post_doc
from xllm_py.entrypoints.serving import (
    Answer,
    OpenAIServer,
)

logger = logging.getLogger(__name__)


# ---- the answer as output items --------------------------------------------------------------


class Items:
    """One choice's output items, built from its chat deltas in the order the model wrote
    them (reasoning, then the message, then function calls: the order chat.py's readers
    hand them out), and the stream events that build the same items. An item is open
    while it grows; the next kind closes it, and the end closes the last one (status
    "incomplete" when the output was cut short). A message is there when there is text or
    when there are no calls, so every answer without calls has one."""

    def __init__(self, logprobs: bool) -> None:
        self.items: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}  # chat's tool-call index -> its function_call item
        self.logprobs: list[dict] | None = [] if logprobs else None  # every token's, if asked

    def take(self, body: dict) -> list[dict]:
        """The events of one chat delta body ({"delta", "logprobs", "finish_reason"}),
        its pieces added to the items."""
        events: list[dict] = []
        delta = body["delta"]
        lps = (body.get("logprobs") or {}).get("content") or []
        if self.logprobs is not None:
            self.logprobs += lps
        if delta.get("reasoning_content"):
            self._write("reasoning", delta["reasoning_content"], events)
        if delta.get("content"):
            self._write("message", delta["content"], events, lps)
        for fragment in delta.get("tool_calls") or []:
            self._call(fragment, events)
        if body["finish_reason"] is not None:
            if not self.calls and not any(i["type"] == "message" for i in self.items):
                self._open("message", events)
            self._close(events, "incomplete" if body["finish_reason"] == "length" else "completed")
        return events

    def _at(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _open(self, kind: str, events: list[dict]) -> dict:
        self._close(events, "completed")
        new = "msg_" if kind == "message" else "rs_"
        item: dict = {"id": new + uuid.uuid4().hex, "type": kind, "status": "in_progress"}
        if kind == "message":
            item |= {"role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item |= {"summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self.open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": dict(item, content=[])})  # fmt: skip
        item["content"].append(part)
        events.append({"type": "response.content_part.added", **self._at(item),
                       "content_index": 0, "part": dict(part)})  # fmt: skip
        return item

    def _write(self, kind: str, text: str, events: list[dict], lps: list | None = None) -> None:
        item = self.open
        if item is None or item["type"] != kind:
            item = self._open(kind, events)
        item["content"][0]["text"] += text
        event = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {"logprobs": lps if self.logprobs is not None else []} if kind == "message" else {}
        events.append({"type": event, **self._at(item), "content_index": 0, "delta": text, **extra})

    def _call(self, fragment: dict, events: list[dict]) -> None:
        function = fragment["function"]
        if "id" in fragment:  # a new call: its id and name
            self._close(events, "completed")
            item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call",
                    "status": "in_progress", "call_id": fragment["id"],
                    "name": function["name"], "arguments": ""}  # fmt: skip
            self.items.append(item)
            self.open = self.calls[fragment["index"]] = item
            events.append({"type": "response.output_item.added",
                           "output_index": len(self.items) - 1, "item": dict(item)})  # fmt: skip
        if function.get("arguments"):
            item = self.calls[fragment["index"]]
            item["arguments"] += function["arguments"]
            events.append({"type": "response.function_call_arguments.delta", **self._at(item),
                           "delta": function["arguments"]})  # fmt: skip

    def _close(self, events: list[dict], status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        at = self._at(item)
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", **at,
                           "name": item["name"], "arguments": item["arguments"]})  # fmt: skip
        else:
            part = item["content"][0]
            if item["type"] == "message":
                part["logprobs"] = self.logprobs or []
                done = {"type": "response.output_text.done", "logprobs": part["logprobs"]}
            else:
                done = {"type": "response.reasoning_text.done"}
            events.append({**done, **at, "content_index": 0, "text": part["text"]})
            events.append({"type": "response.content_part.done", **at, "content_index": 0,
                           "part": dict(part)})  # fmt: skip
        events.append({"type": "response.output_item.done", "output_index": at["output_index"],
                       "item": item})  # fmt: skip

    def assistant_message(self) -> dict:
        """The output as the chat message a follow-up turn's conversation holds."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        thought = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        calls = [
            {"id": i["call_id"], "type": "function",
             "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in self.items if i["type"] == "function_call"
        ]  # fmt: skip
        message: dict = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        if thought:
            message["reasoning_content"] = thought
        return message


class Reply:
    """One Responses request's answer: the response object (in progress, then final) and
    its stream's events with their sequence numbers."""

    def __init__(self, req: ResponsesRequest, head: dict, stream: bool) -> None:
        self.req, self.head, self.stream = req, head, stream
        self.items = Items(req.logprobs())
        self.seq = 0
        self.final: dict | None = None  # the finished response object

    def take(self, body: dict) -> str | None:
        events = self.items.take(body)
        return "".join(self.sse(e) for e in events) if self.stream else None

    def sse(self, event: dict) -> str:
        event = {**event, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def error(self, e: APIError) -> str:
        fields = {"code": e.code or e.type, "message": e.message, "param": e.param}
        return self.sse({"type": "error", **fields})

    def finished(self, usage: dict) -> dict:
        """The final response object: completed, or incomplete when cut short."""
        items = self.items.items
        status = "incomplete" if items and items[-1]["status"] == "incomplete" else "completed"
        out = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},  # not counted
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},  # not counted
            "total_tokens": usage["total_tokens"],
        }
        if "speculative" in usage:
            out["speculative"] = usage["speculative"]
        self.final = self.resource(status, items, out)
        return self.final

    def resource(self, status: str, output: list, usage: dict | None) -> dict:
        req = self.req
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {}
        choice = req.tool_choice
        return {
            "id": self.head["id"], "object": "response", "created_at": self.head["created"],
            "status": status, "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
            "model": self.head["model"], "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning, "service_tier": "default", "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": {"type": "text"}} | text,
            "tool_choice": choice.model_dump(exclude_none=True)
            if isinstance(choice, ToolChoiceObject) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled", "usage": usage, "user": req.user,
        }  # fmt: skip


class _Answer(Answer):
    """serving's Answer of a Responses request: each update's chat delta goes to `reply`
    (the SSE events it makes, when streamed); `whole()` is the response object."""

    reply: Reply
    keep: Callable[[], None]  # stores the finished response (if asked to): set per request

    def opening(self) -> Iterator[str]:
        for kind in ("response.created", "response.in_progress"):
            resource = self.reply.resource("in_progress", [], None)
            yield self.reply.sse({"type": kind, "response": resource})

    def step(self, out, u) -> str | None:
        body = out.feed(u)
        return None if body is None else self.reply.take(body)

    def closing(self) -> Iterator[str]:
        final = self.reply.finished(self.usage_so_far())
        self.keep()
        yield self.reply.sse({"type": f"response.{final['status']}", "response": final})

    def error(self, e: APIError) -> str:
        return self.reply.error(e)

    def end(self) -> str:
        return ""

    def finished(self) -> None:
        self.keep()

    def whole(self) -> bytes:
        return json.dumps(self.reply.finished(self.usage_so_far()), ensure_ascii=False).encode()


# ---- the store -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    response: dict  # what GET answers
    # the conversation it ends, as chat messages (without its instructions); a follow-up's
    # tuple shares these dicts, so a chain of turns holds each message once
    messages: tuple[dict, ...]
    expires: float  # time.monotonic()


class ResponseStore:
    """Stored responses: at most `max_entries` (the oldest dropped first), each for `ttl`
    seconds after it was stored. Kept in the order they were stored, which with one ttl
    is the order they expire in, so expiring looks only at the oldest. Used on the event
    loop only."""

    def __init__(self, max_entries: int, ttl: float, clock=time.monotonic) -> None:
        self.max_entries, self.ttl, self.clock = max_entries, ttl, clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, response: dict, messages: tuple[dict, ...]) -> None:
        self._expire()
        if self.max_entries <= 0:
            return
        self._entries[rid] = Stored(response, messages, self.clock() + self.ttl)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        self._expire()
        return self._entries.get(rid)

    def delete(self, rid: str) -> bool:
        self._expire()
        return self._entries.pop(rid, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            rid, oldest = next(iter(self._entries.items()))
            if oldest.expires > now:
                return
            del self._entries[rid]


# ---- the routes ------------------------------------------------------------------------------


class ResponsesAPI:
    """The routes' state: the server, the store, the hosted tool types already warned of."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        opts = server.opts
        self.store = ResponseStore(opts.responses_store_max, opts.responses_store_ttl)
        self.warned: set[str] = set()

    def warn_tool(self, kind: str) -> None:
        if kind in self.warned or len(self.warned) >= MAX_WARNED_TOOLS:
            return
        self.warned.add(kind)
        logger.warning(
            "tools: ignoring tools of type %r (only function tools run here; logged once)", kind
        )

    def stored(self, rid: str, param: str = "response_id") -> Stored:
        found = self.store.get(rid)
        if found is None:
            msg = (f"{param}: no stored response {rid!r} (never stored, deleted, or older than "
                   f"--responses_store_ttl={self.store.ttl:g} s)")  # fmt: skip
            raise APIError(404, msg, type="NotFoundError", param=param, code="response_not_found")
        return found

    async def create(self, request: Request) -> Response:
        server = self.server
        req = await server.read_body(request, ResponsesRequest)
        history: tuple[dict, ...] = ()
        if req.previous_response_id is not None:
            history = self.stored(req.previous_response_id, "previous_response_id").messages
        chat, new = to_chat(req, history, self.warn_tool)
        try:
            outputs = await chat_outputs(server, chat)
        except APIError as e:
            raise renamed(e) from e
        answer = _Answer.of(server, chat, "response", "resp_", outputs)
        answer.reply = reply = Reply(req, answer.head, req.stream)
        answer.keep = functools.partial(self.keep, reply, (*history, *new))
        return await server.respond(request, req, answer)

    def keep(self, reply: Reply, conversation: tuple[dict, ...]) -> None:
        if reply.req.store and reply.final is not None:
            messages = (*conversation, reply.items.assistant_message())
            self.store.put(reply.final["id"], reply.final, messages)


def routes(server: OpenAIServer) -> APIRouter:
    api = ResponsesAPI(server)
    router = APIRouter()
    found = error_docs(401, 404)

    events = "`event: TYPE` and `data: {...}`: response.created ... response.completed"

    @router.post("/responses", **post_doc(ResponsesRequest, "The response", events=events))
    async def create_response(request: Request):
        return await api.create(request)

    @router.get("/responses/{response_id}", responses=found)
    async def get_response(response_id: str):
        return api.stored(response_id).response

    @router.delete("/responses/{response_id}", responses=found)
    async def delete_response(response_id: str):
        api.stored(response_id)
        api.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    # Starlette's 405 names the methods of the first route matching the path (GET alone)
    @router.api_route("/responses/{response_id}", methods=OTHER_METHODS, include_in_schema=False)
    async def other_method(response_id: str):
        raise StarletteHTTPException(405, headers={"Allow": "GET, DELETE"})

    return router
