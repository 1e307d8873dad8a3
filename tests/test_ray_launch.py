"""`xllm --launcher=ray`: a 2-node tensor-parallel cluster placed on a real Ray instance
(a head started with the `ray` CLI, as an operator's cluster would be), serving held-out
prompts exactly as one node does with the API key it was given kept off every node's
command line, and leaving nothing behind when a node's actor dies.

Ray's state is this module's own (`ray_state`): HOME is a folder of its own that holds a
stale ~/.ray/auth_token, as an earlier `xllm --launcher=ray` on Ray 2.60 left one, and
the tests pass in spite of it and leave it as it was; Ray's temporary folder is its own
too, so nothing is read from or written to the user's home or /tmp/ray."""

from __future__ import annotations

import concurrent.futures
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from tests.server_utils import ROOT, free_port
from tests.test_cluster import (
    HTTP,
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    stream_until_error,
    unhealthy,
    wait_healthy,
)

ray = pytest.importorskip("ray")  # in the dev extra: installed by `make test`

from xllm_py.cli import build_parser  # noqa: E402
from xllm_py.cluster.ray_launch import RAY_NAMESPACE, bundles, node_argv, node_env  # noqa: E402

NUM_PROMPTS = 4  # at once: every step of a tensor-parallel cluster runs on both nodes
FLAGS = ["--dtype=float32", "--nnodes=2", "--max_cache_size=16000000", "--heartbeat_timeout=3"]


STALE_TOKEN = "stale-token-of-an-earlier-launch"  # what the cluster must not use


def reload_ray_auth() -> None:
    """This process's Ray read RAY_AUTH_MODE when it was imported (during collection): it
    reads it again, and its token afresh, as ray.init does when it turns token auth on."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@pytest.fixture(scope="module", autouse=True)
def ray_state(tmp_path_factory):
    """Every process of this module (the `ray` CLI, the launchers, this one) gets a HOME
    of its own holding a stale .ray/auth_token, and Ray's temporary folder of its own
    (RAY_TMPDIR; short: a socket's path has at most 107 bytes), which also holds the
    compile cache. Ray 2.60 turns token auth on for a head started where
    ~/.ray/auth_token exists, with that token, but a client given an address never reads
    it: clients are refused (InvalidAuthToken). So token auth is set explicitly, with a
    token of this module's (RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH), which Ray then reads
    instead of ~/.ray/auth_token. Afterwards no process of this module's Ray is left and
    the fake home is exactly as it was: the stale token unchanged, nothing added."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(STALE_TOKEN)
    token = tmp_path_factory.mktemp("ray_auth") / "auth_token"
    token.write_text(secrets.token_hex(32))
    temp = tempfile.mkdtemp(prefix="xllm-ray-")
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("HOME", str(home))
            env.setenv("RAY_TMPDIR", temp)
            env.setenv("RAY_AUTH_MODE", "token")
            env.setenv("RAY_AUTH_TOKEN_PATH", str(token))
            env.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(temp, "inductor"))  # not ~/.cache
            for name in ("RAY_AUTH_TOKEN", "RAY_ADDRESS"):
                env.delenv(name, raising=False)
            reload_ray_auth()
            yield temp
        reload_ray_auth()
        assert not ray_processes_left(temp)
        assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == [
            ".ray",
            ".ray/auth_token",
        ]
        assert (home / ".ray" / "auth_token").read_text() == STALE_TOKEN
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head(ray_state):
    """A Ray head on this machine (4 logical CPUs: two 1-CPU bundles fit on 2 cores),
    stopped by its own `ray start --block`, so no other Ray instance on the host is."""
    port = free_port()
    ray_exe = os.path.join(os.path.dirname(sys.executable), "ray")
    flags = [f"--port={port}", "--num-cpus=4", "--include-dashboard=false", "--block"]
    log = open(os.path.join(ray_state, "head.log"), "w+")  # noqa: SIM115
    head = subprocess.Popen([ray_exe, "start", "--head", *flags], stdout=log, stderr=log)
    address_file = os.path.join(ray_state, "ray", "ray_current_cluster")  # once it is up
    deadline = time.monotonic() + 120
    try:
        while not os.path.exists(address_file) and time.monotonic() < deadline:
            assert head.poll() is None, open(log.name).read()
            time.sleep(0.5)
        assert os.path.exists(address_file), open(log.name).read()
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        head.terminate()  # its processes, and the workers of its raylet, are stopped
        head.wait(120)
        log.close()


