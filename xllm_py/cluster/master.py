"""Node 0: the cluster's start-up and its engine core.

    1. serve Coordinator on --master_node_addr; poll each worker's Health once registered
    2. wait until ranks 1..N-1 registered (--cluster_timeout; the error names missing ranks)
    3. build the replicas at once: replica 0 = this process's own worker (in-process),
       replica i = GrpcExecutor over ranks of replica i (InitModel: load and measure the
       KV blocks that fit; AllocateCache: the minimum over the replica's ranks)
    4. hand the DataParallelEngineCore to the HTTP server, as a one-node daemon would its
       EngineCore

`Cluster.shutdown` sends Shutdown to every worker (failure=True after an engine failure,
so they exit non-zero too) and stops the coordination service and the monitor.

Every channel and service uses `opts.security` (token, TLS); the workers' stubs also
carry the coordinator's session id. A worker that reports it is draining (SIGTERM on
it) is handed to `on_drain`: the daemon drains its HTTP API as on its own SIGTERM and
then shuts the cluster down with failure=False.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from xllm_py.cluster import cluster_pb2 as pb
from xllm_py.cluster.coordinator import Coordinator, serve_coordinator
from xllm_py.cluster.grpc_executor import GrpcExecutor, MasterReplicaExecutor, WorkerClient
from xllm_py.cluster.health import HealthMonitor
from xllm_py.cluster.layout import (
    ClusterOptions,
    abort_process_groups,
    join_process_groups,
    model_fingerprint,
    rendezvous_address,
)
from xllm_py.cluster.security import warn_if_open
from xllm_py.config import EngineConfig
from xllm_py.engine.dp_engine_core import DataParallelEngineCore
from xllm_py.engine.engine_core import local_executor

logger = logging.getLogger(__name__)


class Cluster:
    def __init__(
        self,
        opts: ClusterOptions,
        config: EngineConfig,
        on_drain: Callable[[str], None] = lambda why: None,
    ) -> None:
        """on_drain(why): a worker is shutting down (called from the monitor's thread)."""
        self.opts = opts
        self.config = config
        warn_if_open(opts.security, "master")
        self.monitor = HealthMonitor(opts.heartbeat_timeout, on_drain)
        self.clients: dict[int, WorkerClient] = {}
        self.coordinator = Coordinator(opts.layout, model_fingerprint(config))
        self.coordinator.on_register = self._watch
        self.server = serve_coordinator(opts.master_node_addr, self.coordinator, opts.security)
        self.core: DataParallelEngineCore | None = None

    def _watch(self, reg: pb.RegisterRequest) -> None:
        session, security = self.coordinator.session, self.opts.security
        client = WorkerClient(reg.node_rank, reg.address, session, security)
        self.clients[reg.node_rank] = client
        self.monitor.add(client)

    def start(self) -> DataParallelEngineCore:
        """Steps 2-4: wait for the workers, load every replica, return the engine core."""
        layout = self.opts.layout
        self.coordinator.wait_all(self.opts.cluster_timeout)
        logger.info("all %d nodes registered; loading %d replicas", layout.nnodes, layout.dp_size)
        if layout.tp_size == 1 and not layout.dp_attention:
            factories = [lambda: local_executor(self.config)]
        else:  # this process is rank 0 of replica 0 and joins the process groups too
            factories = [self._master_replica_executor]
        factories += [lambda i=i: self._replica_executor(i) for i in range(1, layout.dp_size)]
        self.core = DataParallelEngineCore(
            self.config, factories, self.monitor.verdict, self._stop_services, layout.dp_attention
        )
        return self.core

    def _master_replica_executor(self) -> MasterReplicaExecutor:
        layout, init_method = self.opts.layout, rendezvous_address(self.opts.master_node_addr)
        return MasterReplicaExecutor(
            self.config,
            lambda: join_process_groups(
                layout, 0, self.config.device.device, init_method, self.opts.process_group_timeout
            ),
            self._replica_executor(0, first_rank=1),
            abort_process_groups,
        )

    def _replica_executor(self, replica: int, first_rank: int = 0) -> GrpcExecutor:
        """The remote ranks of a replica (from `first_rank` within it) behind one executor."""
        layout = self.opts.layout
        init = pb.InitModelRequest(
            world_size=layout.nnodes,
            dp_size=layout.dp_size,
            tp_size=layout.tp_size,
            ep_size=layout.ep_size,
            replica=replica,
            # tensor parallel: every rank joins the process groups at the master's rendezvous
            init_method=rendezvous_address(self.opts.master_node_addr)
            if layout.tp_size > 1 or layout.dp_attention
            else "",
            dp_attention=layout.dp_attention,
        )
        clients = [self.clients[r] for r in layout.ranks_of(replica)[first_rank:]]
        return GrpcExecutor(
            clients, init, self.opts.step_timeout, self.monitor.verdict, self.config.device.seed
        )

    def _stop_services(self) -> None:
        self.monitor.stop()
        self.server.stop(grace=0.5)

    def shutdown(self, reason: str, failure: bool) -> None:
        """Tell every worker to exit (non-zero when `failure`); also after a failed start."""
        if self.core is not None:
            self.core.shutdown(reason, failure)
            return
        self._stop_services()
        for c in self.clients.values():
            c.shutdown(reason, failure)
