"""The engine on its own thread, for the HTTP server's event loop.

    handler (event loop)                     engine thread
    ------------------------------------    ------------------------------------
    tokenize + validate (ValueError: 400)
    submit -> pending queue  ─────────────> admit, step(), step(), ...
    async for update in stream  <────────── per-request asyncio.Queue (thread-safe put)
    disconnect / cancel -> abort queue ───> abort_request: blocks freed

The loop never blocks the event loop: model steps run here, and results cross
over with `loop.call_soon_threadsafe`. A failure in one request's own work (adding
it, its output processing) fails that request only, with RequestFailedError; the
others go on. If a step raises, the engine is dead: every in-flight request gets an
EngineDeadError, `dead` is set (so /health answers 503) and `on_failure` is called
(the server then exits non-zero).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.engine.outputs import RequestOutput
from xllm_py.engine.scheduler import SchedulerStats
from xllm_py.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05


class EngineDeadError(RuntimeError):
    """The engine loop stopped with an error; no request can complete."""


class RequestFailedError(RuntimeError):
    """Handling this request's own data raised; it was ended, the engine goes on."""


class RequestAbortedError(RuntimeError):
    """The server ended the request before it finished (shutdown); the message says why."""


@dataclass(frozen=True)
class Update:
    """What one engine step produced for one request (immutable: it crosses threads)."""

    text: str  # the whole output text so far (stop strings already cut)
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    # in the first update after the prompt was computed, when prompt_logprobs were asked
    # for (RequestOutput.prompt_logprobs and prompt_ranks)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestRecord:
    """Per-request timing, kept by the engine thread for the Prometheus histograms."""

    arrival: float
    num_prompt_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class EngineEvents:
    """Hooks the metrics layer implements; all are called on the engine thread."""

    on_scheduled: Callable[[RequestRecord, float], None] = lambda rec, now: None
    on_tokens: Callable[[RequestRecord, int, float], None] = lambda rec, n, now: None
    on_finished: Callable[[RequestRecord, str, float], None] = lambda rec, reason, now: None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    record: RequestRecord
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_prompt_logprobs: bool = False


