"""Place a cluster on a Ray cluster: `xllm --launcher=ray --nnodes=N ...`.

What scripts/launch_cluster.sh does with shells and SSH, done with Ray:

1. Connect to `--ray_address` ("auto": the cluster this host belongs to, else a local
   one started here and stopped on exit; or host:port). A local instance gets a token
   of this launch for Ray's token authentication (RAY_AUTH_TOKEN, in the environment of
   its processes only) unless the user gave one (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH):
   left to itself, Ray >= 2.60 writes a new ~/.ray/auth_token there, which every later
   `ray start --head` on the host then enforces, refusing clients that were given an
   address (InvalidAuthToken) unless they set RAY_AUTH_MODE=token. What is left on the
   host is the instance's session folder (/tmp/ray/session_*, its logs).
2. One placement group with a bundle per node: {"GPU": 1} on cuda, {"NPU": 1} on npu,
   {"CPU": --ray_cpus_per_node} on cpu. Bundle 0 also asks for a sliver of this host's
   `node:<ip>` resource, so node 0 (the master, with the HTTP API) runs where the
   launcher was started.
3. In each bundle a `NodeProcess` actor starts the same entry point the launch script
   does (`python -m xllm_py ... --node_rank=i`), so gRPC and torch.distributed are
   unchanged. Ray sets the bundle's device visible (CUDA_VISIBLE_DEVICES /
   ASCEND_RT_VISIBLE_DEVICES) and the node is told `--devices=cuda:0` (npu:0), the one
   device it sees. Workers listen on their host's address at a free port; the master's
   coordination service on this host at the port of --master_node_addr (or a free one
   whose next port, torch.distributed's rendezvous, is free too). Free ports come from
   below the kernel's ephemeral range (cluster/ports.py).
   Every line a node prints reaches this terminal prefixed with `[node i]`.
   A node's command line is the launcher's options (those not at their default) with
   its own rank, and never a secret: every node gets the same cluster token in its
   environment (XLLM_CLUSTER_TOKEN): the launcher's own --cluster_token_file /
   --cluster_token / XLLM_CLUSTER_TOKEN, or one generated for this launch; node 0 also
   gets the API key (--api_key or XLLM_API_KEY) as XLLM_API_KEY. --cluster_tls_* paths
   are passed on as they are, so the files must exist on every host.
4. The launcher waits. When the master exits, the workers are stopped and its exit code
   is the launcher's. When a worker dies (its process exits or its actor is killed), the
   master finds out by its health checks (--heartbeat_timeout), fails the requests in
   flight and exits 1; the launcher then exits with that code. SIGTERM or SIGINT to the
   launcher drains the master (--shutdown_timeout) like a SIGTERM to the daemon; so does
   one to a worker's process (the master drains, then shuts every node down, exit 0).
   Afterwards, always: node processes stopped, actors killed, the placement group removed.

A node process is started by a thread of its actor that stays alive as long as the
process and asks the kernel to SIGKILL the process when that thread ends
(PR_SET_PDEATHSIG), so a killed actor leaves no node process behind.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from xllm_py.cluster.ports import free_port_run, unpicked_ports

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0  # after the master is gone, how long workers get to exit on their own
RAY_NAMESPACE = "xllm"  # actors are named xllm-node-<rank>-<launcher pid> in it
RAY_TOKEN_SOURCES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")  # besides ~/.ray/auth_token
RAY_AUTH_HINT = (  # what Ray says when a cluster refuses a client without its token
    "if the cluster uses token authentication, set RAY_AUTH_MODE=token and give its token "
    "in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token"
)


def _die_with_parent_thread() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class _NodeProcess:
    """One node of the cluster, inside its placement-group bundle (a Ray actor)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self._started = threading.Event()
        self._exit: int | None = None

    def address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_ports(self, n: int, taken: list[int]) -> int:
        """A port p of this host with p .. p + n - 1 free now, none of them in `taken`,
        from below the kernel's ephemeral range (cluster/ports.py says why)."""
        ports = unpicked_ports()
        return free_port_run(n, ports, secrets.randbelow(max(len(ports), 1)), "", set(taken))

    def visible_devices(self) -> dict[str, str]:
        """The device variables Ray set for this bundle."""
        names = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")
        return {n: os.environ[n] for n in names if n in os.environ}

    def start(self, argv: list[str], env: dict[str, str]) -> int:
        """Start `python -m xllm_py argv` from a thread that lives as long as the process;
        its lines are printed with the node's rank. Returns the pid."""

        def run() -> None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "xllm_py", *argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                text=True,
                bufsize=1,
                preexec_fn=_die_with_parent_thread,
            )
            self._started.set()
            for line in self.proc.stdout:
                print(f"[node {self.rank}] {line}", end="", flush=True)
            self._exit = self.proc.wait()

        self._thread = threading.Thread(target=run, name=f"node-{self.rank}", daemon=True)
        self._thread.start()
        self._started.wait()
        return self.proc.pid

    def wait(self) -> int:
        """The node process's exit code, once it has exited."""
        self._thread.join()
        return self._exit

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._thread.join(5)
        return self.proc.poll()


