"""Start a server process on a loopback port and wait until it answers: our daemon
(`Server`), another engine or a launcher script (`Daemon`); read its /metrics. The one
launcher of perf/ and of the tests (tests/server_utils.py re-exports it)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from perf.common import ROOT
from xllm_py.cluster.ports import free_port_run, unpicked_ports

# One HTTP client for the launcher's requests and the tests' (its pool is thread-safe):
# each httpx.get() or httpx.post() builds a client of its own, and with it an SSL context,
# about 60 ms of CPU even for http://, which health polls during a start-up would pay
# dozens of times.
HTTP = httpx.Client()


# Ports for servers a test or a benchmark starts come from below the kernel's ephemeral
# range (xllm_py/cluster/ports.py says why), split into PORT_SLICES slices: one per
# pytest-xdist worker (gwN, and any process it starts), or by pid elsewhere. Within a slice
# a process starts at an offset its pid picks and never hands out a port twice.
PORT_SLICES = 16
_handed: set[int] = set()


def _port_slice() -> range:
    ports = unpicked_ports()
    width = len(ports) // PORT_SLICES
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker[:2] == "gw" and worker[2:].isdigit() else os.getpid()
    first = ports.start + index % PORT_SLICES * width
    return range(first, first + width)


def free_port_range(n: int) -> int:
    """A loopback port p such that p .. p + n - 1 are free now and no other process of the
    host picks them (for START_PORT + i layouts); see PORT_SLICES."""
    base = free_port_run(n, _port_slice(), os.getpid() * 97, "127.0.0.1", _handed)
    _handed.update(range(base, base + n))
    return base


def free_port() -> int:
    """A loopback port free now that no other process of the host picks (see PORT_SLICES)."""
    return free_port_range(1)


def wait_healthy(
    url: str,
    gone: Callable[[], str | None],
    timeout: float,
    path: str = "/health",
    client: httpx.Client = HTTP,
) -> bool:
    """Poll url + path with `client` until it answers 200 (True) or `timeout` passes
    (False); `gone()` returns why the server cannot come up any more (it exited), which is
    raised."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        why = gone()
        if why is not None:
            raise RuntimeError(why)
        try:
            if client.get(url + path, timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


class Daemon:
    """`cmd` running with its output in `log`, up once GET `ready_path` on `port` answers
    200 (`ready_path` None: not waited for, e.g. a cluster worker without HTTP).

    `group`: start it in a session of its own and signal that whole process group (a
    launch command that forks). `stop_cmd`: the command is a launcher that may exit 0
    once its servers run in the background (scripts/launch_cluster.sh); `stop_cmd` stops
    them."""

    def __init__(
        self,
        cmd: list[str],
        port: int | None = None,
        log: Path | str | None = None,
        ready_path: str | None = "/health",
        env: dict[str, str] | None = None,
        stop_cmd: list[str] | None = None,
        group: bool = False,
        startup_timeout: float = 600.0,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.stop_cmd, self.group = stop_cmd, group
        self.log = open(log or f"/tmp/xllm-test-server-{port}.log", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env,
            start_new_session=group,
        )  # fmt: skip
        if ready_path is None or wait_healthy(self.url, self._exited, startup_timeout, ready_path):
            return
        self.stop()
        raise RuntimeError(f"server not ready after {startup_timeout} s:\n{self.output()}")

    def _exited(self) -> str | None:
        code = self.proc.poll()
        if code is None or (code == 0 and self.stop_cmd):
            return None
        self.stop()
        return f"server exited with {code}:\n{self.output()}"

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text()

    def _signal(self, sig: int) -> None:
        if self.group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Stop it (and what `stop_cmd` stops), SIGKILL after `timeout` s; the exit status."""
        if self.stop_cmd and not self.log.closed:
            subprocess.run(self.stop_cmd, stdout=self.log, stderr=subprocess.STDOUT, timeout=120)
        if self.proc.poll() is None:
            self._signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` in /metrics whose labels include `labels`."""
        page = HTTP.get(self.url + "/metrics", timeout=10).text
        return sum(
            v for n, have, v in samples(page)
            if n == name and all(have.get(k) == x for k, x in labels.items())
        )  # fmt: skip

    def settle(self, timeout: float) -> dict:
        """Poll the gauges until nothing runs, waits or holds a KV block, or `timeout` passes
        (a step or an abort reaches them when the engine core reports it, a few milliseconds
        after the HTTP answer it caused); the last readings and the seconds waited."""
        t0 = time.monotonic()
        while True:
            g = {
                "running": self.metric("xllm:num_requests_running"),
                "waiting": self.metric("xllm:num_requests_waiting"),
                "kv_cache_usage": self.metric("xllm:kv_cache_usage_perc"),
            }  # fmt: skip
            waited = time.monotonic() - t0
            if not any(g.values()) or waited > timeout:
                return g | {"settled_after_s": round(waited, 2)}
            time.sleep(0.25)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Server(Daemon):
    """Our daemon (`python -m xllm_py`) with `flags` on a free port; env: variables added
    to its environment."""

    def __init__(
        self,
        *flags: str,
        startup_timeout: float = 120.0,
        env: dict[str, str] | None = None,
        port: int | None = None,
        log: Path | str | None = None,
    ) -> None:
        port = port or free_port()
        cmd = [sys.executable, "-m", "xllm_py", "--port", str(port), *flags]
        super().__init__(
            cmd, port, log, env={**os.environ, **(env or {})}, startup_timeout=startup_timeout
        )


def warm_up(base_url: str, extra_body: dict | None = None) -> None:
    """A few requests so first-call costs (allocation, lazy init) stay out of the figures."""
    model = HTTP.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Hello", "max_tokens": 16, "ignore_eos": True}
    for _ in range(3):
        HTTP.post(
            base_url + "/v1/completions", json={**body, **(extra_body or {})}, timeout=300
        ).raise_for_status()


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a Prometheus text page."""
    out = []
    for line in text.splitlines():
        m = re.match(r"([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)", line)
        with contextlib.suppress(TypeError, ValueError):  # no sample (None), or no number
            out.append((m[1], dict(re.findall(r'(\w+)="([^"]*)"', m[2] or "")), float(m[3])))
    return out


def flag_value(flags: list[str], name: str) -> str | None:
    """The value of --name in a daemon command line (--name=v or --name v), else None."""
    value = None
    for i, f in enumerate(flags):
        if f.startswith(f"--{name}="):
            value = f.split("=", 1)[1]
        elif f == f"--{name}" and i + 1 < len(flags):
            value = flags[i + 1]
    return value
