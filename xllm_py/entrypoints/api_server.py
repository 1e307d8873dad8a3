"""The OpenAI-compatible REST API (FastAPI), over an AsyncEngine.

    POST /v1/completions        text or token-id prompts (one or a batch), n choices each
    POST /v1/chat/completions   messages rendered with the checkpoint's chat template
    POST /tokenize  POST /detokenize   vLLM's token utilities (count, truncate, decode)
    GET  /v1/models   GET /version   GET /health   GET /metrics   GET /openapi.json

Both POST endpoints stream with `"stream": true` (SSE `data: {...}` chunks, then
`data: [DONE]`). Every error has OpenAI's shape `{"error": {"message", "type",
"param", "code"}}`: 400 bad input, 401 bad key, 404 unknown model or route, 405
wrong method (with `Allow`), 413 oversized body, 429 too many requests in flight, 500
this request failed on its own (the others go on), 503 draining or engine dead.
/openapi.json declares each route's request body and these answers.
A client that goes away (mid-stream or while waiting) aborts its requests, so
their KV blocks are freed at the next engine step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from xllm_py import __version__
from xllm_py.entrypoints import reasoning, tool_parser
from xllm_py.entrypoints.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
    Update,
)
from xllm_py.entrypoints.openai_protocol import (
    ERROR_STATUSES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
    from_validation_error,
)
from xllm_py.entrypoints.server_metrics import CONTENT_TYPE, ServerMetrics
from xllm_py.sampling_params import SamplingParams, StructuredOutput
from xllm_py.structured import after_reasoning, grammars_for

DISCONNECT_POLL_S = 0.2
# A structured-output grammar compiles in this pool, given --grammar_compile_timeout
# (then the request is a 400); one thread: a slow schema delays only other schemas' first
# compile, never the event loop.
_GRAMMAR_POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xllm-grammar")
logger = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    served_model_name: str
    api_key: str | None = None
    max_concurrent_requests: int = 256
    max_request_body_bytes: int = 1 << 20
    strict_request_fields: bool = False  # True: a field the server does not declare is a 400
    reasoning_parser: str = ""  # "deepseek_r1": chat answers split <think> (reasoning.py)
    tool_call_parser: str = ""  # "deepseek_v3": tool calls parsed (tool_parser.py)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" allowed (with a parser)
    grammar_compile_timeout: float = 10.0  # seconds a new grammar may take to compile
    stream_stall_timeout: float = 300.0  # seconds a stream may go unread before its abort


@dataclass
class _Choice:
    index: int
    prompt_index: int
    req_id: str
    text: str | None
    ids: list[int]
    sampling: SamplingParams


class _Slot:
    """One request's place under max_concurrent_requests; released exactly once (by the
    handler, or by the garbage collector, which may run on any thread: hence the lock)."""

    _lock = threading.Lock()

    def __init__(self, server: OpenAIServer, weight: int) -> None:
        self.server, self.weight, self.held = server, weight, True
        with self._lock:
            server.in_flight += weight

    def release(self) -> None:
        with self._lock:
            if self.held:
                self.held = False
                self.server.in_flight -= self.weight


def _internal_error(e: Exception) -> APIError:
    """A 500 for a fault in one request's own handling (RequestFailedError from the engine,
    or an exception here while formatting its answer); logged with its traceback."""
    if not isinstance(e, RequestFailedError):
        logger.error("request failed while formatting its answer: %r", e, exc_info=e)
        e = RequestFailedError(f"request failed: {type(e).__name__}: {e}")
    return APIError(500, str(e), type="server_error")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, opts: ServerOptions, metrics: ServerMetrics) -> None:
        self.engine, self.opts, self.metrics = engine, opts, metrics
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.config.max_model_len
        self.in_flight = 0
        self.warned_fields: set[str] = set()  # unknown request fields already logged

    # ---- request plumbing ----------------------------------------------------------------------

    async def read_body(self, request: Request, model: type[BaseModel]):
        limit = self.opts.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes exceeds {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        try:
            req = model.model_validate_json(b"".join(chunks))
        except ValidationError as e:
            raise from_validation_error(e) from e
        for name in req.unknown_fields(self.opts.strict_request_fields):
            if name not in self.warned_fields:
                self.warned_fields.add(name)
                logger.warning(
                    "ignoring request field %r: neither OpenAI nor vLLM defines it (logged once; "
                    "--strict_request_fields=true refuses such fields)",
                    name,
                )
        req.check_unsupported()
        if req.model is not None and req.model != self.opts.served_model_name:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; this server serves "
                f"{self.opts.served_model_name!r}",
                type="NotFoundError",
                param="model",
                code="model_not_found",
            )
        return req

    def admit(self, n: int) -> None:
        """Room for n more engine requests (choices) under --max_concurrent_requests?"""
        if self.engine.dead is not None:
            raise APIError(503, f"the engine has stopped: {self.engine.dead}", type="server_error")
        if self.engine.draining:
            raise APIError(503, "the server is shutting down", type="server_error")
        if n > self.opts.max_concurrent_requests:
            raise APIError(
                400,
                f"n: {n} choices (prompts x n) exceed max_concurrent_requests="
                f"{self.opts.max_concurrent_requests}",
                param="n",
            )
        if self.in_flight + n > self.opts.max_concurrent_requests:
            raise APIError(
                429,
                f"too many requests in flight ({self.in_flight} of max_concurrent_requests="
                f"{self.opts.max_concurrent_requests}; this one needs {n}); retry later",
                type="rate_limit_error",
            )

    def render_chat(self, req: ChatCompletionRequest | TokenizeRequest) -> str:
        """The messages through the checkpoint's chat template (errors: 400 on messages)."""
        if self.tokenizer is None:
            raise APIError(400, "messages: this checkpoint has no tokenizer", param="messages")
        try:
            return self.tokenizer.apply_chat_template(
                req.message_dicts(),
                add_generation_prompt=req.add_generation_prompt,
                tools=req.tool_dicts(),
                **(req.chat_template_kwargs or {}),
            )
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        except Exception as e:  # a template error is the template's, reported as such
            raise APIError(400, f"messages: chat template failed: {e}", param="messages") from e

    async def tokenize_route(self, request: Request) -> dict:
        req = await self.read_body(request, TokenizeRequest)
        prompt = req.prompt if req.prompt is not None else self.render_chat(req)
        _, ids = self.tokenize(prompt)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        out["token_strs"] = [self._token_str(t) for t in ids] if req.return_token_strs else None
        return out

    async def detokenize_route(self, request: Request) -> dict:
        req = await self.read_body(request, DetokenizeRequest)
        if self.tokenizer is None:
            raise APIError(400, "tokens: this checkpoint has no tokenizer", param="tokens")
        vocab = self.engine.engine.config.model.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            msg = f"tokens: {bad[0]} is not a token id (0..{vocab - 1})"
            raise APIError(400, msg, param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def tokenize(
        self, prompt: str | list[int], truncate: int | None = None
    ) -> tuple[str | None, list[int]]:
        """(text, ids); with `truncate` (truncate_prompt_tokens) only the last ids are kept,
        and the text is then None (the tokens are the prompt)."""
        try:
            if isinstance(prompt, str):
                text, ids = self.engine.engine.tokenize_prompt(prompt)
            else:
                text, ids = None, list(prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e
        if truncate is not None and len(ids) > truncate:
            return None, ids[-truncate:]
        return text, ids

    async def structured(self, req, tools=None) -> StructuredOutput | None:
        """The request's structured-output constraint (or `tools`: (field, the tool-call
        grammar)), applied after the reasoning under --reasoning_parser, compiled once here
        (in a thread, for at most --grammar_compile_timeout: a schema that takes longer is
        refused and the event loop never waits on it); a 400 naming the field if it does not
        compile."""
        found = req.structured_output()
        if found is not None and tools is not None:
            raise APIError(
                400,
                f"{found[0]}: one structured-output constraint per request (tool_choice "
                f"{req.tool_choice if isinstance(req.tool_choice, str) else 'naming a function'}"
                " constrains the output too)",
                param=found[0],
            )
        found = found or tools
        if found is None:
            return None
        field, so = found
        if isinstance(req, ChatCompletionRequest) and self.opts.reasoning_parser:
            try:
                so = after_reasoning(so, reasoning.END)
            except ValueError as e:
                raise APIError(400, f"{field}: {e}", param=field) from e
        cfg = self.engine.engine.config.model
        loop = asyncio.get_running_loop()

        def compile_it() -> None:
            grammars_for(cfg.path, cfg.vocab_size, tuple(cfg.eos_token_ids)).compile(so)

        try:
            await asyncio.wait_for(
                loop.run_in_executor(_GRAMMAR_POOL, compile_it), self.opts.grammar_compile_timeout
            )
        except TimeoutError as e:
            limit = self.opts.grammar_compile_timeout
            msg = f"{field}: took more than {limit:g} s to compile (--grammar_compile_timeout)"
            raise APIError(400, msg, param=field) from e
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", param=field) from e
        return so

    def choices(
        self, req, prompts, max_tokens: int | None, logprobs: int | None, structured=None
    ) -> list[_Choice]:
        base = uuid.uuid4().hex
        out = []
        for pi, prompt in enumerate(prompts):
            text, ids = self.tokenize(prompt, req.truncate_prompt_tokens)
            for i in range(req.n):
                sp = req.sampling(max_tokens, logprobs, i, structured)
                try:  # the engine's checks, the prompt's length against the context included
                    self.engine.engine.validate(ids, sp)
                except ValueError as e:
                    raise APIError.invalid(e) from e
                out.append(_Choice(pi * req.n + i, pi, f"{base}-{pi * req.n + i}", text, ids, sp))
            # The offline API caps max_tokens at the context; an API request asking for more
            # than fits is an error, as OpenAI's API makes it.
            if max_tokens is not None and len(ids) + max_tokens > self.max_model_len:
                raise APIError(
                    400,
                    f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                    f"model's context of {self.max_model_len} tokens",
                    param="max_tokens",
                )
        return out

    async def _merged(self, choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, Update]]:
        """Updates of all choices as they come; closing this aborts the unfinished ones."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                async with contextlib.aclosing(
                    self.engine.generate(c.req_id, c.text, c.ids, c.sampling)
                ) as updates:
                    async for u in updates:
                        queue.put_nowait((c, u))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((c, e))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            remaining = len(choices)
            while remaining:
                c, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    remaining -= 1
                yield c, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- output formatting ---------------------------------------------------------------------

    def _token_str(self, tid: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def completion_logprobs(self, lps: list[dict[int, float] | None], ids: list[int], offset: int):
        """OpenAI's completion `logprobs`; a None entry (the first prompt token under echo:
        nothing comes before it) has null logprobs."""
        tokens = [self._token_str(t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp[t] for lp, t in zip(lps, ids)],
            "top_logprobs": [
                None if lp is None else {self._token_str(k): v for k, v in lp.items()} for lp in lps
            ],
            "text_offset": offsets,
        }

    @staticmethod
    def _top(entry: dict[int, float], token: int, n: int) -> dict[int, float]:
        """`token`'s logprob, then the n largest of `entry` (which may hold more)."""
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
        return {token: entry[token]} | dict(best)

    def echoed(self, c: _Choice, prompt_lps: list | None) -> tuple[str, list | None]:
        """Echo's prefix: the prompt's text and, when logprobs were asked for, its tokens'
        logprob entries (the first None)."""
        text = c.text
        if text is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode(c.ids)
        want = c.sampling.logprobs
        if want is None or prompt_lps is None:
            return text, None
        return text, [None] + [self._top(e, t, want) for e, t in zip(prompt_lps[1:], c.ids[1:])]

    def prompt_logprobs(self, ids: list[int], lps: list, ranks: list[int], n: int) -> list:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or
        {token id: {logprob, rank, decoded_token}}, the prompt's token first, then the top n."""
        out: list = [None]
        for entry, token, rank in zip(lps[1:], ids[1:], ranks):
            top = self._top(entry, token, n)
            out.append(
                {
                    str(t): {
                        "logprob": v,
                        "rank": rank if t == token else 1 + sum(w > v for w in top.values()),
                        "decoded_token": self._token_str(t),
                    }
                    for t, v in top.items()
                }
            )
        return out

    def chat_logprobs(self, lps: list[dict[int, float]], ids: list[int], top: int):
        def entry(t, v):
            s = self._token_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return {
            "content": [
                entry(t, lp[t])
                | {
                    "top_logprobs": [
                        entry(k, v) for k, v in sorted(lp.items(), key=lambda kv: -kv[1])[:top]
                    ]
                }
                for lp, t in zip(lps, ids)
            ]
        }

    # ---- endpoints -----------------------------------------------------------------------------

    async def handle(self, request: Request, chat: bool):
        model = ChatCompletionRequest if chat else CompletionRequest
        req = await self.read_body(request, model)
        self.admit(0)  # draining or dead: refuse before tokenizing anything
        tools = None  # chat: (tool mode, the (field, grammar) of required or named calls)
        if chat:
            mode, named = req.tool_mode(
                self.opts.tool_call_parser, self.opts.enable_auto_tool_choice
            )
            grammar = None
            if mode in ("required", "named"):
                spec = tool_parser.tool_call_grammar(
                    req.tool_dicts(), named, req.parallel_tool_calls
                )
                grammar = ("tool_choice", StructuredOutput("structural_tag", spec))
            tools = (mode, grammar)
            text = self.render_chat(req)
            prompts, limit, logprobs = [text], req.output_limit, req.num_logprobs()
        else:
            prompts, limit, logprobs = req.prompts(), req.max_tokens, req.logprobs
        structured = await self.structured(req, tools and tools[1])
        choices = self.choices(req, prompts, limit, logprobs, structured)
        self.admit(len(choices))  # each choice (prompt x n) is one engine request
        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "created": int(time.time()), "model": self.opts.served_model_name}
        prompt_tokens = sum(len(c.ids) for c in choices if c.index % req.n == 0)
        slot = _Slot(self, len(choices))
        if req.stream:
            opts = req.stream_options
            usage = "" if opts is None or not opts.include_usage else "end"
            if usage and opts.continuous_usage_stats:
                usage = "every chunk"
            gen = self._stream(req, chat, choices, head, kind, prompt_tokens, usage, slot, tools)
            # A stream cancelled before its first chunk never runs its `finally`.
            weakref.finalize(gen, slot.release)
            return StreamingResponse(gen, media_type="text/event-stream")
        try:
            return await self._complete(
                request, req, chat, choices, head, kind, prompt_tokens, tools
            )
        finally:
            slot.release()

    async def _complete(self, request, req, chat, choices, head, kind, prompt_tokens, tools):
        texts = {c.index: "" for c in choices}
        ids: dict[int, list[int]] = {c.index: [] for c in choices}
        lps: dict[int, list] = {c.index: [] for c in choices}
        last: dict[int, Update] = {}
        prompt: dict[int, Update] = {}  # the update that carried the prompt logprobs

        async def collect() -> None:
            async with contextlib.aclosing(self._merged(choices)) as merged:
                async for c, u in merged:
                    texts[c.index] = u.text
                    ids[c.index] += u.new_token_ids
                    lps[c.index] += u.new_logprobs or []
                    last[c.index] = u
                    if u.prompt_logprobs is not None:
                        prompt[c.index] = u

        task = asyncio.create_task(collect())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not done and await request.is_disconnected():
                    task.cancel()  # aborts every choice; nobody is listening
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return Response(status_code=499)
            task.result()
        except (EngineDeadError, RequestAbortedError) as e:
            raise APIError(503, str(e), type="server_error") from e
        except RequestFailedError as e:
            raise APIError(500, str(e), type="server_error") from e
        finally:
            task.cancel()
        out_choices = []
        scored = {}  # vLLM's prompt_logprobs, per choice
        for c in sorted(choices, key=lambda c: c.index):
            u, p = last[c.index], prompt.get(c.index)
            entry = {"index": c.index, "finish_reason": u.finish_reason}
            want = c.sampling.logprobs
            if req.prompt_logprobs is not None and p is not None:
                scored[c.index] = self.prompt_logprobs(
                    c.ids, p.prompt_logprobs, p.prompt_ranks, req.prompt_logprobs
                )
            if chat:
                entry["message"] = {"role": "assistant", "content": texts[c.index]}
                if self.opts.reasoning_parser:
                    thought, answer = reasoning.split(texts[c.index])
                    entry["message"] |= {"content": answer, "reasoning_content": thought}
                if tools[0] != "none":
                    content, calls = tool_parser.parse(
                        entry["message"]["content"] or "", req.parallel_tool_calls
                    )
                    if calls:
                        entry["message"]["content"] = content
                        entry["message"]["tool_calls"] = [call.openai() for call in calls]
                        if u.finish_reason == "stop":
                            entry["finish_reason"] = "tool_calls"
                entry["logprobs"] = (
                    None if want is None else self.chat_logprobs(lps[c.index], ids[c.index], want)
                )
            else:
                text, token_ids, entries = texts[c.index], ids[c.index], lps[c.index]
                if req.echo:
                    echo_text, echo_lps = self.echoed(c, p and p.prompt_logprobs)
                    text = echo_text + text
                    if echo_lps is not None:
                        token_ids, entries = c.ids + token_ids, echo_lps + entries
                entry["text"] = text
                entry["logprobs"] = (
                    None if want is None else self.completion_logprobs(entries, token_ids, 0)
                )
                if c.index in scored:
                    entry["prompt_logprobs"] = scored[c.index]
            entry["stop_reason"] = u.stop_reason
            out_choices.append(entry)
        completion_tokens = sum(len(v) for v in ids.values())
        if chat and scored:  # vLLM: one list for the request (every choice has its prompt)
            head = {**head, "prompt_logprobs": scored[min(scored)]}
        return {
            **head,
            "object": kind,
            "choices": out_choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    async def _stream(self, req, chat, choices, head, kind, prompt_tokens, usage, slot, tools):
        """usage: "" none, "end" a usage chunk at the end (include_usage), "every chunk"
        also the usage so far in every chunk (continuous_usage_stats); tools: as `handle`
        found them (chat only)."""
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        sent = {c.index: 0 for c in choices}  # characters of text already streamed
        # chat with --reasoning_parser: each choice's text split into reasoning and answer
        parse = chat and self.opts.reasoning_parser
        splitters = {c.index: reasoning.StreamSplitter() for c in choices} if parse else {}
        # chat with tool calls: each choice's answer read for them
        calls = (
            {c.index: tool_parser.ToolCallStream(req.parallel_tool_calls) for c in choices}
            if chat and tools[0] != "none"
            else {}
        )
        # completions with echo: the prompt goes first, in the choice's first chunk
        echo_pending = {c.index for c in choices} if not chat and req.echo else set()
        offsets = {c.index: 0 for c in choices}
        completion_tokens = 0

        def usage_so_far() -> dict:
            return {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }

        def chunk(choice: dict) -> str:
            body = {**head, "object": chunk_kind, "choices": [choice]}
            if usage == "every chunk":
                body["usage"] = usage_so_far()
            return _sse(body)

        try:
            if chat:
                for c in choices:
                    yield chunk(
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
            async with contextlib.aclosing(self._merged(choices)) as merged:
                async for c, u in merged:
                    completion_tokens += len(u.new_token_ids)
                    # Hold back what could still turn out to be the start of a stop string.
                    hold = (
                        0
                        if u.finished or not c.sampling.stop
                        else max(map(len, c.sampling.stop)) - 1
                    )
                    upto = max(sent[c.index], len(u.text) - hold)
                    delta = u.text[sent[c.index] : upto]
                    sent[c.index] = upto
                    new_lps, new_ids = u.new_logprobs, u.new_token_ids
                    if c.index in echo_pending:
                        echo_pending.discard(c.index)
                        echo_text, echo_lps = self.echoed(c, u.prompt_logprobs)
                        delta = echo_text + delta
                        if echo_lps is not None:
                            new_lps, new_ids = echo_lps + (new_lps or []), c.ids + new_ids
                    if not delta and not u.finished and not new_lps:
                        continue
                    want = c.sampling.logprobs
                    lp = None
                    if want is not None and new_lps:
                        lp = (
                            self.chat_logprobs(new_lps, new_ids, want)
                            if chat
                            else self.completion_logprobs(new_lps, new_ids, offsets[c.index])
                        )
                        offsets[c.index] += sum(len(t) for t in lp.get("tokens", []))
                    body = {"index": c.index, "logprobs": lp, "finish_reason": u.finish_reason}
                    if chat:
                        thought, answer = "", delta
                        if c.index in splitters:
                            thought, answer = splitters[c.index].feed(delta, final=u.finished)
                        body["delta"] = {"reasoning_content": thought} if thought else {}
                        if c.index in calls:
                            body["delta"] |= calls[c.index].feed(answer, final=u.finished)
                            if u.finish_reason == "stop" and calls[c.index].calls:
                                body["finish_reason"] = "tool_calls"
                        elif answer:
                            body["delta"]["content"] = answer
                        if not body["delta"] and not u.finished and lp is None:
                            continue  # all of it held back (a tag or a call's header)
                    else:
                        body["text"] = delta
                    if u.finished:
                        body["stop_reason"] = u.stop_reason
                    yield chunk(body)
            if usage:
                yield _sse({**head, "object": chunk_kind, "choices": [], "usage": usage_so_far()})
        except (EngineDeadError, RequestAbortedError) as e:
            yield _sse(APIError(503, str(e), type="server_error").body())
        except APIError as e:
            yield _sse(e.body())
        except Exception as e:  # noqa: BLE001 - this request's fault: it ends, the rest go on
            yield _sse(_internal_error(e).body())
        finally:
            slot.release()
        yield "data: [DONE]\n\n"


def _errors(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": ERROR_STATUSES[s]} for s in statuses}


def _post_doc(body: type[BaseModel], what: str, stream: bool = True) -> dict:
    """Route arguments that document a POST route whose body the handler validates itself:
    the request body's schema (added to the components by `_openapi`) and every answer."""
    return {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{body.__name__}"}
                    }
                },
            }
        },
        "responses": {
            200: {
                "description": f"{what}: one JSON object, or with `stream: true` server-sent "
                "events (`data: {...}` chunks, then `data: [DONE]`)",
                "content": {"application/json": {}, "text/event-stream": {}},
            }
            if stream
            else {"description": what, "content": {"application/json": {}}},
            **_errors(400, 401, 404, 413, 429, 500, 503),
        },
    }