def node_argv(args, rank: int, master_addr: str, device_type: str) -> list[str]:
    """Node `rank`'s command line: the launcher's options (EngineArgs) as this node runs
    them, without a secret (the token, the API key: `node_env`) or the token's file, which
    may not exist on the node's host."""
    node = dataclasses.replace(
        args,
        launcher="process",
        node_rank=rank,
        master_node_addr=master_addr,
        cluster_token_file=None,
    )
    if device_type in ("cuda", "npu"):
        node.devices = f"{device_type}:0"  # the one device Ray made visible
    return node.node_argv()


def node_env(args, rank: int, token: str) -> dict[str, str]:
    """Node `rank`'s environment additions: the cluster token, and on node 0 (the HTTP
    server) the API key. Ray hands them to the actor as call arguments, never on a
    command line."""
    from xllm_py.tokens import TOKEN_ENV

    env = {"PYTHONUNBUFFERED": "1", TOKEN_ENV: token}
    if rank == 0:
        env.update({k: v for k, v in args.secret_env().items() if k != TOKEN_ENV})
    return env


def cluster_token(args) -> str:
    """The token of every node: the launcher's (--cluster_token_file, --cluster_token,
    XLLM_CLUSTER_TOKEN), else a new random one for this launch."""
    from xllm_py.tokens import read_token

    return read_token(args.cluster_token, args.cluster_token_file) or secrets.token_hex(32)


def bundles(args, driver_ip: str) -> list[dict[str, float]]:
    device = args.devices.split(":")[0]
    if device == "cuda":
        one = {"GPU": 1.0}
    elif device == "npu":
        one = {"NPU": 1.0}
    else:
        one = {"CPU": float(args.ray_cpus_per_node)}
    out = [dict(one) for _ in range(args.nnodes)]
    out[0][f"node:{driver_ip}"] = 0.001  # node 0 on this host
    return out


def _connect(address: str, nnodes: int, cpus_per_node: int):
    """ray.init: the cluster at `address` ("auto": this host's, if any), else a local one
    with room for every CPU bundle and, unless the user gave one, a token of its own
    (none written to ~/.ray). Returns whether a local cluster was started here."""
    import ray

    kw = dict(
        namespace=RAY_NAMESPACE,
        include_dashboard=False,
        log_to_driver=True,
        logging_level=logging.WARNING,
    )
    if address != "local":
        try:
            ray.init(address=address, **kw)
            return False
        except ConnectionError as e:
            if address != "auto":
                raise ConnectionError(f"{e} ({RAY_AUTH_HINT})") from e
    if not any(os.environ.get(v) for v in RAY_TOKEN_SOURCES):  # see the module's docstring
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    cpus = max(os.cpu_count() or 1, nnodes * cpus_per_node)
    ray.init(num_cpus=cpus, **kw)
    logger.info("started a local Ray instance (%d CPUs)", cpus)
    return True


def _node_ports(args, actors, ips: list[str]) -> tuple[str, list[int]]:
    """The master's coordination port (--master_node_addr's, or a free one whose next
    port, torch.distributed's rendezvous, is free too) and each worker's gRPC port, each
    picked by the actor on its host and never handed out twice on one host."""
    import ray

    handed: dict[str, list[int]] = {ip: [] for ip in ips}  # ports picked, per host

    def pick(i: int, n: int) -> int:
        port = ray.get(actors[i].free_ports.remote(n, handed[ips[i]]))
        handed[ips[i]] += range(port, port + n)
        return port

    given = args.master_node_addr.rsplit(":", 1)[1] if args.master_node_addr else None
    master = given or str(pick(0, 2))
    return master, [pick(i, 1) for i in range(1, len(actors))]


