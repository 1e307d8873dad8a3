"""Executor of one replica whose ranks are remote workers, over gRPC.

    engine core --SchedulerOutput--> GrpcExecutor --ExecuteStep (same request)--> rank 0..tp-1
                <--ModelRunnerOutput-- (rank 0's reply; every rank must succeed) <--

With tp_size > 1 the replica's ranks run the same step together (their collectives meet
inside the model), so the step goes to all of them at once and only rank 0's reply is
used: every rank samples the same tokens from the same all-reduced logits. With tp_size
== 1 (data parallelism today) there is one rank.

A step waits for its replies under a deadline (--step_timeout) and also gives up as soon
as the health monitor declares any worker dead, so a hung worker fails the step within
--heartbeat_timeout instead of the full deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from xllm_py.distributed import cluster_pb2 as pb
from xllm_py.distributed import cluster_pb2_grpc as pb_grpc
from xllm_py.distributed.wire import output_from_pb, sched_to_pb
from xllm_py.executor.base import Executor
from xllm_py.executor.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
POLL_S = 0.05  # how often a waiting step checks the health monitor
INIT_TIMEOUT_S = 3600.0  # loading a large checkpoint can take long; the health monitor still runs


class WorkerFailedError(RuntimeError):
    """A worker died, stopped answering or failed a call; the cluster cannot continue."""


class WorkerClient:
    """The master's handle on one remote rank: its Worker service's stub."""

    def __init__(self, rank: int, address: str, capacity: int) -> None:
        self.rank = rank
        self.address = address
        self.capacity = capacity
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.WorkerStub(self.channel)

    def __repr__(self) -> str:
        return f"worker rank {self.rank} at {self.address}"

    def health(self, timeout: float) -> pb.HealthReply:
        return self.stub.Health(pb.HealthRequest(), timeout=timeout)

    def shutdown(self, reason: str, failure: bool, timeout: float = 2.0) -> None:
        try:
            self.stub.Shutdown(pb.ShutdownRequest(reason=reason, failure=failure), timeout=timeout)
        except grpc.RpcError as e:
            logger.info("%r did not take the shutdown: %s", self, e.code().name)

    def close(self) -> None:
        self.channel.close()


def rpc_error(client: WorkerClient, what: str, e: grpc.RpcError) -> WorkerFailedError:
    return WorkerFailedError(f"{client!r} failed {what}: {e.code().name}: {e.details()}")


class GrpcExecutor(Executor):
    def __init__(
        self,
        clients: list[WorkerClient],
        init: pb.InitModelRequest,
        step_timeout: float,
        failure: Callable[[], str | None] = lambda: None,
    ) -> None:
        """clients: the replica's ranks, rank 0 first. init: the InitModel fields shared by
        the replica's ranks (rank and num_blocks are filled in per call). failure: the
        health monitor's verdict, None while every worker is alive."""
        self.clients = clients
        self.init = init
        self.step_timeout = step_timeout
        self.failure = failure
        self.steps = 0

    def determine_num_blocks(self) -> int:
        return min(c.capacity for c in self.clients)

    def init_cache(self, num_blocks: int) -> None:
        """InitModel to every rank at once (a tensor-parallel replica's ranks meet in their
        process group's rendezvous): each loads its shard and allocates num_blocks."""
        self._wait_all(self.send_init(num_blocks), "InitModel")

    def send_step(self, sched: SchedulerOutput, timeout: float | None = None) -> list:
        """ExecuteStep to every rank, not waiting: one future per rank (deadline
        --step_timeout unless `timeout` is given)."""
        req = sched_to_pb(sched)
        timeout = timeout or self.step_timeout
        return [c.stub.ExecuteStep.future(req, timeout=timeout) for c in self.clients]

    def send_init(self, num_blocks: int) -> list:
        """InitModel to every rank, not waiting: one future per rank."""
        futures = []
        for c in self.clients:
            req = pb.InitModelRequest()
            req.CopyFrom(self.init)
            req.rank, req.num_blocks = c.rank, num_blocks
            futures.append(c.stub.InitModel.future(req, timeout=INIT_TIMEOUT_S))
        return futures

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        replies = self._wait_all(self.send_step(sched), f"step {self.steps}")
        self.steps += 1
        return output_from_pb(replies[0])

    def _wait_all(self, futures: list, what: str) -> list:
        """Every reply, in rank order; the first failure (or a dead worker) cancels the rest."""
        pending = set(range(len(futures)))
        while pending:
            for i in list(pending):
                if futures[i].done():
                    pending.discard(i)
                    try:
                        futures[i].result()
                    except grpc.RpcError as e:
                        self._cancel(futures)
                        raise rpc_error(self.clients[i], what, e) from None
            dead = self.failure()
            if pending and dead:
                self._cancel(futures)
                raise WorkerFailedError(f"{what} abandoned: {dead}")
            if pending:
                _wait_briefly(futures[min(pending)])
        return [f.result() for f in futures]

    @staticmethod
    def _cancel(futures: list) -> None:
        for f in futures:
            f.cancel()

    def shutdown(self, reason: str = "master shutting down", failure: bool = False) -> None:
        for c in self.clients:
            c.shutdown(reason, failure)
            c.close()


def _wait_briefly(future) -> None:
    """Block on one outstanding reply for at most POLL_S; returns as soon as it lands."""
    try:
        future.result(timeout=POLL_S)
    except grpc.FutureTimeoutError:
        pass
    except grpc.RpcError:
        pass  # reported by the caller's next pass


class MasterReplicaExecutor(Executor):
    """Replica 0 of a tensor-parallel cluster: rank 0 is this process's own worker, ranks
    1..tp-1 are remote. Every step runs on all of them at once (their collectives meet in
    the model); the local rank's output is the replica's.

    Start-up: InitModel goes to the remote ranks (each joins the process groups, loads its
    shard and allocates the blocks it reported at registration) while this process joins
    the same groups (`join`) and loads its own shard; the replica then uses the smallest
    capacity of all its ranks (a rank holding more blocks than used is harmless)."""

    def __init__(self, config, join, remote: GrpcExecutor) -> None:
        from xllm_py.worker.worker import Worker

        self.remote = remote
        self.seed = config.device.seed
        capacity = remote.determine_num_blocks()
        futures = remote.send_init(capacity)
        self.worker = Worker(config, join())
        remote._wait_all(futures, "InitModel")
        self.remote_blocks = capacity

    def determine_num_blocks(self) -> int:
        return min(self.worker.determine_num_blocks(), self.remote_blocks)

    def init_cache(self, num_blocks: int) -> None:
        self.worker.init_cache(num_blocks, self.seed)
        if self.worker.graph_mode:
            # An empty step, during which every rank compiles its graphs (Worker.execute):
            # their dummy steps all-reduce, so the ranks must do it together.
            futures = self.remote.send_step(SchedulerOutput(), timeout=INIT_TIMEOUT_S)
            try:
                self.worker.execute(SchedulerOutput())
            except BaseException:
                self.remote._cancel(futures)
                raise
            self.remote._wait_all(futures, "graph compilation")

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        futures = self.remote.send_step(sched)
        try:
            out = self.worker.execute(sched)
        except BaseException:
            self.remote._cancel(futures)
            raise
        self.remote._wait_all(futures, f"step {self.remote.steps}")
        self.remote.steps += 1
        return out

    def shutdown(self, reason: str = "master shutting down", failure: bool = False) -> None:
        self.remote.shutdown(reason, failure)