class Launch:
    """`python -m xllm_py --launcher=ray ...` in the background, its output collected."""

    def __init__(self, address: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/xllm-ray-launch-{self.port}.log"
        self.log = open(self.log_path, "w+")  # noqa: SIM115
        cmd = [sys.executable, "-m", "xllm_py", "--launcher=ray", f"--ray_address={address}"]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port), *FLAGS, *flags],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        if not wait_healthy(self.url, self._exited, 240):
            self.stop()
            raise RuntimeError(f"the cluster did not come up:\n{self.output()}")
        self.startup_s = time.monotonic() - self.started

    def _exited(self) -> str | None:
        if self.proc.poll() is None:
            return None
        return f"launcher exited with {self.proc.returncode}:\n{self.output()}"

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def node_pids(self) -> dict[int, int]:
        return {
            int(r): int(p) for r, p in re.findall(r"node (\d) on \S+ \(pid (\d+)\)", self.output())
        }

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(90)
        finally:
            self.log.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split(") ")[1][0] != "Z"


def command_lines_containing(text: str) -> dict[int, str]:
    """pid -> command line of every process on this host whose argv contains `text`."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode("utf-8", "replace").split("\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue
        if any(text in word for word in argv):
            found[int(entry)] = " ".join(argv)
    return found


def processes_of_this_ray(temp: str | None = None) -> dict[int, str]:
    """pid -> command line of every process started with this module's Ray folder (its
    RAY_TMPDIR, `temp`, in the environment it started with): the `ray` CLI, Ray's own
    processes and workers, the launchers and their nodes; not another test run's."""
    mark = f"RAY_TMPDIR={temp or os.environ['RAY_TMPDIR']}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().decode("utf-8", "replace").replace("\0", " ")
        except OSError:  # gone, or another user's
            continue
    return found


