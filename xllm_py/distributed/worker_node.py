"""Nodes 1..N-1: a Worker behind a gRPC service, driven by the master.

    start Worker service on --host:--port
    Register at --master_node_addr (retried until --cluster_timeout; refused: exit 2)
    InitModel: load the model, measure the KV blocks that fit <- master
    AllocateCache: allocate the replica's blocks (its ranks' minimum) <- master
    Health every second, ExecuteStep per step               <- master
    Shutdown (exit 0, or 1 after a failure elsewhere); no word from the master for
    --heartbeat_timeout seconds: exit 1

The servicer is thin: it converts at the edge (wire.py) and delegates to `Worker`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
import torch

from xllm_py.config import EngineConfig
from xllm_py.distributed import cluster_pb2 as pb
from xllm_py.distributed import cluster_pb2_grpc as pb_grpc
from xllm_py.distributed.coordinator import listen
from xllm_py.distributed.layout import (
    ClusterLayout,
    ClusterOptions,
    abort_process_groups,
    backend_for,
    join_process_groups,
    model_fingerprint,
)
from xllm_py.distributed.wire import output_to_pb, sched_from_pb
from xllm_py.executor.grpc_executor import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)
REGISTER_RETRY_S = 0.5


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
        self._step_lock = threading.Lock()

    def _touch(self) -> None:
        self.last_contact = time.monotonic()

    def InitModel(self, request: pb.InitModelRequest, context) -> pb.InitModelReply:  # noqa: N802
        self._touch()
        from xllm_py.distributed.parallel import SINGLE
        from xllm_py.worker.worker import Worker

        parallel = SINGLE
        if request.init_method:  # tensor/expert parallel: meet every rank of the cluster
            layout = ClusterLayout(request.world_size, request.dp_size, request.ep_size)
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
        self._touch()
        busy = self._step_lock.locked()  # a step in progress proves the device is alive
        if self.worker is not None and self.worker.device.type != "cpu" and not busy:
            torch.zeros(1, device=self.worker.device).add_(1).item()  # the device answers too
        ready = self.worker is not None and self.worker.runner is not None
        return pb.HealthReply(ready=ready, steps=self.steps)

    def ExecuteStep(self, request: pb.ExecuteStepRequest, context) -> pb.ExecuteStepReply:  # noqa: N802
        self._touch()
        if self.worker is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "ExecuteStep before InitModel")
        with self._step_lock:
            out = self.worker.execute(sched_from_pb(request))
            self.steps += 1
        self._touch()
        return output_to_pb(out)

    def Shutdown(self, request: pb.ShutdownRequest, context) -> pb.ShutdownReply:  # noqa: N802
        log = logger.error if request.failure else logger.info
        log("shutdown requested by the master: %s", request.reason)
        self.exit_code = 1 if request.failure else 0
        self.stopped.set()
        return pb.ShutdownReply()


def register(opts: ClusterOptions, request: pb.RegisterRequest) -> None:
    """Register at the master, retrying while it is not up yet. A refusal raises ValueError
    with the master's reason; no master within --cluster_timeout raises TimeoutError."""
    deadline = time.monotonic() + opts.cluster_timeout
    with grpc.insecure_channel(opts.master_node_addr, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        while True:
            try:
                stub.Register(request, timeout=max(1.0, deadline - time.monotonic()))
                return
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise ValueError(f"registration refused by the master: {e.details()}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no master answered at --master_node_addr={opts.master_node_addr} within "
                    f"--cluster_timeout={opts.cluster_timeout:g} s"
                )
            time.sleep(REGISTER_RETRY_S)


def run_worker_node(opts: ClusterOptions, config: EngineConfig, host: str, port: int) -> int:
    """Serve as worker `opts.node_rank` until Shutdown or until the master goes quiet; the
    process exit code (0 clean, 1 failure, 2 refused at registration)."""
    if config.device.device != "cpu":
        backend_for(config.device.device)  # fail early if e.g. torch_npu is missing
    service = WorkerService(config, opts.process_group_timeout)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    address = f"{host}:{port}"
    listen(server, address, f"--host={host} --port={port}")
    server.start()
    logger.info("worker %d serving on %s; registering", opts.node_rank, address)
    request = pb.RegisterRequest(
        node_rank=opts.node_rank,
        device=config.device.device,
        address=address,
        fingerprint=model_fingerprint(config),
        layout=opts.layout.to_pb(),
    )
    try:
        register(opts, request)
        service._touch()
        code = _serve(service, opts)
        if code:  # a step of this rank may wait in a collective for a rank that is gone
            abort_process_groups()
        return code
    finally:
        server.stop(grace=1.0).wait()


def _serve(service: WorkerService, opts: ClusterOptions) -> int:
    while not service.stopped.wait(0.5):
        silent = time.monotonic() - service.last_contact
        if silent > opts.heartbeat_timeout:
            logger.error(
                "no word from the master at %s for %.1f s (--heartbeat_timeout=%g); exiting",
                opts.master_node_addr,
                silent,
                opts.heartbeat_timeout,
            )
            return 1
    return service.exit_code or 0
