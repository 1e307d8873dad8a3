"""The master's watch over its remote workers.

Every second each worker's Health RPC is called (deadline: one second). A worker that has
not answered for `timeout` seconds is dead; so is one whose channel reports it gone
(a killed process refuses connections at once, so that takes about one poll). The first
death is the verdict: executors give up their steps, the engine fails its requests and
the master tells the other workers to shut down.

A worker that answers `draining` (it got SIGTERM/SIGINT) is alive and still serves steps;
the monitor reports it once through `on_drain`, and the master drains as on its own
SIGTERM, then shuts the cluster down cleanly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from xllm_py.cluster.grpc_executor import WorkerClient

logger = logging.getLogger(__name__)
POLL_INTERVAL_S = 1.0
# Consecutive refused connections (UNAVAILABLE) that count as dead before `timeout`: a
# killed worker's port refuses at once, a busy one still accepts and answers late.
MAX_UNAVAILABLE = 2


class HealthMonitor:
    def __init__(self, timeout: float, on_drain: Callable[[str], None] = lambda why: None) -> None:
        """on_drain(why): called once per worker that reports it is draining."""
        self.timeout = timeout
        self.on_drain = on_drain
        self.failure: str | None = None
        self._draining: set[int] = set()
        self._clients: list[WorkerClient] = []
        self._last_ok: dict[int, float] = {}
        self._unavailable: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xllm-health", daemon=True)

    def add(self, client: WorkerClient) -> None:
        with self._lock:
            self._clients.append(client)
            self._last_ok[client.rank] = time.monotonic()
            self._unavailable[client.rank] = 0
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def verdict(self) -> str | None:
        return self.failure

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S) and self.failure is None:
            with self._lock:
                clients = list(self._clients)
            for c in clients:
                self._poll(c)

    def _poll(self, c: WorkerClient) -> None:
        now = time.monotonic()
        try:
            reply = c.health(timeout=POLL_INTERVAL_S)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self._unavailable[c.rank] += 1
            silent = now - self._last_ok[c.rank]
            if self._unavailable[c.rank] >= MAX_UNAVAILABLE or silent > self.timeout:
                self._fail(
                    f"{c!r} stopped answering health checks ({e.code().name}, "
                    f"silent for {silent:.1f} s)"
                )
            return
        self._last_ok[c.rank] = time.monotonic()
        self._unavailable[c.rank] = 0
        if reply.draining and c.rank not in self._draining:
            self._draining.add(c.rank)
            self.on_drain(f"{c!r} is shutting down (SIGTERM/SIGINT)")

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
            logger.error("cluster failure: %s", why)
