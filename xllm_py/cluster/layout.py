"""The parallel layout of a cluster and the fingerprint every node must share.

    world = nnodes ranks, one device each; rank = node rank
    dp_size replicas of tp_size = world / dp_size consecutive ranks:

        nnodes=4, dp_size=2:   replica 0 = ranks [0, 1]   replica 1 = ranks [2, 3]

Replica 0 always contains node 0 (the master).

DP attention (--enable_dp_attention): dp_size = nnodes replicas of one rank each, which
share the routed experts (ep_size = nnodes; parallel/context.py): every rank joins one
world group, over which the MoE layers exchange tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from xllm_py.cluster import cluster_pb2 as pb
from xllm_py.cluster.security import INSECURE, ClusterSecurity
from xllm_py.config import EngineConfig, config_file


@dataclass(frozen=True)
class ClusterLayout:
    nnodes: int = 1
    dp_size: int = 1
    ep_size: int = 1
    dp_attention: bool = False

    def __post_init__(self) -> None:
        for name in ("nnodes", "dp_size", "ep_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)}: must be >= 1")
        if self.dp_attention:
            if self.nnodes < 2 or self.dp_size != self.nnodes or self.ep_size != self.nnodes:
                raise ValueError(
                    f"--enable_dp_attention needs --dp_size and --ep_size equal to --nnodes "
                    f"(>= 2): every rank its own requests, the routed experts spread over all; "
                    f"got --nnodes={self.nnodes} --dp_size={self.dp_size} "
                    f"--ep_size={self.ep_size} (tensor parallelism inside a DP rank is not "
                    "implemented)"
                )
            return
        if self.nnodes % self.dp_size:
            raise ValueError(
                f"--nnodes={self.nnodes} is not divisible by --dp_size={self.dp_size}: every "
                "replica needs the same number of ranks"
            )
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"--ep_size={self.ep_size}: must be 1 or the ranks per replica "
                f"(nnodes / dp_size = {self.tp_size})"
            )

    @property
    def tp_size(self) -> int:
        return self.nnodes // self.dp_size

    def replica_of(self, rank: int) -> int:
        return rank // self.tp_size

    def ranks_of(self, replica: int) -> list[int]:
        return list(range(replica * self.tp_size, (replica + 1) * self.tp_size))

    def check_model(self, model) -> None:
        """The model must split evenly: attention heads over the ranks of a replica, routed
        experts over ep_size (ValueError naming the numbers, at start-up)."""
        if model.num_attention_heads % self.tp_size:
            raise ValueError(
                f"num_attention_heads={model.num_attention_heads} of {model.path} is not "
                f"divisible by the {self.tp_size} ranks per replica (--nnodes={self.nnodes} / "
                f"--dp_size={self.dp_size})"
            )
        if self.ep_size > 1 and model.n_routed_experts % self.ep_size:
            raise ValueError(
                f"n_routed_experts={model.n_routed_experts} of {model.path} is not divisible "
                f"by --ep_size={self.ep_size}"
            )

    def to_pb(self) -> pb.Layout:
        return pb.Layout(
            nnodes=self.nnodes,
            dp_size=self.dp_size,
            ep_size=self.ep_size,
            dp_attention=self.dp_attention,
        )


@dataclass(frozen=True)
class ClusterOptions:
    """This node's place and the cluster's timeouts (the --cluster flags)."""

    layout: ClusterLayout
    node_rank: int
    master_node_addr: str  # host:port of the master's Coordinator service
    cluster_timeout: float = 120.0  # master: wait for registrations; worker: for the master
    heartbeat_timeout: float = 5.0  # silence after which a worker (or the master) is dead
    step_timeout: float = 300.0  # deadline of one ExecuteStep
    process_group_timeout: float = 600.0  # torch.distributed, every rank alike
    security: ClusterSecurity = INSECURE  # cluster token and TLS of every gRPC service and channel

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < self.layout.nnodes:
            raise ValueError(
                f"--node_rank={self.node_rank}: must be in 0..{self.layout.nnodes - 1} "
                f"(--nnodes={self.layout.nnodes})"
            )
        host, _, port = self.master_node_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--master_node_addr={self.master_node_addr!r}: expected host:port")
        for name in (
            "cluster_timeout",
            "heartbeat_timeout",
            "step_timeout",
            "process_group_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name}={getattr(self, name)}: must be > 0 (seconds)")


def model_fingerprint(config: EngineConfig) -> pb.ModelFingerprint:
    """What must match on every node for replicas to produce the same tokens: the model's
    config.json (or params.json) bytes, the run dtype, the MTP draft count and the KV block size."""
    config_sha = hashlib.sha256(config_file(config.model.path).read_bytes()).hexdigest()
    dtype = str(config.device.torch_dtype()).removeprefix("torch.")
    k, bs = config.spec.num_speculative_tokens, config.cache.block_size
    digest = hashlib.sha256(f"{config_sha}|{dtype}|{k}|{bs}".encode()).hexdigest()
    return pb.ModelFingerprint(
        config_sha256=config_sha,
        dtype=dtype,
        num_speculative_tokens=k,
        block_size=bs,
        digest=digest,
    )


def fingerprint_differences(master: pb.ModelFingerprint, worker: pb.ModelFingerprint) -> list[str]:
    """One phrase per field that differs, e.g. "block_size: master 16, worker 32"."""
    out = []
    for name, what in (
        ("config_sha256", "config.json sha256 (a different model or config)"),
        ("dtype", "dtype"),
        ("num_speculative_tokens", "num_speculative_tokens"),
        ("block_size", "block_size"),
    ):
        a, b = getattr(master, name), getattr(worker, name)
        if a != b:
            out.append(f"{what}: master {a}, worker {b}")
    if not out and master.digest != worker.digest:
        out.append("fingerprint digest (different xllm versions?)")
    return out


def layout_differences(master: ClusterLayout, worker: pb.Layout) -> list[str]:
    return [
        f"--{name}: master {getattr(master, name)}, worker {getattr(worker, name)}"
        for name in ("nnodes", "dp_size", "ep_size", "dp_attention")
        if getattr(master, name) != getattr(worker, name)
    ]


def backend_for(device: str) -> str:
    """The torch.distributed backend of a device: gloo (cpu), nccl (cuda), hccl (npu)."""
    kind = device.split(":")[0]
    if kind == "npu":
        import torch_npu  # noqa: F401 - registers the hccl backend

        return "hccl"
    return {"cpu": "gloo", "cuda": "nccl"}[kind]


def rendezvous_address(master_node_addr: str) -> str:
    """torch.distributed's TCP rendezvous: the master's host, the coordination port + 1."""
    host, port = master_node_addr.rsplit(":", 1)
    return f"tcp://{host}:{int(port) + 1}"


def join_process_groups(
    layout: ClusterLayout, rank: int, device: str, init_method: str, timeout_s: float
):
    """Every rank of the cluster calls this once, together: the world group, then one group
    per replica (created by all ranks in the same order, as torch.distributed requires).
    Returns this rank's ParallelContext inside its replica."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from xllm_py.parallel.context import ParallelContext

    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=layout.nnodes,
        timeout=timedelta(seconds=timeout_s),
        # bound to its device: NCCL creates its communicator now, not at the first collective
        device_id=None if device == "cpu" else torch.device(device),
    )
    if layout.dp_attention:
        return ParallelContext.for_dp_attention()
    groups = [dist.new_group(layout.ranks_of(i)) for i in range(layout.dp_size)]
    return ParallelContext.from_group(groups[layout.replica_of(rank)], layout.ep_size)


