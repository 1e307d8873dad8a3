"""A grammar compile that a timeout really stops: xgrammar compiles in a child process.

xgrammar's compile is one C++ call that cannot be interrupted, so a compile thread given a
timeout keeps running (and holding the compiler) after its caller gave up. Here the compile
runs in a child (`python -m xllm_py.structured.compile_child`, started with subprocess: a fresh
interpreter, nothing forked) that holds the tokenizer's info; past its timeout the child is
killed and a fresh one started, so the next compile is never behind a runaway one.

The protocol is one JSON document per line, both ways (never pickle):

    parent -> child   {"tokenizer_info": <xgrammar TokenizerInfo.serialize_json()>}
    child -> parent   {"ready": true}
    parent -> child   {"kind": ..., "spec": ..., "strict": ...}    (a StructuredOutput)
    child -> parent   {"grammar": <CompiledGrammar.serialize_json()>} or {"error": <message>}

The child writes its answers to a private copy of its stdout (its fd 1 is pointed at
stderr, so anything a library prints cannot break the protocol) and exits when its stdin
closes. The parent kills it at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from xllm_py.sampling_params import StructuredOutput

START_TIMEOUT_S = 120.0  # a child's start (Python, torch and xgrammar imported): not a compile
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
_live: weakref.WeakSet[CompileProcess] = weakref.WeakSet()
_exiting = threading.Event()  # set at exit: no child is started any more


class CompileTimeout(Exception):
    """The compile took longer than its timeout (the child was killed)."""


class CompileProcess:
    """A compile child for one tokenizer; one compile at a time (callers serialise)."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._info = tokenizer_info_json
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._ready = False
        self._lock = threading.Lock()  # guards _proc against close() from another thread
        self.restarts = 0  # children killed (timeouts) or lost
        _live.add(self)
        self._start()

    def _start(self) -> None:
        if _exiting.is_set():
            raise RuntimeError("the process is exiting: no grammar compiles")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        proc = subprocess.Popen(
            [sys.executable, "-m", "xllm_py.structured.compile_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        with self._lock:
            self._proc, self._buf, self._ready = proc, b"", False
        # the tokenizer's info, written while the child starts (the write waits for it to
        # read), so a child started after a kill is ready before the next compile comes
        hello = {"tokenizer_info": self._info}
        threading.Thread(target=self._send, args=(hello, proc), daemon=True).start()

    def compile(self, so: StructuredOutput, timeout: float) -> str:
        """The compiled grammar's JSON; ValueError (the child's message) if the spec does
        not compile; CompileTimeout after `timeout` seconds of compiling (the wait for the
        child to start does not count)."""
        if self._proc is None or self._proc.poll() is not None:
            self._restart()
        if not self._ready:
            msg = self._recv(time.monotonic() + START_TIMEOUT_S)
            if msg is None or not msg.get("ready"):
                self._restart()
                raise RuntimeError("the grammar compile process did not start")
            self._ready = True
        self._send({"kind": so.kind, "spec": so.spec, "strict": so.strict})
        msg = self._recv(time.monotonic() + timeout)
        if msg is None:  # past the timeout, or the child died: a fresh child for the next
            if _exiting.is_set():
                raise RuntimeError("the process is exiting: no grammar compiles")
            died = self._proc is not None and self._proc.poll()
            self._restart()
            if died is not None:  # (xgrammar crashed, or ran out of memory, on this spec)
                raise ValueError(f"does not compile: the grammar compiler exited ({died})")
            raise CompileTimeout(f"took more than {timeout:g} s to compile")
        if "error" in msg:
            raise ValueError(msg["error"])
        return msg["grammar"]

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()

    def _restart(self) -> None:
        self.restarts += 1
        self.close()
        self._start()

    def _send(self, msg: dict, proc: subprocess.Popen | None = None) -> None:
        proc = proc or self._proc
        try:
            proc.stdin.write(json.dumps(msg).encode() + b"\n")
            proc.stdin.flush()
        except (OSError, AttributeError):
            pass  # the child is gone: _recv sees its stdout close

    def _recv(self, deadline: float) -> dict | None:
        """The child's next message, or None if it has not come by `deadline` or the child
        exited."""
        proc = self._proc
        if proc is None:
            return None
        fd = proc.stdout.fileno()
        poll = select.poll()  # (not select.select: a server's descriptors pass 1024)
        poll.register(fd, select.POLLIN)
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not poll.poll(left * 1000):
                return None
            try:
                chunk = os.read(fd, 1 << 20)
            except OSError:  # closed meanwhile (the process is exiting)
                return None
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)


@atexit.register
def _kill_all() -> None:
    """No compile outlives the process that asked for it."""
    _exiting.set()
    for p in list(_live):
        p.close()
