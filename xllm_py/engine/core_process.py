"""The engine core in its own process: the daemon's HTTP process and the core exchange
typed messages over two pipes.

    HTTP process (LLMEngine over CoreProcessClient)       core process (`run_core`)
    -----------------------------------------------       ---------------------------------
    the config, built once: Boot  ───────────────────>   processes.py's core_main builds the
                                                         core it describes (no command line)
    tokenize, validate, RequestState (detokenise)
    add_request / finish_request -> outbox ─ sender ──>  Add / Abort: admitted between steps
                                                         EngineCore.step() (scheduler,
                                                         executor, the model), again and again
    step(): the Steps received so far  <── receiver ───  Step: outputs, stats, started ids
    dead: EOF on the pipe or a Failed  <───────────────  Failed(error), then exit 1

Why this shape. The step runs in a process of its own, so tokenising, detokenising, SSE
and JSON no longer share a GIL with it, and the core starts its next step while the HTTP
process turns the last one into text: the two overlap. The messages are msgpack, encoded
and decoded by msgspec against the dataclasses both sides already use (SamplingParams,
EngineCoreOutput, SchedulerStats): typed, validated on the way in (a SamplingParams is
checked by its own __post_init__ again), never pickled, and fast enough for a step's worth
of outputs to cost microseconds. Plain pipes (os.pipe, length-prefixed frames through
multiprocessing.connection) need no broker and no port: the core is this daemon's child
and nothing else should reach it; its end of the pipe closing is how each side learns
that the other is gone.

Nothing blocks in a cycle: the HTTP side writes from a sender thread and reads on a
receiver thread, the core reads between steps and writes after each, so a full pipe in
one direction only ever waits on a reader that is running. The receiver holds at most
MAX_PENDING_STEPS unread Steps; beyond that it stops reading and the core waits on its
write (backpressure instead of an unbounded queue).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection

import msgspec

from xllm_py.engine.core_client import EngineCoreClient
from xllm_py.engine.engine_core import validate_request
from xllm_py.engine.scheduler import EngineCoreOutput, SchedulerStats
from xllm_py.sampling_params import SamplingParams

logger = logging.getLogger("xllm")
MAX_PENDING_STEPS = 256  # unread Steps the HTTP side holds before the core waits
FDS_ENV = "XLLM_CORE_FDS"  # "<read fd>,<write fd>": the core's ends of the two pipes
IDLE_WAIT_S = 0.05  # an idle core looks for work this often
STOP_WAIT_S = 30.0  # a core told to shut down gets this long, then it is killed


# ---- the messages -------------------------------------------------------------------------


class Add(msgspec.Struct, tag=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


class Abort(msgspec.Struct, tag=True):
    req_id: str
    reason: str  # "abort" (client gone, failure) | "stop" (a stop string matched)


class Shutdown(msgspec.Struct, tag=True):
    reason: str
    failure: bool  # a cluster's workers exit non-zero too


class Ready(msgspec.Struct, tag=True):
    num_blocks: int  # the KV cache's blocks (validation of request lengths needs them)
    stats: SchedulerStats


class Step(msgspec.Struct, tag=True):
    started: float  # time.monotonic() at the step's start (one clock for both processes)
    outputs: list[EngineCoreOutput]
    started_ids: list[str]  # requests whose first tokens were computed in this step
    stats: SchedulerStats


class Failed(msgspec.Struct, tag=True):
    error: str


class WorkerDrain(msgspec.Struct, tag=True):
    why: str  # a cluster worker got SIGTERM: the daemon drains


ToCore = Add | Abort | Shutdown
FromCore = Ready | Step | Failed | WorkerDrain


class _Channel:
    """One end of the two pipes: typed messages out, typed messages in; `send` is
    thread-safe (the core's health monitor reports worker drains from its own thread)."""

    def __init__(self, read_fd: int, write_fd: int, incoming) -> None:
        self.rx = Connection(read_fd, writable=False)
        self.tx = Connection(write_fd, readable=False)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(incoming)
        self.lock = threading.Lock()

    def send(self, msg) -> None:
        data = self.encoder.encode(msg)
        with self.lock:
            self.tx.send_bytes(data)

    def recv_first(self, kind):
        """The first message, of the type the two sides agreed on at spawn (the boot
        message, whose type the engine does not know)."""
        return msgspec.msgpack.decode(self.rx.recv_bytes(), type=kind)

    def recv(self, timeout: float | None = None):
        """The next message; None if none came within `timeout`. EOFError: the other side
        is gone."""
        if timeout is not None and not self.rx.poll(timeout):
            return None
        return self.decoder.decode(self.rx.recv_bytes())

    def close(self) -> None:
        self.rx.close()
        self.tx.close()


# ---- the core process ---------------------------------------------------------------------


def run_core(core, channel: _Channel) -> int:
    """Serve `core` over `channel` until Shutdown (0), the HTTP process's end closing
    (0: nothing is left to serve) or a step failing (Failed is sent; 1)."""
    channel.send(Ready(core.num_blocks, core.stats()))
    started: set[str] = set()
    while True:
        # Idle, wait for a message, but not forever: a cluster's core has work to do when
        # its health monitor declares a worker dead (the step then raises).
        msg = channel.recv(0 if core.has_unfinished() else IDLE_WAIT_S)
        admitted = msg is not None
        while msg is not None:
            if isinstance(msg, Shutdown):
                core.shutdown(msg.reason, msg.failure)
                return 0
            if isinstance(msg, Add):
                core.add_request(msg.req_id, msg.prompt_token_ids, msg.sampling)
            else:
                core.finish_request(msg.req_id, msg.reason)
            msg = channel.recv(0)
        if not core.has_unfinished():
            if admitted:  # aborts while idle: fresh stats
                channel.send(Step(time.monotonic(), [], [], core.stats()))
            continue
        t0 = time.monotonic()
        try:
            outs = core.step()
        except BaseException as e:  # noqa: BLE001 - any step failure ends the core
            logger.exception("engine core step failed")
            channel.send(Failed(f"{type(e).__name__}: {e}"))
            core.shutdown(f"the engine core failed: {e}", failure=True)
            return 1
        new = [r for r in core.requests if r not in started and core.has_started(r)]
        started.intersection_update(core.requests)
        started.update(new)
        channel.send(Step(t0, outs, new, core.stats()))


def child_channel() -> _Channel:
    """The core process's end of the pipes its parent opened (their fds in FDS_ENV)."""
    read_fd, write_fd = map(int, os.environ.pop(FDS_ENV).split(","))
    return _Channel(read_fd, write_fd, ToCore)


def report_failure(channel: _Channel, error: BaseException) -> None:
    """Tell the HTTP process why the core could not start (if it is still there)."""
    try:
        channel.send(Failed(f"{type(error).__name__}: {error}"))
    except OSError:
        pass  # the HTTP process is gone too


# ---- the HTTP process's side --------------------------------------------------------------


class CoreDeadError(RuntimeError):
    """The engine core process failed or exited."""


class CoreProcessClient(EngineCoreClient):
    """The EngineCore interface LLMEngine drives, served by a child process. `step()`
    returns the outputs of every Step received since the last call (possibly none): the
    core steps on its own and never waits for the HTTP side to ask."""

    def __init__(self, module: str, boot: bytes, config, on_worker_drain) -> None:
        """Start the core (`python -m module`, whose first message to read is `boot`:
        processes.py's Boot, encoded) and wait until its model is loaded."""
        self.config = config
        self.on_worker_drain = on_worker_drain
        self.wake = threading.Event()  # set on every message: AsyncEngine's loop waits on it
        self.step_started: float | None = None
        self._lock = threading.Condition()
        self._inbox: deque[Step] = deque()
        self._outbox: deque[Add | Abort | Shutdown] = deque()
        self._live: set[str] = set()  # added and not yet finished, as this side knows
        self._started: set[str] = set()
        self.dead: str | None = None
        self.proc, self.channel = _spawn(module)
        try:
            self.channel.tx.send_bytes(boot)
        except OSError:
            pass  # it exited before reading: _first_message says how
        first = self._first_message()
        self.num_blocks, self._stats = first.num_blocks, first.stats
        for target, name in ((self._receive, "xllm-core-rx"), (self._send, "xllm-core-tx")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def _first_message(self) -> Ready:
        try:
            msg = self.channel.recv()
        except EOFError:
            msg = None
        if not isinstance(msg, Ready):
            why = msg.error if isinstance(msg, Failed) else "it exited before it was ready"
            self.proc.wait(STOP_WAIT_S)
            raise CoreDeadError(
                f"the engine core failed to start (exit code {self.proc.returncode}): {why}"
            )
        return msg

    # -- the EngineCore interface -----------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        validate_request(self.config, self.num_blocks, prompt_token_ids, sampling)

    def add_request(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams):
        self._live.add(req_id)
        self._post(Add(req_id, prompt_token_ids, sampling))

    def finish_request(self, req_id: str, reason: str = "abort") -> None:
        if req_id in self._live:
            self._live.discard(req_id)
            self._started.discard(req_id)
            self._post(Abort(req_id, reason))

    def has_unfinished(self) -> bool:
        return bool(self._live) or bool(self._inbox) or self.dead is not None

    def has_started(self, req_id: str) -> bool:
        return req_id in self._started

    def ready_to_step(self) -> bool:
        """A Step is waiting (or the core died: step() raises)."""
        return bool(self._inbox) or self.dead is not None

    def step(self) -> list[EngineCoreOutput]:
        with self._lock:
            steps, self._inbox = list(self._inbox), deque()
            self._lock.notify_all()  # the receiver may read again
        if not steps and self.dead is not None:
            raise CoreDeadError(self.dead)
        outs: list[EngineCoreOutput] = []
        for st in steps:
            self._started.update(r for r in st.started_ids if r in self._live)
            for o in st.outputs:
                if o.finish_reason is not None:
                    self._live.discard(o.req_id)
                    self._started.discard(o.req_id)
            outs += st.outputs
        if steps:
            self.step_started = steps[0].started
        return outs

    def stats(self) -> SchedulerStats:
        return self._stats

    def shutdown(self, reason: str = "shutting down", failure: bool = False) -> None:
        """Tell the core to release its executors (a cluster's workers), then wait for it
        to exit; kill it if it does not within STOP_WAIT_S."""
        if self.proc.poll() is None:
            self._post(Shutdown(reason, failure))
            try:
                self.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core did not exit in %.0f s; killing it", STOP_WAIT_S)
                self.proc.kill()
                self.proc.wait()

    # -- the two threads --------------------------------------------------------------------

    def _post(self, msg) -> None:
        with self._lock:
            self._outbox.append(msg)
            self._lock.notify_all()

    def _send(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._outbox or self.dead is not None)
                if self.dead is not None:
                    return
                msgs, self._outbox = list(self._outbox), deque()
            try:
                for msg in msgs:
                    self.channel.send(msg)
            except OSError:
                return  # the core is gone: the receiver reports it

    def _receive(self) -> None:
        while True:
            try:
                msg = self.channel.recv()
            except (EOFError, OSError):
                code = self.proc.wait()
                self._die(f"the engine core process exited (exit code {code})")
                return
            if isinstance(msg, Failed):
                self._die(f"the engine core failed: {msg.error}")
                return
            if isinstance(msg, WorkerDrain):
                self.on_worker_drain(msg.why)
                continue
            with self._lock:
                self._lock.wait_for(lambda: len(self._inbox) < MAX_PENDING_STEPS)
                self._stats = msg.stats
                if msg.outputs or msg.started_ids:
                    self._inbox.append(msg)
            self.wake.set()

    def _die(self, why: str) -> None:
        with self._lock:
            self.dead = self.dead or why
            self._lock.notify_all()
        self.wake.set()


def _spawn(module: str) -> tuple[subprocess.Popen, _Channel]:
    """The core process, with its ends of two fresh pipes (inherited by fd number)."""
    to_core_r, to_core_w = os.pipe()
    from_core_r, from_core_w = os.pipe()
    child_env = {**os.environ, FDS_ENV: f"{to_core_r},{from_core_w}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        env=child_env,
        pass_fds=(to_core_r, from_core_w),
    )
    os.close(to_core_r)
    os.close(from_core_w)
    return proc, _Channel(from_core_r, to_core_w, FromCore)
