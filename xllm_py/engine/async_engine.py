"""The engine on its own thread, for the HTTP server's event loop.

    handler (event loop)                     engine thread
    ------------------------------------    ------------------------------------
    tokenize + validate (ValueError: 400)
    submit -> pending queue  ─────────────> admit, step(), step(), ...
    async for update in stream  <────────── per-request slot: ONE pending Update,
                                            newer output merged into it
    disconnect / cancel -> abort queue ───> abort_request: blocks freed

The loop never blocks the event loop: model steps run here, and results cross
over through each request's slot (a lock, and `loop.call_soon_threadsafe` to wake
the reader only when the slot goes from empty to full). A reader that falls behind
(a stalled stream) therefore holds one merged Update, as large as the output it has
not read, however many steps ran meanwhile. A failure in one request's own work (adding
it, its output processing) fails that request only, with RequestFailedError; the
others go on. If a step raises, the engine is dead: every in-flight request gets an
EngineDeadError, `dead` is set (so /health answers 503) and `on_failure` is called
(the server then exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from xllm_py.config import ModelConfig
from xllm_py.engine.engine_client import (
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
    Update,
)
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.engine.outputs import CompletionOutput, RequestOutput
from xllm_py.engine.scheduler import SchedulerStats
from xllm_py.engine.tokenizer import Tokenizer
from xllm_py.pd.compat import CHOSEN_PREFILL
from xllm_py.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineEvents",
    "RequestAbortedError",
    "RequestFailedError",
    "RequestRecord",
    "Update",
]

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05


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


class _Merged:
    """Updates a reader has not taken yet, merged in place: each merge costs the size of
    what it adds, so a reader that falls far behind costs O(output) in all, not
    O(output^2) (a new Update per merge would copy everything pending)."""

    def __init__(self, first: Update) -> None:
        self.texts = [first.delta_text]
        self.ids = list(first.new_token_ids)
        self.logprobs = None if first.new_logprobs is None else list(first.new_logprobs)
        self.last = first  # finish and stop reasons come from the latest
        self.prompt = first if first.prompt_logprobs is not None else None  # the one with them

    def add(self, later: Update) -> None:
        self.texts.append(later.delta_text)
        self.ids += later.new_token_ids
        if later.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.new_logprobs)
        self.last = later
        if self.prompt is None and later.prompt_logprobs is not None:
            self.prompt = later

    def update(self) -> Update:
        p = self.prompt
        return Update(
            "".join(self.texts),
            self.ids,
            self.logprobs,
            self.last.finish_reason,
            self.last.stop_reason,
            None if p is None else p.prompt_logprobs,
            None if p is None else p.prompt_ranks,
            self.last.num_draft_tokens,  # totals: the latest are all of them
            self.last.num_accepted_tokens,
        )


class _Stream:
    """One request's hand-over point between the engine thread and its reader: at most
    one pending Update (newer output merged in) and, at the end, an error."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, record: RequestRecord, sampling: SamplingParams
    ) -> None:
        self.loop, self.record, self.sampling = loop, record, sampling
        self.ready = asyncio.Event()  # set (on the loop) when the slot may hold something
        self.lock = threading.Lock()
        self.pending: _Merged | None = None
        self.error: BaseException | None = None
        # engine thread only: how much of the request's output was handed over
        self.sent_tokens = self.sent_logprobs = self.sent_chars = 0
        self.sent_prompt_logprobs = False

    def put(self, item: Update | BaseException) -> None:
        """From any thread. An error ends the stream: it is read after the pending
        update, and later output is dropped."""
        with self.lock:
            wake = self.pending is None and self.error is None
            if isinstance(item, BaseException):
                self.error = self.error or item
            elif self.error is None:
                if self.pending is None:
                    self.pending = _Merged(item)
                else:
                    self.pending.add(item)
        if wake:
            self.loop.call_soon_threadsafe(self.ready.set)

    async def get(self) -> Update | BaseException:
        """The pending update (taken), else the error; waits for one of them."""
        while True:
            with self.lock:
                if self.pending is not None:
                    item, self.pending = self.pending, None
                    return item.update()
                if self.error is not None:
                    return self.error
                self.ready.clear()  # under the lock: a put after this wakes us again
            await self.ready.wait()

    def update(self, c: CompletionOutput, out: RequestOutput) -> Update:
        """What `out` adds to what was handed over (engine thread). The text's last
        characters that could still be the start of a stop string stay back until the
        request finishes: a stop string found later only ever cuts those."""
        stops = self.sampling.stop
        hold = 0 if c.finish_reason is not None or not stops else max(map(len, stops)) - 1
        upto = max(self.sent_chars, len(c.text) - hold)
        delta, self.sent_chars = c.text[self.sent_chars : upto], upto
        new = c.token_ids[self.sent_tokens :]
        self.sent_tokens = len(c.token_ids)
        logprobs = None
        if c.logprobs is not None:
            logprobs = c.logprobs[self.sent_logprobs :]
            self.sent_logprobs = len(c.logprobs)
        prompt_lps = prompt_ranks = None
        if out.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            self.sent_prompt_logprobs = True
            prompt_lps, prompt_ranks = out.prompt_logprobs, out.prompt_ranks
        return Update(
            delta,
            new,
            logprobs,
            c.finish_reason,
            c.stop_reason,
            prompt_lps,
            prompt_ranks,
            out.num_draft_tokens,
            out.num_accepted_tokens,
        )


