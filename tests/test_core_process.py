"""The engine core in its own process (xllm_py/engine/core_process.py), against the
real daemon: answers come through the core process, and when the core dies mid-stream
every client gets an error, /health answers 503 and the daemon exits non-zero; when the
daemon dies, the core goes too, even in the middle of its start-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.server_utils import HTTP, ROOT, Server, free_port


def _core_pid(daemon_pid: int) -> int:
    children = Path(f"/proc/{daemon_pid}/task/{daemon_pid}/children").read_text().split()
    for pid in map(int, children):
        if "xllm_py.processes" in Path(f"/proc/{pid}/cmdline").read_text():
            return pid
    raise AssertionError(f"no engine core process among the daemon's children {children}")


def _stream(url: str, events: list, started: threading.Event) -> None:
    body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def test_killing_the_core_mid_stream_fails_every_client_and_the_daemon():
    s = Server(
        "--dtype=float32",
        "--num_speculative_tokens=1",
    )
    try:
        core = _core_pid(s.proc.pid)
        assert HTTP.get(s.url + "/health", timeout=10).status_code == 200
        streams = [([], threading.Event()) for _ in range(2)]
        threads = [threading.Thread(target=_stream, args=(s.url, *st)) for st in streams]
        for t in threads:
            t.start()
        for _, started in streams:
            assert started.wait(60), "no stream started"
        os.kill(core, signal.SIGKILL)
        for t in threads:
            t.join(60)
        for events, _ in streams:
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert "engine core process exited" in err["message"], err
            assert err["type"] == "server_error"
        health = HTTP.get(s.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert s.proc.wait(60) != 0
    finally:
        s.stop()


def test_a_core_whose_daemon_dies_during_start_up_exits_with_it(tmp_path):
    """The daemon killed while its core compiles graphs at start-up (before the core reads
    its pipe; a cold compile cache makes that a minute here): the core exits within
    seconds instead of compiling on, orphaned, to the end of its start-up."""
    cmd = [sys.executable, "-m", "xllm_py", "--port", str(free_port()), "--dtype=float32",
           "--enable_graph=true", "--graph_warm_up=startup",
           f"--compile_cache_dir={tmp_path}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for line in proc.stderr:  # the core logs its cache just before it compiles
            if "(engine core): KV cache" in line:
                break
        else:
            raise AssertionError(f"the daemon exited with {proc.wait()} before its core built")
        core = _core_pid(proc.pid)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{core}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = Path(f"/proc/{core}").exists()
        if alive:
            os.kill(core, signal.SIGKILL)
        assert not alive, "the orphaned core was still running 10 s after its daemon died"
    finally:
        proc.kill()
        proc.stderr.close()