def ray_processes_left(temp: str) -> dict[int, str]:
    """The processes of this module's Ray still alive after 30 s, then killed."""
    deadline = time.monotonic() + 30
    while (left := processes_of_this_ray(temp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def complete(url: str, prompt: str, api_key: str) -> str:
    r = HTTP.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def our_node_processes() -> list[str]:
    """This module's node processes still running (another test run's are not ours)."""
    found = processes_of_this_ray().values()
    return [cmd for cmd in found if "xllm_py" in cmd and "--node_rank=" in cmd]


def test_each_node_gets_its_rank_device_and_bundle():
    args = build_parser().parse_args(["--launcher=ray", "--nnodes=3", "--devices=cuda"])
    assert bundles(args, "10.0.0.7") == [
        {"GPU": 1.0, "node:10.0.0.7": 0.001},
        {"GPU": 1.0},
        {"GPU": 1.0},
    ]
    argv = node_argv(args, 2, "10.0.0.7:9", "cuda")
    node = build_parser().parse_args(argv)  # what the node process sees
    assert (node.launcher, node.node_rank, node.master_node_addr, node.devices) == (
        "process",
        2,
        "10.0.0.7:9",
        "cuda:0",
    )
    dpa = ["--launcher=ray", "--nnodes=2", "--dp_size=2", "--ep_size=2", "--enable_dp_attention"]
    node = build_parser().parse_args(node_argv(build_parser().parse_args(dpa), 1, "h:9", "cpu"))
    assert (node.dp_size, node.ep_size, node.enable_dp_attention) == (2, 2, True)
    cpu = build_parser().parse_args(["--launcher=ray", "--nnodes=2", "--ray_cpus_per_node=3"])
    assert bundles(cpu, "h")[1] == {"CPU": 3.0}


def test_node_command_lines_carry_no_secret(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("file-token")
    flags = ["--launcher=ray", "--nnodes=2", "--api_key=k3y", f"--cluster_token_file={token_file}"]
    args = build_parser().parse_args(flags)
    for rank in (0, 1):
        argv = node_argv(args, rank, "10.0.0.7:9", "cpu")
        assert not any("k3y" in w or "token" in w for w in argv), argv
        node = build_parser().parse_args(argv)
        assert (node.api_key, node.cluster_token, node.cluster_token_file) == (None, None, None)
    assert node_env(args, 0, "t0k")["XLLM_API_KEY"] == "k3y"  # only the HTTP server's
    assert "XLLM_API_KEY" not in node_env(args, 1, "t0k")
    assert node_env(args, 1, "t0k")["XLLM_CLUSTER_TOKEN"] == "t0k"


def test_a_local_ray_instance_writes_no_token_into_home(tmp_path):
    """The launcher's own Ray instance (--ray_address=local, or auto with no cluster here)
    has token auth with a token of the launch: left to itself, Ray 2.60 writes a new
    ~/.ray/auth_token, which every later `ray start --head` on the host enforces."""
    code = (
        "import os, ray\n"
        "from xllm_py.cluster.ray_launch import _connect\n"
        "assert _connect('local', 1, 1)\n"
        "print(ray.get(ray.remote(lambda: os.environ['RAY_AUTH_MODE']).remote()))\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)  # an empty one: Ray would write its token there
    cmd = [sys.executable, "-c", code]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0 and run.stdout.split()[-1] == "token", run.stdout + run.stderr
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def one_node_greedy():
    from tests.test_cluster import offline_answers

    return offline_answers(PROMPTS[:NUM_PROMPTS])


def test_tensor_parallel_cluster_through_ray_equals_one_node(ray_head, one_node_greedy):
    """MTP k = 1 (plain decoding over a cluster: tests/test_cluster.py). The API key given
    on the launcher's command line reaches node 0 (the API refuses a request without it)
    through its environment: no node process's command line holds it."""
    key = "sekrit-" + secrets.token_hex(8)
    c = Launch(ray_head, "--num_speculative_tokens=1", f"--api_key={key}")
    try:
        with concurrent.futures.ThreadPoolExecutor(NUM_PROMPTS) as pool:
            got = list(pool.map(lambda p: complete(c.url, p, key), PROMPTS[:NUM_PROMPTS]))
        assert got == one_node_greedy
        assert sorted(c.node_pids()) == [0, 1]
        r = HTTP.post(c.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 401
        for pid in c.node_pids().values():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
            assert "xllm_py" in argv and "--api_key" not in " ".join(argv), argv
        assert set(command_lines_containing(key)) == {c.proc.pid}  # the launcher's own only
        print(f"start-up through Ray: {c.startup_s:.1f} s")
    finally:
        code = c.stop()
    assert code == 0, c.output()
    assert "[node 1]" in c.output() and "[node 0]" in c.output()  # node logs, by rank
    assert key not in c.output()  # nor in any log line
    assert not our_node_processes()


def test_a_killed_node_actor_fails_the_cluster_and_leaves_nothing(ray_head):
    c = Launch(ray_head, "--num_speculative_tokens=1")
    pids = c.node_pids()
    ray.init(address=ray_head, namespace=RAY_NAMESPACE, logging_level="WARNING")
    try:
        actor = ray.get_actor(f"xllm-node-1-{c.proc.pid}")
        streaming = [threading.Event(), threading.Event()]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futs = [
                pool.submit(stream_until_error, c.url, p, e.set)
                for p, e in zip(PROMPTS[:2], streaming)
            ]
            assert all(e.wait(60) for e in streaming)  # both requests are in flight
            ray.kill(actor)
            deadline = time.monotonic() + 60
            while alive(pids[0]) and time.monotonic() < deadline:
                time.sleep(0.2)
            results = [f.result(60) for f in futs]
        assert c.proc.wait(60) != 0
        # The master found the death by its own health checks and exited 1; the launcher's
        # fallback (stopping a master that did not exit) never had to act.
        out = c.output()
        assert "the master exited with 1" in out, out
        assert "did not exit after a worker died" not in out, out
        for events, done in results:
            assert "error" in events[-1] and done, events[-1]
        assert unhealthy(c.url)
        assert not alive(pids[1])  # the killed actor's node process died with it
        # From the GCS directly (ray.util.state needs the dashboard, which is off here).
        from ray._private.state import actors as actor_table

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            actors = [a for a in actor_table().values() if a["State"] != "DEAD"]
            table = ray.util.placement_group_table().values()
            groups = [g for g in table if g["state"] != "REMOVED"]
            if not actors and not groups:
                break
            time.sleep(0.5)
        assert not actors and not groups, (actors, groups)
        assert not our_node_processes()
    finally:
        ray.shutdown()
        c.stop()