@dataclass
class _Pending:
    req_id: str
    text: str | None
    ids: list[int]
    sampling: SamplingParams
    stream: _Stream = field(repr=False)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        events: EngineEvents | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.events = events or EngineEvents()
        self.on_failure = on_failure
        self.dead: BaseException | None = None
        self.draining = False
        self.closed: str | None = None  # set by abort_all: later requests are refused too
        self.stats: SchedulerStats = engine.core.stats()  # refreshed after every step
        self._lock = threading.Lock()
        self._pending: deque[_Pending] = deque()
        self._aborts: deque[tuple[str, RequestRecord]] = deque()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xllm-engine", daemon=True)

    # ---- event-loop side --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    async def generate(
        self, req_id: str, text: str | None, ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[Update]:
        """Updates for one request until it finishes. Closing the iterator early (client
        gone, task cancelled) aborts the request and frees its blocks."""
        stream = _Stream(
            asyncio.get_running_loop(), asyncio.Queue(), RequestRecord(time.monotonic(), len(ids))
        )
        with self._lock:  # `dead` is set under the same lock, so no request slips past _die
            if self.dead is not None:
                raise EngineDeadError(f"the engine has stopped: {self.dead}")
            if self.closed is not None:
                raise RequestAbortedError(self.closed)
            if req_id in self._streams:
                raise ValueError(f"request id {req_id!r} is already in flight")
            self._streams[req_id] = stream
            self._pending.append(_Pending(req_id, text, ids, sampling, stream))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(req_id)

    def abort(self, req_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(req_id, None)
            if stream is None:
                return  # finished, or already aborted
            self._aborts.append((req_id, stream.record))
        self._wake.set()

    def abort_all(self, why: str) -> int:
        """End every unfinished request: its handler gets RequestAbortedError(why), its
        blocks are freed at the next step; requests submitted later get the same error.
        Returns how many were ended."""
        with self._lock:
            self.closed = why
            streams, self._streams = dict(self._streams), {}
            self._aborts.extend((req_id, s.record) for req_id, s in streams.items())
        for s in streams.values():
            s.loop.call_soon_threadsafe(s.queue.put_nowait, RequestAbortedError(why))
        self._wake.set()
        return len(streams)

    # ---- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._admit()
                if self.engine.has_unfinished():
                    started = time.monotonic()
                    outs = self.engine.step()
                    # Stats first: a /metrics scrape made after a client got its last token
                    # must count the step that produced it.
                    self.stats = self.engine.core.stats()
                    self._publish(outs, started)
                else:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    self.stats = self.engine.core.stats()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine step failed; failing every in-flight request")
            self._die(e)

    def _admit(self) -> None:
        with self._lock:
            pending, self._pending = list(self._pending), deque()
            aborts, self._aborts = dict(self._aborts), deque()
        for p in pending:
            if p.req_id in aborts:  # cancelled before it reached the engine
                continue
            try:
                self.engine.add_tokenized(p.req_id, p.text, p.ids, p.sampling, validated=True)
            except Exception as e:  # noqa: BLE001 - this request's fault, not the engine's
                out = self.engine.fail_request(p.req_id, e)
                self._fail(p.req_id, p.stream, out.error if out else f"{type(e).__name__}: {e}")
        now = time.monotonic()
        for req_id, record in aborts.items():
            self.engine.abort_request(req_id)  # frees its blocks; a no-op if never admitted
            self.events.on_finished(record, "abort", now)

    def _publish(self, outs: list[RequestOutput], step_start: float) -> None:
        now = time.monotonic()
        sched = self.engine.core.requests
        advanced = {out.request_id for out in outs}  # (a prompt done in one step included)
        with self._lock:
            streams = dict(self._streams)
        for req_id, s in streams.items():
            rec = s.record
            computed = req_id in sched and sched[req_id].num_computed_tokens
            if rec.scheduled is None and (req_id in advanced or computed):
                rec.scheduled = step_start  # its first tokens were computed in this step
                self.events.on_scheduled(rec, step_start)
        for out in outs:
            s = streams.get(out.request_id)
            if s is None:
                continue  # aborted meanwhile
            if out.error is not None:
                self._fail(out.request_id, s, out.error)
                continue
            c = out.outputs[0]
            new = c.token_ids[s.sent_tokens :]
            logprobs = None
            if c.logprobs is not None:
                logprobs = c.logprobs[s.sent_logprobs :]
                s.sent_logprobs = len(c.logprobs)
            s.sent_tokens = len(c.token_ids)
            if new:
                self.events.on_tokens(s.record, len(new), now)
            upd = Update(c.text, new, logprobs, c.finish_reason, c.stop_reason)
            if out.prompt_logprobs is not None and not s.sent_prompt_logprobs:
                s.sent_prompt_logprobs = True
                upd = dataclasses.replace(
                    upd, prompt_logprobs=out.prompt_logprobs, prompt_ranks=out.prompt_ranks
                )
            if upd.finished:
                self.events.on_finished(s.record, c.finish_reason, now)
                with self._lock:
                    self._streams.pop(out.request_id, None)
            s.loop.call_soon_threadsafe(s.queue.put_nowait, upd)

    def _fail(self, req_id: str, s: _Stream, error: str) -> None:
        """One request failed on its own: its handler gets RequestFailedError."""
        self.events.on_finished(s.record, "error", time.monotonic())
        with self._lock:
            self._streams.pop(req_id, None)
        s.loop.call_soon_threadsafe(
            s.queue.put_nowait, RequestFailedError(f"request {req_id} failed: {error}")
        )

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self.dead = error
            streams, self._streams = dict(self._streams), {}
        for s in streams.values():
            s.loop.call_soon_threadsafe(
                s.queue.put_nowait, EngineDeadError(f"the engine failed: {error}")
            )
        if self.on_failure is not None:
            self.on_failure(error)
