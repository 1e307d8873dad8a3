"""Start the real daemon (`python -m xllm_py`) on a free loopback port, for tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, gone: Callable[[], str | None], timeout: float) -> bool:
    """Poll url/health until it answers 200 (True) or `timeout` passes (False); `gone()`
    returns why the server cannot come up any more (it exited), which is raised."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        why = gone()
        if why is not None:
            raise RuntimeError(why)
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


def free_port_range(n: int) -> int:
    """A port p such that p .. p + n - 1 are all free now (for START_PORT + i layouts)."""
    while True:
        base = free_port()
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


class Server:
    def __init__(
        self, *flags: str, startup_timeout: float = 120.0, env: dict[str, str] | None = None
    ) -> None:
        """env: variables added to the daemon's environment."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(f"/tmp/xllm-test-server-{self.port}.log", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xllm_py", "--port", str(self.port), *flags],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        if wait_healthy(self.url, self._exited, startup_timeout):
            return
        self.stop()
        raise RuntimeError(f"server did not come up:\n{self.output()}")

    def _exited(self) -> str | None:
        if self.proc.poll() is None:
            return None
        return f"server exited with {self.proc.returncode}:\n{self.output()}"

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def metrics(self) -> dict[str, float]:
        """`name{labels}` -> value for every sample of /metrics."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            m = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
            if m.group(1) != name:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += value
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