def launch(args) -> int:
    """Run the cluster described by `args` (EngineArgs) on Ray; the exit code."""
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError as e:
        raise ValueError(f"--launcher=ray needs Ray: pip install 'xllm_py[ray]' ({e})") from e

    token = cluster_token(args)  # read before Ray starts
    t0 = time.perf_counter()
    own_cluster = _connect(args.ray_address, args.nnodes, args.ray_cpus_per_node)
    device_type = args.devices.split(":")[0]
    driver_ip = ray.util.get_node_ip_address()
    pg = placement_group(bundles(args, driver_ip), strategy="PACK")
    actors = []
    stopping = threading.Event()
    try:
        try:
            ray.get(pg.ready(), timeout=args.cluster_timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"Ray could not place {args.nnodes} bundles of {bundles(args, driver_ip)[-1]} "
                f"within --cluster_timeout={args.cluster_timeout:g} s (resources: "
                f"{ray.available_resources()})"
            ) from None
        remote = ray.remote(_NodeProcess)
        for i in range(args.nnodes):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            opts = {
                "scheduling_strategy": strategy,
                "name": f"xllm-node-{i}-{os.getpid()}",
                "max_concurrency": 4,  # stop() and signal() while wait() blocks
                "num_cpus": 0,  # the bundle's CPUs are the node process's
            }
            if device_type == "cuda":
                opts["num_gpus"] = 1
            elif device_type == "npu":
                opts["resources"] = {"NPU": 1}
            actors.append(remote.options(**opts).remote(i))
        ips = ray.get([a.address.remote() for a in actors])
        master_port, worker_ports = _node_ports(args, actors, ips)
        master_addr = f"{ips[0]}:{master_port}"
        pids = []
        for i, a in enumerate(actors):
            words = node_argv(args, i, master_addr, device_type)
            if i:  # a worker's gRPC service: its host's address, a free port there
                words += ["--host", ips[i], "--port", str(worker_ports[i - 1])]
            pids.append(ray.get(a.start.remote(words, node_env(args, i, token))))
            logger.info(
                "node %d on %s (pid %d) %s",
                i,
                ips[i],
                pids[-1],
                ray.get(a.visible_devices.remote()),
            )
        logger.info(
            "%d nodes started through Ray in %.1f s; the API is on node 0 (%s), port %d",
            args.nnodes, time.perf_counter() - t0, ips[0], args.port,
        )  # fmt: skip
        return _supervise(args, actors, stopping)
    finally:
        for a in actors:
            try:
                ray.get(a.stop.remote(STOP_GRACE_S), timeout=STOP_GRACE_S + 10)
            except Exception:  # noqa: BLE001 - dead actors have nothing left to stop
                pass
            ray.kill(a)
        remove_placement_group(pg)
        if own_cluster:
            ray.shutdown()


def _supervise(args, actors, stopping: threading.Event) -> int:
    """Wait for the master to exit, relaying SIGTERM/SIGINT to it; its exit code (1 when a
    worker died and the master still exited 0)."""
    import ray

    def relay(signum, frame) -> None:
        stopping.set()
        actors[0].signal.remote(signal.SIGTERM)  # the master drains, then exits

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, relay)
    waits = {a.wait.remote(): rank for rank, a in enumerate(actors)}
    worker_died = False
    deadline = None
    while True:
        done, _ = ray.wait(list(waits), num_returns=1, timeout=1.0)
        if not done:
            if deadline is not None and time.monotonic() > deadline:
                logger.error("the master did not exit after a worker died; stopping it")
                actors[0].stop.remote(STOP_GRACE_S)
                deadline = None
            continue
        rank = waits.pop(done[0])
        try:
            code = ray.get(done[0])
        except ray.exceptions.RayActorError as e:
            code = None
            logger.error("node %d: its Ray actor died (%s)", rank, type(e).__name__)
        if rank == 0:
            if code is None:
                return 1
            if code == 0 and worker_died:
                return 1
            logger.info("the master exited with %d; stopping the workers", code)
            return code
        if code != 0 and not stopping.is_set():  # 0: the master shut it down (a drain)
            worker_died = True
            logger.error("node %d exited (%s); the master fails over its health checks", rank,
                         "actor killed" if code is None else f"exit code {code}")  # fmt: skip
            # The master declares the worker dead after --heartbeat_timeout and exits.
            deadline = time.monotonic() + args.heartbeat_timeout + args.shutdown_timeout + 30
