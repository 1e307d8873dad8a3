"""The master's Coordinator service: workers register here, on --master_node_addr.

A registration is accepted only if the worker's rank is free and in 1..nnodes-1, its
layout flags equal the master's and its model fingerprint equals the master's; otherwise
the RPC fails with details naming what differs (the worker prints them and exits 2). The
master keeps waiting for a good registration until --cluster_timeout. An accepted
registration is answered with the master's session id, which the master then sends with
every Worker RPC (security.py: a worker obeys only the master it registered with).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

import grpc

from xllm_py.cluster import cluster_pb2 as pb
from xllm_py.cluster import cluster_pb2_grpc as pb_grpc
from xllm_py.cluster.layout import ClusterLayout, fingerprint_differences, layout_differences
from xllm_py.cluster.security import INSECURE, ClusterSecurity

logger = logging.getLogger(__name__)


class Coordinator(pb_grpc.CoordinatorServicer):
    def __init__(self, layout: ClusterLayout, fingerprint: pb.ModelFingerprint) -> None:
        self.layout = layout
        self.fingerprint = fingerprint
        self.session = secrets.token_hex(16)  # this master's id; see RegisterReply.session
        self.members: dict[int, pb.RegisterRequest] = {}
        self.on_register: Callable[[pb.RegisterRequest], None] = lambda request: None
        self._cond = threading.Condition()

    def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterReply:  # noqa: N802
        with self._cond:  # (an RLock) check and insert at once: one rank, one node
            code, why = self._refusal(request)
            if why:
                why = f"node {request.node_rank} ({request.address}) refused: {why}"
                logger.warning("%s", why)
                context.abort(code, why)
            request = _reachable(request, context.peer())
            self.members[request.node_rank] = request
            self.on_register(request)
            self._cond.notify_all()
        logger.info(
            "node %d registered: %s at %s", request.node_rank, request.device, request.address
        )
        return pb.RegisterReply(world_size=self.layout.nnodes, session=self.session)

    def _refusal(self, r: pb.RegisterRequest) -> tuple[grpc.StatusCode, str]:
        n = self.layout.nnodes
        if not 1 <= r.node_rank < n:
            return grpc.StatusCode.INVALID_ARGUMENT, f"node_rank must be in 1..{n - 1}"
        with self._cond:
            if r.node_rank in self.members:
                other = self.members[r.node_rank].address
                return grpc.StatusCode.ALREADY_EXISTS, f"rank taken by the node at {other}"
        diffs = layout_differences(self.layout, r.layout)
        diffs += fingerprint_differences(self.fingerprint, r.fingerprint)
        if diffs:
            return grpc.StatusCode.FAILED_PRECONDITION, "; ".join(diffs)
        return grpc.StatusCode.OK, ""

    def wait_all(self, timeout: float) -> dict[int, pb.RegisterRequest]:
        """Registrations of ranks 1..nnodes-1, or TimeoutError naming the missing ranks."""
        deadline = time.monotonic() + timeout
        want = set(range(1, self.layout.nnodes))
        with self._cond:
            while not want <= self.members.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = ", ".join(str(r) for r in sorted(want - self.members.keys()))
                    raise TimeoutError(
                        f"no worker registered for node rank(s) {missing} within "
                        f"--cluster_timeout={timeout:g} s"
                    )
                self._cond.wait(left)
            return dict(self.members)


def _reachable(request: pb.RegisterRequest, peer: str) -> pb.RegisterRequest:
    """A worker bound to every interface (--host 0.0.0.0 or ::) announces an address
    nobody can dial; use the address its registration came from instead."""
    host, _, port = request.address.rpartition(":")
    if host.strip("[]") not in ("0.0.0.0", "::", ""):
        return request
    # peer: "ipv4:10.0.0.2:51234" or "ipv6:[fd00::2]:51234"
    peer_host = peer.split(":", 1)[1].rpartition(":")[0] if ":" in peer else ""
    if not peer_host:
        return request
    fixed = pb.RegisterRequest()
    fixed.CopyFrom(request)
    fixed.address = f"{peer_host}:{port}"
    logger.info("node %d announced %s; using %s", request.node_rank, request.address, fixed.address)
    return fixed


def serve_coordinator(
    address: str, coordinator: Coordinator, security: ClusterSecurity = INSECURE
) -> grpc.Server:
    server = security.server(max_workers=4)
    pb_grpc.add_CoordinatorServicer_to_server(coordinator, server)
    security.listen(server, address, f"--master_node_addr={address}")
    server.start()
    logger.info("coordination service listening on %s (%s)", address, security.describe())
    return server
