"""The daemon's lifetime around the HTTP app: build it from EngineArgs, serve it with
uvicorn, drain on SIGTERM, exit with a status that says how it ended.

    EngineArgs --build_server--> (DrainingServer, AsyncEngine) --run--> exit code

`build_server` applies the process-wide options (processes.py: threads, fault hook,
grammar cache), builds the EngineConfig and the engine core (in this process or its own,
processes.py) and, on the master of a cluster, waits for every worker before the app
exists. `run` serves until SIGTERM/SIGINT, `server.should_exit` or an engine
failure, then shuts the engine (and a cluster's workers) down.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import uvicorn

from xllm_py.args import EngineArgs
from xllm_py.processes import ProcessOptions, build_core, cluster_options, start_core_process

FAILURE_EXIT_DELAY_S = 2.0  # /health answers 503 this long after an engine failure
SHUTDOWN_FLUSH_S = 5.0  # after the drain: time for the last responses (and aborts) to go out
logger = logging.getLogger("xllm")


class DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT drains: the port stays open, /health and new requests answer 503,
    in-flight requests run until they end or --shutdown_timeout passes; the rest are
    then aborted with an error naming the timeout, and uvicorn shuts down. A second
    signal ends the drain at once, a third is uvicorn's own (SIGINT: force exit).
    A cluster worker's SIGTERM (reported by its health checks into `worker_drains`) starts
    the same drain; afterwards `run` shuts the workers down cleanly."""

    def __init__(
        self, config: uvicorn.Config, engine, shutdown_timeout: float, worker_drains: list[str]
    ) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.api = config.app.state.server  # in_flight: requests still being answered
        self.worker_drains = worker_drains  # appended by the health monitor, read by on_tick
        self.drain_deadline: float | None = None
        self.drain_logged = False

    def begin_drain(self) -> None:
        self.engine.draining = True  # /health turns 503 while in-flight requests finish
        self.drain_deadline = time.monotonic() + self.shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        if self.drain_deadline is None:
            self.begin_drain()
        elif not self.should_exit:
            self.drain_deadline = 0.0
        else:
            super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after shutting down (exit status -15); a drained
        # shutdown is a clean one here, so the process exits 0 instead.
        getattr(self, "_captured_signals", []).clear()

    async def on_tick(self, counter: int) -> bool:
        if self.worker_drains and self.drain_deadline is None:
            logger.warning("%s: draining the cluster", self.worker_drains[0])
            self.begin_drain()
        if self.drain_deadline is not None and not self.should_exit:
            self._drain()
        return await super().on_tick(counter)

    def _drain(self) -> None:
        timeout = self.shutdown_timeout
        if not self.drain_logged:
            self.drain_logged = True
            logger.info(
                "shutting down: %d request(s) in flight get up to --shutdown_timeout=%g s",
                self.api.in_flight,
                timeout,
            )
        if self.api.in_flight == 0:
            self.should_exit = True
        elif time.monotonic() >= self.drain_deadline:
            n = self.engine.abort_all(
                f"request aborted: the server is shutting down and it did not finish "
                f"within --shutdown_timeout={timeout:g} s"
            )
            logger.warning("--shutdown_timeout passed: aborted %d request(s)", n)
            self.should_exit = True

    def exit_after_failure(self, error: BaseException) -> None:
        """The engine failed: /health answers 503 for a moment (probes see why), then the
        process exits 1."""
        logger.error("engine failed (%s); exiting in %.0f s", error, FAILURE_EXIT_DELAY_S)
        threading.Timer(FAILURE_EXIT_DELAY_S, lambda: setattr(self, "should_exit", True)).start()


def server_options(a: EngineArgs, served_model_name: str):
    """The HTTP server's options: ServerOptions' fields are EngineArgs' of the same names
    (the API key from --api_key or XLLM_API_KEY; usage.speculative only with MTP on)."""
    from xllm_py.entrypoints.serving import ServerOptions

    own = {"served_model_name", "api_key", "report_speculative_usage"}
    names = {f.name for f in dataclasses.fields(ServerOptions)} - own
    return ServerOptions(
        served_model_name=served_model_name,
        api_key=a.secret("api_key"),
        report_speculative_usage=a.report_speculative_usage and a.num_speculative_tokens > 0,
        **{name: getattr(a, name) for name in names},
    )


def build_server(a: EngineArgs) -> tuple[DrainingServer, object]:
    """The daemon, not yet running: (uvicorn server, AsyncEngine). `run` starts it; setting
    `server.should_exit` stops it as SIGTERM would."""
    from xllm_py.engine.async_engine import AsyncEngine
    from xllm_py.engine.llm_engine import LLMEngine
    from xllm_py.engine.metrics import ServerMetrics
    from xllm_py.entrypoints.api_server import build_app
    from xllm_py.pd import route as pd_route

    ProcessOptions.from_args(a, threads=not a.engine_core_process).apply()
    config = pd_route.with_credentials(a.engine_config(), a)
    name = a.served_model_name or os.path.basename(os.path.normpath(str(config.model.path)))
    worker_drains: list[str] = []
    if a.engine_core_process:
        core = start_core_process(a, config, worker_drains.append)
    else:
        core = build_core(config, cluster_options(a, config), worker_drains.append)
    engine = AsyncEngine(LLMEngine(config, core))
    metrics = ServerMetrics(name)
    metrics.attach(engine)
    app = build_app(engine, server_options(a, name), metrics)
    pd_route.attach(app, engine, config.pd)
    https = pd_route.server_ssl(config.pd)  # a PD instance with --cluster_tls_cert
    http = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level,
                          timeout_graceful_shutdown=SHUTDOWN_FLUSH_S, **https,
                          timeout_keep_alive=a.http_keep_alive_timeout,
                          access_log=a.log_level == "debug")  # fmt: skip
    server = DrainingServer(http, engine, a.shutdown_timeout, worker_drains)
    engine.on_failure = server.exit_after_failure
    spec = f", MTP {'adaptive k<=' if a.speculative_adaptive else 'k='}{a.num_speculative_tokens}"
    where = f"{config.model.path}{spec if a.num_speculative_tokens else ''}"
    scheme = "https" if https else "http"
    logger.info("serving %s (%s) at %s://%s:%d/v1", name, where, scheme, a.host, a.port)
    return server, engine


def run(server: DrainingServer, engine) -> int:
    """Serve until SIGTERM/SIGINT, `server.should_exit` or an engine failure; the exit code."""
    import asyncio

    engine.start()
    try:
        asyncio.run(server.serve())
    finally:
        engine.draining = True
        engine.shutdown()  # a cluster's workers exit with the master: non-zero after a failure
    if engine.dead is not None:
        return 1
    return 0 if server.started else 1
