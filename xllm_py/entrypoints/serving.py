"""What chat and completions share: reading and admitting a request, preparing its
prompts, and delivering its answer, whole or streamed.

    body ─read_body─▶ request model ─admit─▶ prompts (tokenised off the event loop)
         ─choices─▶ Choice per (prompt, n) ─respond─▶ engine updates, merged per request
         ─ChoiceOutput.feed─▶ SSE chunks (stream) | one JSON body (whole, built off the loop)

Work that grows with the input (tokenising, chat templates, logprob formatting, the
JSON of a whole answer) runs in a small thread pool, never on the event loop, so one
large request does not stall every open stream. A stream's every send must finish
within --stream_stall_timeout: a client that stops reading for that long has its
requests aborted (`StallGuardedStream`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jinja2
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from xllm_py.engine.engine_client import (
    EngineClient,
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
    Update,
)
from xllm_py.engine.metrics import ServerMetrics
from xllm_py.entrypoints.choice_output import Choice, ChoiceOutput, Formatter
from xllm_py.entrypoints.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    TokenizeRequest,
    from_validation_error,
)
from xllm_py.formats import encodings, reasoning
from xllm_py.sampling_params import StructuredOutput
from xllm_py.structured import (
    GrammarCompileTimeout,
    after_reasoning,
    grammars_for,
    in_daemon_thread,
)

DISCONNECT_POLL_S = 0.2
MAX_WARNED_FIELDS = 256  # unknown field names remembered (and logged once each)
INLINE_COST = 256  # token decodes an update may cost on the event loop; more go to the pool
# Tokenising, chat templates, logprob formatting and whole answers' JSON: bounded, so a
# burst of large requests queues here instead of starving the engine thread of CPU.
_PREP_POOL = concurrent.futures.ThreadPoolExecutor(
    min(4, os.cpu_count() or 1), thread_name_prefix="xllm-prep"
)
logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ServerOptions:
    served_model_name: str
    api_key: str | None = None
    max_concurrent_requests: int = 256
    max_request_body_bytes: int = 1 << 20
    strict_request_fields: bool = False  # True: a field the server does not declare is a 400
    reasoning_parser: str = ""  # "deepseek_r1": chat answers split <think> (reasoning.py)
    tool_call_parser: str = ""  # "deepseek_v3": tool calls parsed (tool_parser.py)
    chat_template: str = "auto"  # or an encoding of formats/encodings.py (DeepSeek-V3.2, V4)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" allowed (with a parser)
    grammar_compile_timeout: float = 10.0  # seconds a new grammar may take to compile
    stream_stall_timeout: float = 300.0  # seconds a stream may go unread before its abort
    # usage.speculative {draft_tokens, accepted_tokens} in answers: --report_speculative_usage
    # with MTP on (serve.server_options)
    report_speculative_usage: bool = False
    # the Responses API's store (responses.py): --responses_store_max, --responses_store_ttl
    responses_store_max: int = 1000
    responses_store_ttl: float = 3600.0


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


@dataclass
class Answer:
    """One API request's answer in the making: its choices' outputs (index order) and
    what every chunk or body carries."""

    kind: str  # "chat.completion" | "text_completion"
    head: dict  # id, created, model
    outputs: list[ChoiceOutput]
    prompt_tokens: int
    usage: str  # "" none, "end" a usage chunk at the end, "every chunk" also on every chunk
    prompt_logprobs_at_top: bool = False  # chat: vLLM's prompt_logprobs once, for the request
    speculative: bool = False  # usage carries `speculative` (--report_speculative_usage)
    chunk_kind: str = field(init=False)

    def __post_init__(self) -> None:
        self.chunk_kind = "chat.completion.chunk" if self.kind == "chat.completion" else self.kind

    @classmethod
    def of(cls, server: OpenAIServer, req, kind: str, prefix: str, outputs: list) -> Answer:
        head = {
            "id": prefix + uuid.uuid4().hex,
            "created": int(time.time()),
            "model": server.opts.served_model_name,
        }
        prompt_tokens = sum(len(o.choice.ids) for o in outputs if o.index % req.n == 0)
        opts, usage = req.stream_options, ""
        if req.stream and opts is not None and opts.include_usage:
            usage = "every chunk" if opts.continuous_usage_stats else "end"
        speculative = server.opts.report_speculative_usage
        return cls(kind, head, outputs, prompt_tokens, usage, speculative=speculative)

    def usage_so_far(self) -> dict:
        """OpenAI's usage, and with MTP on (and --report_speculative_usage) `speculative`:
        the draft tokens verified and accepted, summed over the choices."""
        completion = sum(o.tokens for o in self.outputs)
        usage: dict = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
        if self.speculative:
            usage["speculative"] = {
                "draft_tokens": sum(o.draft_tokens for o in self.outputs),
                "accepted_tokens": sum(o.accepted_tokens for o in self.outputs),
            }
        return usage

    def chunk(self, choice: dict) -> str:
        body = {**self.head, "object": self.chunk_kind, "choices": [choice]}
        if self.usage == "every chunk":
            body["usage"] = self.usage_so_far()
        return _sse(body)

    # ---- what a stream sends (serving.stream drives these; each API overrides them) -------

    def opening(self) -> Iterator[str]:
        """Before the first update: chat's role chunks (one per choice that has one)."""
        for out in self.outputs:
            opening = out.opening()
            if opening is not None:
                yield self.chunk(opening)

    def step(self, out: ChoiceOutput, u: Update) -> str | None:
        """`out` takes in `u`: the SSE chunk to send, if any."""
        body = out.feed(u)
        return None if body is None else self.chunk(body)

    def closing(self) -> Iterator[str]:
        """After the last update: the usage chunk, when asked for."""
        if self.usage:
            usage = {"choices": [], "usage": self.usage_so_far()}
            yield _sse({**self.head, "object": self.chunk_kind, **usage})

    def error(self, e: APIError) -> str:
        """The event that ends a stream whose request failed on the way."""
        return _sse(e.body())

    def end(self) -> str:
        """After everything, error or not: OpenAI's `[DONE]` (other APIs: nothing)."""
        return "data: [DONE]\n\n"

    def finished(self) -> None:
        """The answer is complete (streamed to its end, or whole): the Responses API keeps it."""

    def whole(self) -> bytes:
        """The JSON of the whole answer (after every update was fed)."""
        head = dict(self.head)
        choices = [o.final() for o in self.outputs]
        if self.prompt_logprobs_at_top:  # vLLM: one list (every choice has the same prompt)
            scored = self.outputs[0].scored()
            if scored is not None:
                head["prompt_logprobs"] = scored
                for c in choices:
                    c.pop("prompt_logprobs", None)
        body = {**head, "object": self.kind, "choices": choices, "usage": self.usage_so_far()}
        return json.dumps(body, ensure_ascii=False).encode()


