"""Nodes 1..N-1: a Worker behind a gRPC service, driven by the master.

    start Worker service on --host:--port
    Register at --master_node_addr (retried until --cluster_timeout; refused: exit 2);
      the reply carries the master's session id
    InitModel: load the model, measure the KV blocks that fit <- master
    AllocateCache: allocate the replica's blocks (its ranks' minimum) <- master
    Health every second, ExecuteStep per step               <- master
    Shutdown (exit 0, or 1 after a failure elsewhere); no word from the master for
    --heartbeat_timeout seconds: exit 1

Only the master this worker registered with may drive it: InitModel, AllocateCache,
ExecuteStep and Shutdown without its session id are refused (PERMISSION_DENIED), and
only its calls count as word from the master. With a cluster token every RPC must also
carry the token (security.py).

SIGTERM/SIGINT once registered: the worker drains. Its HealthReply says `draining`, it
goes on serving steps, and the master drains its HTTP API (--shutdown_timeout) and then
sends Shutdown(failure=false): exit 0. A master that has not sent Shutdown within
--shutdown_timeout + DRAIN_MARGIN_S seconds of the signal is given up on (exit 1), and
so is everything at a second signal (exit 1).

The servicer is thin: it converts at the edge (wire.py) and delegates to `Worker`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import grpc
import torch

from xllm_py.cluster import cluster_pb2 as pb
from xllm_py.cluster import cluster_pb2_grpc as pb_grpc
from xllm_py.cluster.grpc_executor import CHANNEL_OPTIONS
from xllm_py.cluster.layout import (
    ClusterLayout,
    ClusterOptions,
    abort_process_groups,
    backend_for,
    join_process_groups,
    model_fingerprint,
)
from xllm_py.cluster.security import (
    INSECURE,
    SESSION_KEY,
    ClusterSecurity,
    metadata_value,
    same_secret,
    warn_if_open,
)
from xllm_py.cluster.wire import output_to_pb, sched_from_pb
from xllm_py.config import EngineConfig

logger = logging.getLogger(__name__)
REGISTER_RETRY_S = 0.5
# The master calls InitModel as soon as it has recorded the registration, which can be
# before its RegisterReply (the session id) reached this worker: wait that long for it.
SESSION_WAIT_S = 5.0
# After a signal, on top of --shutdown_timeout: the master's last responses, its engine's
# shutdown and the Shutdown RPC (uvicorn's flush alone is 5 s).
DRAIN_MARGIN_S = 15.0


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, config: EngineConfig, process_group_timeout: float) -> None:
        self.config = config
        self.process_group_timeout = process_group_timeout  # --process_group_timeout
        self.worker = None
        self.capacity = 0  # KV blocks that fit, measured by InitModel
        self.steps = 0
        self.last_contact = time.monotonic()
        self.exit_code: int | None = None
        self.stopped = threading.Event()
        self.session: str | None = None  # the master's, from its RegisterReply
        self.draining = False  # a signal asked this worker to stop (HealthReply.draining)
        self.signals = 0
        self._registered = threading.Event()
        self._step_lock = threading.Lock()

    def _touch(self) -> None:
        self.last_contact = time.monotonic()

    def registered(self, session: str) -> None:
        """The master accepted this worker: from now on only calls with `session` count."""
        self.session = session
        self._registered.set()
        self._touch()

    def _from_master(self, context, wait_s: float = 0.0) -> bool:
        if wait_s:
            self._registered.wait(wait_s)
        return same_secret(metadata_value(context, SESSION_KEY), self.session)

    def _require_master(self, context, what: str) -> None:
        """Abort a call without the session id of the master this worker registered with."""
        if not self._from_master(context, SESSION_WAIT_S):
            logger.warning("refused %s from %s: not this worker's master", what, context.peer())
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{what}: this worker takes it only from the master it registered with",
            )

    def InitModel(self, request: pb.InitModelRequest, context) -> pb.InitModelReply:  # noqa: N802
        self._require_master(context, "InitModel")
        self._touch()
        from xllm_py.parallel.context import SINGLE
        from xllm_py.worker.worker import Worker

        parallel = SINGLE
        if request.init_method:  # tensor/expert parallel: meet every rank of the cluster
            layout = ClusterLayout(
                request.world_size, request.dp_size, request.ep_size, request.dp_attention
            )
            parallel = join_process_groups(
                layout,
                request.rank,
                self.config.device.device,
                request.init_method,
                self.process_group_timeout,
            )

        logger.info(
            "rank %d of %d (replica %d of %d): loading the model",
            request.rank,
            request.world_size,
            request.replica,
            request.dp_size,
        )
        worker = Worker(self.config, parallel)
        capacity = worker.determine_num_blocks()  # with the replica's other ranks (TP)
        logger.info("rank %d: %d KV blocks fit after loading", request.rank, capacity)
        self.worker, self.capacity = worker, capacity
        self._touch()
        return pb.InitModelReply(
            backend=backend_for(self.config.device.device) if request.init_method else "",
            capacity=capacity,
        )

    def AllocateCache(self, request: pb.AllocateCacheRequest, context) -> pb.AllocateCacheReply:  # noqa: N802
        self._require_master(context, "AllocateCache")
        self._touch()
        if self.worker is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "AllocateCache before InitModel")
        if request.num_blocks > self.capacity:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"asked for {request.num_blocks} KV blocks but only {self.capacity} fit",
            )
        self.worker.init_cache(request.num_blocks, request.seed)
        self._touch()
        return pb.AllocateCacheReply()

    def Health(self, request: pb.HealthRequest, context) -> pb.HealthReply:  # noqa: N802
        if self._from_master(context):  # others (with the token) may ask, but are no contact
            self._touch()
        busy = self._step_lock.locked()  # a step in progress proves the device is alive
        if self.worker is not None and self.worker.device.type != "cpu" and not busy:
            torch.zeros(1, device=self.worker.device).add_(1).item()  # the device answers too
        ready = self.worker is not None and self.worker.runner is not None
        return pb.HealthReply(ready=ready, steps=self.steps, draining=self.draining)

    def ExecuteStep(self, request: pb.ExecuteStepRequest, context) -> pb.ExecuteStepReply:  # noqa: N802
        self._require_master(context, "ExecuteStep")
        self._touch()
        if self.worker is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "ExecuteStep before InitModel")
        with self._step_lock:
            out = self.worker.execute(sched_from_pb(request))
            self.steps += 1
        self._touch()
        return output_to_pb(out)

    def Shutdown(self, request: pb.ShutdownRequest, context) -> pb.ShutdownReply:  # noqa: N802
        self._require_master(context, "Shutdown")
        log = logger.error if request.failure else logger.info
        log("shutdown requested by the master: %s", request.reason)
        self.exit_code = 1 if request.failure else 0
        self.stopped.set()
        return pb.ShutdownReply()


def register(opts: ClusterOptions, request: pb.RegisterRequest) -> str:
    """Register at the master, retrying while it is not up yet; the master's session id.
    A refusal raises ValueError with the master's reason; no master within
    --cluster_timeout raises TimeoutError with the last error (a failing TLS handshake
    looks like a master that is not up)."""
    deadline = time.monotonic() + opts.cluster_timeout
    last = ""
    with opts.security.channel(opts.master_node_addr, CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        while True:
            try:
                reply = stub.Register(request, timeout=max(1.0, deadline - time.monotonic()))
                break
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise ValueError(f"registration refused by the master: {e.details()}") from None
                last = f"{e.code().name}: {e.details()}"
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no master answered at --master_node_addr={opts.master_node_addr} within "
                    f"--cluster_timeout={opts.cluster_timeout:g} s (last error: {last})"
                )
            time.sleep(REGISTER_RETRY_S)
    if not reply.session:
        raise ValueError(
            f"the master at --master_node_addr={opts.master_node_addr} sent no session id "
            "(a different xllm version?)"
        )
    return reply.session


def serve_worker(
    service: WorkerService, address: str, flags: str, security: ClusterSecurity = INSECURE
) -> grpc.Server:
    """The Worker service on `address` (ValueError naming `flags` if it cannot listen)."""
    server = security.server(max_workers=4, options=CHANNEL_OPTIONS)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    security.listen(server, address, flags)
    server.start()
    return server


def run_worker_node(
    opts: ClusterOptions, config: EngineConfig, host: str, port: int, drain_s: float = 30.0
) -> int:
    """Serve as worker `opts.node_rank` until Shutdown, until the master goes quiet, or
    after a signal (drain_s: --shutdown_timeout); the process exit code (0 clean, 1
    failure, 2 refused at registration)."""
    if config.device.device != "cpu":
        backend_for(config.device.device)  # fail early if e.g. torch_npu is missing
    warn_if_open(opts.security, f"worker {opts.node_rank}")
    service = WorkerService(config, opts.process_group_timeout)
    address = f"{host}:{port}"
    server = serve_worker(service, address, f"--host={host} --port={port}", opts.security)
    logger.info("worker %d serving on %s; registering", opts.node_rank, address)
    request = pb.RegisterRequest(
        node_rank=opts.node_rank,
        device=config.device.device,
        address=address,
        fingerprint=model_fingerprint(config),
        layout=opts.layout.to_pb(),
    )
    try:
        service.registered(register(opts, request))
        _drain_on_signals(service)
        code = _serve(service, opts, drain_s)
        if code:  # a step of this rank may wait in a collective for a rank that is gone
            abort_process_groups()
        return code
    finally:
        server.stop(grace=1.0).wait()


def _drain_on_signals(service: WorkerService) -> None:
    """SIGTERM/SIGINT mark the worker draining (the master learns it from Health); the
    handler only sets fields, `_serve` acts on them. Only the main thread can do this."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_signal(signum, frame) -> None:
        service.signals += 1
        service.draining = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def _serve(service: WorkerService, opts: ClusterOptions, drain_s: float) -> int:
    drain_deadline = None
    while not service.stopped.wait(0.5):
        if service.draining and drain_deadline is None:
            drain_deadline = time.monotonic() + drain_s + DRAIN_MARGIN_S
            logger.info(
                "signal received: draining; still serving steps while the master finishes "
                "its requests (up to --shutdown_timeout=%g s + %g s)",
                drain_s,
                DRAIN_MARGIN_S,
            )
        code = _give_up(service, opts, drain_deadline)
        if code is not None:
            return code
    return service.exit_code or 0


def _give_up(
    service: WorkerService, opts: ClusterOptions, drain_deadline: float | None
) -> int | None:
    """1 when this worker stops waiting for the master's Shutdown, else None."""
    silent = time.monotonic() - service.last_contact
    if silent > opts.heartbeat_timeout:
        logger.error(
            "no word from the master at %s for %.1f s (--heartbeat_timeout=%g); exiting",
            opts.master_node_addr,
            silent,
            opts.heartbeat_timeout,
        )
        return 1
    if service.signals > 1:
        logger.warning("a second signal: exiting without waiting for the master")
        return 1
    if drain_deadline is not None and time.monotonic() > drain_deadline:
        logger.error("the master did not shut the cluster down after the signal; exiting")
        return 1
    return None