def abort_process_groups() -> None:
    """Give up this process's process groups after a cluster failure. On NCCL and HCCL a
    collective stuck waiting for a dead or hung rank fails at once instead of at
    --process_group_timeout. gloo cannot interrupt a collective in flight (it fails when
    the peer's connection closes, or at the timeout); the caller abandons the thread that
    waits in it."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    if dist.is_initialized():
        _abort_process_group()


# ---- from the flags -------------------------------------------------------------------------


def options_from_args(a, read_secrets: bool = False) -> ClusterOptions:
    """The cluster flags of EngineArgs `a` as ClusterOptions (ValueError naming the flag if
    inconsistent); with `read_secrets`, also the token and TLS files (read now)."""
    from xllm_py.cluster.security import load_security

    return ClusterOptions(
        ClusterLayout(a.nnodes, a.dp_size, a.ep_size, a.enable_dp_attention),
        a.node_rank,
        a.master_node_addr or "127.0.0.1:1",
        a.cluster_timeout,
        a.heartbeat_timeout,
        a.step_timeout,
        a.process_group_timeout,
        load_security(*security_flags(a)) if read_secrets else INSECURE,
    )


def security_flags(a) -> tuple:
    return (
        a.cluster_token,
        a.cluster_token_file,
        a.cluster_tls_cert,
        a.cluster_tls_key,
        a.cluster_tls_ca,
    )


def check_args(a) -> None:
    """The cluster flags of a cluster's node (EngineArgs.is_cluster): the layout itself
    (divisibility, ep_size) and the token and TLS flags, named only (their files are read
    at start-up); ValueError naming the flag."""
    from xllm_py.cluster.security import check_flags

    options_from_args(a)
    check_flags(*security_flags(a))