@dataclass
class _Pending:
    req_id: str
    text: str | None
    ids: list[int]
    sampling: SamplingParams
    stream: _Stream = field(repr=False)


class AsyncEngine:
    """The EngineClient (engine_client.py) of one LLMEngine stepped on its own thread."""

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
        # The engine core in its own process (core_process.py) sets this event when a
        # step's outputs arrive; one in this process runs a step whenever asked (None).
        self._remote = engine.core.wake
        self._wake = self._remote or threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xllm-engine", daemon=True)

    # ---- EngineClient: what the HTTP layer reads ----------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.config.model

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def tokenize_prompt(self, prompt: str) -> tuple[str | None, list[int]]:
        return self.engine.tokenize_prompt(prompt)  # reads the tokenizer only

    def validate(self, ids: list[int], sampling: SamplingParams) -> None:
        self.engine.validate(ids, sampling)  # reads the configs only

    # ---- event-loop side --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread, then release the executors: a cluster's workers are
        told why, and to exit non-zero when the engine failed."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        reason = f"the master's engine failed: {self.dead}" if self.dead else "master exiting"
        self.engine.core.shutdown(reason, failure=self.dead is not None)

    async def generate(
        self, req_id: str, text: str | None, ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[Update]:
        """Updates for one request until it finishes. Closing the iterator early (client
        gone, task cancelled) aborts the request and frees its blocks."""
        if (chosen := CHOSEN_PREFILL.get()) is not None:  # PD: the router chose (pd/route.py)
            sampling = replace(sampling, kv_source=chosen)
        record = RequestRecord(time.monotonic(), len(ids))
        stream = _Stream(asyncio.get_running_loop(), record, sampling)
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
                item = await stream.get()
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
            s.put(RequestAbortedError(why))
        self._wake.set()
        return len(streams)

    # ---- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._admit()
                if self.engine.has_unfinished() and self._core_ready():
                    started = time.monotonic()
                    outs = self.engine.step()
                    if self._remote is not None:
                        started = self.engine.core.step_started or started
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

    def _core_ready(self) -> bool:
        """A step's outputs can be had now: always from a core in this process (it runs
        the step), from a core process once one arrived."""
        return self.engine.core.ready_to_step()

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
        core = self.engine.core
        advanced = {out.request_id for out in outs}  # (a prompt done in one step included)
        with self._lock:
            streams = dict(self._streams)
        for req_id, s in streams.items():
            rec = s.record
            if rec.scheduled is None and (req_id in advanced or core.has_started(req_id)):
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
            upd = s.update(c, out)
            if upd.new_token_ids:
                self.events.on_tokens(s.record, len(upd.new_token_ids), now)
            if upd.finished:
                self.events.on_finished(s.record, c.finish_reason, now)
                with self._lock:
                    self._streams.pop(out.request_id, None)
            s.put(upd)

    def _fail(self, req_id: str, s: _Stream, error: str) -> None:
        """One request failed on its own: its handler gets RequestFailedError."""
        self.events.on_finished(s.record, "error", time.monotonic())
        with self._lock:
            self._streams.pop(req_id, None)
        s.put(RequestFailedError(f"request {req_id} failed: {error}"))

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self.dead = error
            streams, self._streams = dict(self._streams), {}
        for s in streams.values():
            s.put(EngineDeadError(f"the engine failed: {error}"))
        if self.on_failure is not None:
            self.on_failure(error)