def _openapi(app: FastAPI, max_model_len: int) -> dict:
    """FastAPI's document plus the request bodies' JSON schemas, with the token limits
    this server enforces, so generated clients and fuzzers see what is accepted."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            for name in ("max_tokens", "max_completion_tokens"):  # larger never fits
                if name in body["properties"]:
                    for option in body["properties"][name].get("anyOf", []):
                        if option.get("type") == "integer":
                            option["maximum"] = max_model_len
            components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(engine: AsyncEngine, opts: ServerOptions, metrics: ServerMetrics) -> FastAPI:
    app = FastAPI(
        title="xllm-py",
        description="OpenAI-compatible serving of DeepSeek-V3-family models with MTP.",
    )
    server = OpenAIServer(engine, opts, metrics)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, e: ClientDisconnect):
        return Response(status_code=499)  # the client left before its body arrived: no one to tell

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        return JSONResponse(_internal_error(e).body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(  # e.headers carries a 405's Allow
            APIError(e.status_code, str(e.detail), type=kind).body(),
            status_code=e.status_code,
            headers=e.headers,
        )

    app.openapi = lambda: _openapi(app, server.max_model_len)

    def check_key(request: Request) -> None:
        if opts.api_key and request.headers.get("authorization") != f"Bearer {opts.api_key}":
            raise APIError(
                401,
                "missing or wrong API key (send 'Authorization: Bearer KEY')",
                type="authentication_error",
                code="invalid_api_key",
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.post("/completions", **_post_doc(CompletionRequest, "The completion"))
    async def completions(request: Request):
        return await server.handle(request, chat=False)

    @v1.post("/chat/completions", **_post_doc(ChatCompletionRequest, "The chat completion"))
    async def chat_completions(request: Request):
        return await server.handle(request, chat=True)

    @v1.get("/models", responses=_errors(401))
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": opts.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "xllm-py",
                    "max_model_len": server.max_model_len,
                }
            ],
        }

    app.include_router(v1)

    # vLLM's token utilities, at the root as vLLM serves them
    keyed = [Depends(check_key)]

    @app.post(
        "/tokenize",
        dependencies=keyed,
        **_post_doc(TokenizeRequest, "`count`, `max_model_len`, `tokens`", stream=False),
    )
    async def tokenize(request: Request):
        return await server.tokenize_route(request)

    @app.post(
        "/detokenize",
        dependencies=keyed,
        **_post_doc(DetokenizeRequest, "`prompt`: the text of the ids", stream=False),
    )
    async def detokenize(request: Request):
        return await server.detokenize_route(request)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health", responses={503: {"description": "Draining, or the engine stopped"}})
    async def health():
        if engine.dead is not None:
            return JSONResponse({"status": "dead", "error": str(engine.dead)}, status_code=503)
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
    )
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