class StallGuardedStream(StreamingResponse):
    """Server-sent events whose every send must finish within `stall_timeout` seconds.
    A send waits while the client's TCP window is closed and uvicorn's write buffer is
    full: a client that reads nothing for that long has its stream ended. The answer's
    generator is closed (its engine requests are aborted, their blocks freed), one
    warning is logged, and what the client may still read ends with an error event and
    [DONE]. Until then the engine merges output the stream has not taken (async_engine),
    so a stalled stream holds one merged update, not a queue of them."""

    def __init__(self, content: AsyncIterator[str], stall_timeout: float, name: str) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.stall_timeout, self.name = stall_timeout, name

    async def stream_response(self, send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send(start | {"headers": self.raw_headers})
        async for chunk in self.body_iterator:
            body = {"type": "http.response.body", "body": chunk.encode(), "more_body": True}
            try:
                await asyncio.wait_for(send(body), self.stall_timeout)
            except TimeoutError:
                await self._stalled(send)
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stalled(self, send) -> None:
        logger.warning(
            "%s: the client read nothing for %g s (--stream_stall_timeout); its requests "
            "are aborted",
            self.name,
            self.stall_timeout,
        )
        await self.body_iterator.aclose()  # type: ignore[attr-defined]
        msg = f"stream unread for {self.stall_timeout:g} s (--stream_stall_timeout): aborted"
        err = APIError(503, msg, type="server_error", code="stream_stalled")
        tail = (_sse(err.body()) + "data: [DONE]\n\n").encode()
        await send({"type": "http.response.body", "body": tail, "more_body": False})


class OpenAIServer:
    """The server's state and the steps chat.py and completions.py are made of."""

    def __init__(self, engine: EngineClient, opts: ServerOptions, metrics: ServerMetrics) -> None:
        self.engine, self.opts, self.metrics = engine, opts, metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.formatter = Formatter(self.tokenizer)
        self.in_flight = 0
        self.warned_fields: set[str] = set()  # unknown request fields already logged

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the preparation pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(_PREP_POOL, fn, *args)

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
            req = await self.run_blocking(model.model_validate_json, b"".join(chunks))
        except ValidationError as e:
            raise from_validation_error(e) from e
        self._warn_unknown(req.unknown_fields(self.opts.strict_request_fields))
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

    def _warn_unknown(self, names: list[str]) -> None:
        for name in names:
            if name in self.warned_fields or len(self.warned_fields) >= MAX_WARNED_FIELDS:
                continue  # logged before, or enough names logged (a client inventing names)
            self.warned_fields.add(name)
            logger.warning(
                "ignoring request field %r: neither OpenAI nor vLLM defines it (logged once; "
                "--strict_request_fields=true refuses such fields)",
                name,
            )

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
        """The messages through the checkpoint's chat template, or a DeepSeek encoding
        (formats/encodings.py: --chat_template) (errors: 400 on messages). Blocking: call
        it through run_blocking."""
        if self.tokenizer is None:
            raise APIError(400, "messages: this checkpoint has no tokenizer", param="messages")
        own = bool(self.tokenizer.chat_template)
        render = encodings.encoder(self.opts.chat_template, self.engine.model_config.raw, own)
        if render is not None:
            try:
                return render(
                    req.message_dicts(), req.tool_dicts(), req.chat_template_kwargs,
                    req.add_generation_prompt,
                )  # fmt: skip
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from e
        try:
            return self.tokenizer.apply_chat_template(
                req.message_dicts(),
                add_generation_prompt=req.add_generation_prompt,
                tools=req.tool_dicts(),
                **(req.chat_template_kwargs or {}),
            )
        except ValueError as e:  # no template, or the sandbox refused it
            raise APIError(400, str(e), param="messages") from e
        # what a template's own code can raise on these messages (raise_exception included)
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise APIError(400, f"messages: chat template failed: {e}", param="messages") from e

    def tokenize(
        self, prompt: str | list[int], truncate: int | None = None
    ) -> tuple[str | None, list[int]]:
        """(text, ids); with `truncate` (truncate_prompt_tokens) only the last ids are kept,
        and the text is then None (the tokens are the prompt). Blocking."""
        try:
            if isinstance(prompt, str):
                text, ids = self.engine.tokenize_prompt(prompt)
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
        (off the event loop, in a compile process stopped after --grammar_compile_timeout:
        a schema that takes longer is refused, and the next one compiles in a fresh
        process); a 400 naming the field if it does not compile."""
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
        parser = self.opts.reasoning_parser
        if (
            isinstance(req, ChatCompletionRequest)
            and parser
            and reasoning.thinks(parser, req.chat_template_kwargs)
        ):
            try:
                so = after_reasoning(so, reasoning.END)
            except ValueError as e:
                raise APIError(400, f"{field}: {e}", param=field) from e
        cfg = self.engine.model_config
        limit = self.opts.grammar_compile_timeout

        def compile_it() -> None:
            grammars_for(cfg.path, cfg.vocab_size, tuple(cfg.eos_token_ids)).compile(so, limit)

        try:
            await in_daemon_thread(compile_it)
        except GrammarCompileTimeout as e:
            msg = f"{field}: took more than {limit:g} s to compile (--grammar_compile_timeout)"
            raise APIError(400, msg, param=field) from e
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", param=field) from e
        return so

    def choices(
        self, req, prompts, max_tokens: int | None, logprobs: int | None, structured=None
    ) -> list[Choice]:
        """One Choice per (prompt, n), tokenised and checked by the engine. Blocking."""
        base = uuid.uuid4().hex
        out = []
        for pi, prompt in enumerate(prompts):
            text, ids = self.tokenize(prompt, req.truncate_prompt_tokens)
            for i in range(req.n):
                sp = req.sampling(max_tokens, logprobs, i, structured)
                try:  # the engine's checks, the prompt's length against the context included
                    self.engine.validate(ids, sp)
                except ValueError as e:
                    raise APIError.invalid(e) from e
                out.append(Choice(pi * req.n + i, pi, f"{base}-{pi * req.n + i}", text, ids, sp))
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

    # ---- answers -------------------------------------------------------------------------------

    async def merged(self, outputs: list[ChoiceOutput]) -> AsyncIterator[tuple[ChoiceOutput, Any]]:
        """Updates of all choices as they come; closing this aborts the unfinished ones.
        Each choice's pump holds at most one update while the queue (one place per choice)
        is full, so a reader that stops reading leaves the rest merged in the engine."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(outputs))

        async def pump(out: ChoiceOutput) -> None:
            c = out.choice
            try:
                async with contextlib.aclosing(
                    self.engine.generate(c.req_id, c.text, c.ids, c.sampling)
                ) as updates:
                    async for u in updates:
                        await queue.put((out, u))
            except Exception as e:  # noqa: BLE001 - whatever ended this choice: the reader answers it
                await queue.put((out, e))

        tasks = [asyncio.create_task(pump(o)) for o in outputs]
        try:
            remaining = len(outputs)
            while remaining:
                out, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    remaining -= 1
                yield out, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def step(self, answer: Answer, out: ChoiceOutput, u: Update) -> str | None:
        """answer.step, on the event loop when it is cheap, else in the pool."""
        if out.cost(u) <= INLINE_COST:
            return answer.step(out, u)
        return await self.run_blocking(answer.step, out, u)

    async def respond(self, request: Request, req, answer: Answer) -> Response:
        slot = _Slot(self, len(answer.outputs))
        if req.stream:
            gen = self.stream(answer, slot)
            # A stream cancelled before its first chunk never runs its `finally`.
            weakref.finalize(gen, slot.release)
            timeout = self.opts.stream_stall_timeout
            return StallGuardedStream(gen, timeout, answer.head["id"])
        try:
            response = await self.whole(request, answer)
        finally:
            slot.release()
        answer.finished()
        return response

    async def whole(self, request: Request, answer: Answer) -> Response:
        async def collect() -> None:
            async with contextlib.aclosing(self.merged(answer.outputs)) as merged:
                async for out, u in merged:
                    await self.step(answer, out, u)

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
        body = await self.run_blocking(answer.whole)
        return Response(body, media_type="application/json")

    async def stream(self, answer: Answer, slot: _Slot) -> AsyncIterator[str]:
        """Every API's stream: the answer's opening, its merged updates' events, its
        closing; a failure on the way ends it with the answer's error event; the slot is
        released at the end whatever happened."""
        try:
            for piece in answer.opening():
                yield piece
            async with contextlib.aclosing(self.merged(answer.outputs)) as merged:
                async for out, u in merged:
                    piece = await self.step(answer, out, u)
                    if piece:
                        yield piece
            for piece in answer.closing():
                yield piece
        except (EngineDeadError, RequestAbortedError) as e:
            yield answer.error(APIError(503, str(e), type="server_error"))
        except APIError as e:
            yield answer.error(e)
        except Exception as e:  # noqa: BLE001 - this request's fault: it ends, the rest go on
            yield answer.error(_internal_error(e))
        finally:
            slot.release()
        if end := answer.end():
            yield end
