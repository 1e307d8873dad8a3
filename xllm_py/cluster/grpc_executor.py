"""Executor of one replica whose ranks are remote workers, over gRPC.

    engine core --SchedulerOutput--> GrpcExecutor --ExecuteStep (same request)--> rank 0..tp-1
                <--ModelRunnerOutput-- (rank 0's reply; every rank must succeed) <--

With tp_size > 1 the replica's ranks run the same step together (their collectives meet
inside the model), so the step goes to all of them at once and only rank 0's reply is
used: every rank samples the same tokens from the same all-reduced logits. With tp_size
== 1 (data parallelism today) there is one rank.

Start-up has two phases: InitModel (every rank loads its shard and reports the KV
blocks that fit, measured after loading) and AllocateCache (every rank allocates the
replica's minimum), so no rank is asked for more than it measured.

A step waits for its replies under a deadline (--step_timeout) and also gives up as soon
as the health monitor declares any worker dead, so a hung worker fails the step within
--heartbeat_timeout instead of the full deadline. When this process is a rank of the
replica too (MasterReplicaExecutor), its own part of the step runs on a step thread that
can be abandoned: on a failure the process groups are aborted (NCCL/HCCL then fail the
stuck collective at once) and the step fails without waiting for --process_group_timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from xllm_py.cluster import cluster_pb2 as pb
from xllm_py.cluster import cluster_pb2_grpc as pb_grpc
from xllm_py.cluster.security import INSECURE, SESSION_KEY, ClusterSecurity
from xllm_py.cluster.wire import output_from_pb, sched_to_pb
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
    """The master's handle on one remote rank: its Worker service's stub. Every call
    carries the cluster token (if any) and `session`, the master's id from its
    RegisterReply, without which the worker refuses all but Health."""

    def __init__(
        self, rank: int, address: str, session: str, security: ClusterSecurity = INSECURE
    ) -> None:
        self.rank = rank
        self.address = address
        self.channel = security.channel(address, CHANNEL_OPTIONS, [(SESSION_KEY, session)])
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
        init_seed: int = 0,
    ) -> None:
        """clients: the replica's ranks, rank 0 first. init: the InitModel fields shared by
        the replica's ranks (rank is filled in per call). failure: the health monitor's
        verdict, None while every worker is alive."""
        self.clients = clients
        self.init = init
        self.step_timeout = step_timeout
        self.failure = failure
        self.steps = 0
        self.seed = init_seed
        self.capacities: list[int] | None = None  # per rank, from InitModel

    def determine_num_blocks(self) -> int:
        """InitModel to every rank at once (a tensor-parallel replica's ranks meet in their
        process group's rendezvous): each loads its shard and reports the blocks that fit."""
        if self.capacities is None:
            self.capacities = self.capacities_of(self.send_init())
        return min(self.capacities)

    def capacities_of(self, init_futures: list) -> list[int]:
        replies = self._wait_all(init_futures, "InitModel")
        for c, r in zip(self.clients, replies):
            logger.info("%r: %d KV blocks fit after loading", c, r.capacity)
        return [r.capacity for r in replies]

    def init_cache(self, num_blocks: int) -> None:
        """AllocateCache to every rank: the replica's blocks (at most each one's capacity)."""
        self._wait_all(self.send_allocate(num_blocks), "AllocateCache")

    def send_step(self, sched: SchedulerOutput, timeout: float | None = None) -> list:
        """ExecuteStep to every rank, not waiting: one future per rank (deadline
        --step_timeout unless `timeout` is given)."""
        req = sched_to_pb(sched)
        timeout = timeout or self.step_timeout
        return [c.stub.ExecuteStep.future(req, timeout=timeout) for c in self.clients]

    def send_init(self) -> list:
        """InitModel to every rank, not waiting: one future per rank."""
        futures = []
        for c in self.clients:
            req = pb.InitModelRequest()
            req.CopyFrom(self.init)
            req.rank = c.rank
            futures.append(c.stub.InitModel.future(req, timeout=INIT_TIMEOUT_S))
        return futures

    def send_allocate(self, num_blocks: int) -> list:
        """AllocateCache to every rank, not waiting: one future per rank."""
        req = pb.AllocateCacheRequest(num_blocks=num_blocks, seed=self.seed)
        return [c.stub.AllocateCache.future(req, timeout=INIT_TIMEOUT_S) for c in self.clients]

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        replies = self._wait_all(self.send_step(sched), f"step {self.steps}")
        self.steps += 1
        return output_from_pb(replies[0])

    def _wait_all(self, futures: list, what: str) -> list:
        """Every reply, in rank order; the first failure (or a dead worker) cancels the rest."""
        while not all(f.done() for f in futures):
            self._check(futures, what)
            _wait_briefly(next(f for f in futures if not f.done()))
        self._check(futures, what)
        return [f.result() for f in futures]

    def wait_local(self, local: Future, futures: list, what: str):
        """Wait for this process's own part of a step (`local`) while watching the remote
        ranks' `futures`, which are left running; local's result, or the first failure."""
        while not local.done():
            self._check(futures, what)
            dead = self.failure()
            if dead:  # e.g. a rank that stopped answering while this one waits for it
                self._cancel(futures)
                raise WorkerFailedError(f"{what} abandoned: {dead}")
            _wait_briefly(local)
        if local.exception() is not None:
            self._cancel(futures)
        return local.result()

    def _check(self, futures: list, what: str) -> None:
        """Raise (cancelling every future) if a rank failed or the monitor saw one die."""
        for client, f in zip(self.clients, futures):
            if f.done():
                try:
                    f.result()
                except grpc.RpcError as e:
                    self._cancel(futures)
                    raise rpc_error(client, what, e) from None
        dead = self.failure()
        if dead and not all(f.done() for f in futures):
            self._cancel(futures)
            raise WorkerFailedError(f"{what} abandoned: {dead}")

    @staticmethod
    def _cancel(futures: list) -> None:
        for f in futures:
            f.cancel()

    def shutdown(self, reason: str = "master shutting down", failure: bool = False) -> None:
        for c in self.clients:
            c.shutdown(reason, failure)
            c.close()


def _wait_briefly(future) -> None:
    """Block on one outstanding reply (a gRPC future, or the local step's) for at most
    POLL_S; returns as soon as it lands. Failures are reported by the caller's next pass."""
    try:
        future.result(timeout=POLL_S)
    except Exception:  # noqa: BLE001 - a timeout, an RpcError or the local step's error
        pass


class StepThread:
    """One daemon thread that runs this process's part of its replica's steps. A step stuck
    in a collective (a rank that stopped participating) can be given up on: the caller
    stops waiting, and the process can still exit (a daemon thread does not hold it)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(e)


class MasterReplicaExecutor(Executor):
    """Replica 0 of a tensor-parallel cluster: rank 0 is this process's own worker, ranks
    1..tp-1 are remote (none with DP attention, where this rank still joins the world
    group: the MoE layers exchange tokens with the other replicas). Every step runs on
    all of them at once (their collectives meet in the model); the local rank's output is
    the replica's.

    Start-up: InitModel goes to the remote ranks (each joins the process groups, loads its
    shard and measures the blocks that fit) while this process joins the same groups
    (`join`), loads its own shard and measures its own; the replica uses the smallest
    capacity of all its ranks. The local rank's steps run on a `StepThread`: if any rank
    fails or the health monitor declares one dead, the process groups are aborted and the
    step fails at once rather than when the stuck collective times out."""

    def __init__(self, config, join, remote: GrpcExecutor, abort: Callable[[], None]) -> None:
        from xllm_py.worker.worker import Worker

        self.remote = remote
        self.seed = config.device.seed
        self.abort = abort
        self.thread = StepThread("xllm-rank0-step")
        futures = remote.send_init()
        try:
            self.worker = self._local(lambda: Worker(config, join()), futures, "InitModel")
            # measured now, while the remote ranks measure theirs: on an accelerator the
            # profiling forwards of a replica all-reduce together
            self.local_blocks = self._local(self.worker.determine_num_blocks, futures, "InitModel")
        except BaseException:
            remote._cancel(futures)
            raise
        # none remote with DP attention: replica 0 is this rank alone
        self.remote_blocks = min(remote.capacities_of(futures), default=self.local_blocks)

    def _local(self, fn: Callable, futures: list, what: str):
        """fn() on the step thread, waited for with the remote ranks' `futures` (whose
        replies are left for the caller); any failure aborts the process groups."""
        try:
            return self.remote.wait_local(self.thread.submit(fn), futures, what)
        except BaseException:
            logger.error("%s failed; aborting the process groups", what)
            self.abort()
            raise

    def determine_num_blocks(self) -> int:
        return min(self.local_blocks, self.remote_blocks)

    def init_cache(self, num_blocks: int) -> None:
        futures = self.remote.send_allocate(num_blocks)
        self._local(lambda: self.worker.init_cache(num_blocks, self.seed), futures, "AllocateCache")
        self.remote._wait_all(futures, "AllocateCache")
        if self.worker.graph_mode and not self.worker.parallel.dp_attention:
            # An empty step, during which every rank compiles its graphs (Worker.execute):
            # their dummy steps all-reduce, so the ranks must do it together. (Under DP
            # attention every rank compiled in init_cache, all at once.)
            futures = self.remote.send_step(SchedulerOutput(), timeout=INIT_TIMEOUT_S)
            self._local(lambda: self.worker.execute(SchedulerOutput()), futures, "warm-up")
            self.remote._wait_all(futures, "graph compilation")

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        futures = self.remote.send_step(sched)
        what = f"step {self.remote.steps}"
        out = self._local(lambda: self.worker.execute(sched), futures, what)
        self.remote._wait_all(futures, what)
        self.remote.steps += 1
        return out

    def shutdown(self, reason: str = "master shutting down", failure: bool = False) -> None:
        self.remote.shutdown(reason, failure)
