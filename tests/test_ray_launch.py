"""`xllm --launcher=ray`: a 2-node tensor-parallel cluster placed on a real Ray instance
(a head started with the `ray` CLI, as an operator's cluster would be), serving held-out
prompts exactly as one node does with the API key it was given kept off every node's
command line, and leaving nothing behind when a node's actor dies."""

from __future__ import annotations

import concurrent.futures
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server_utils import ROOT, free_port, wait_healthy
from tests.test_cluster import MAX_TOKENS, MODEL, PROMPTS, stream_until_error, unhealthy

ray = pytest.importorskip("ray")  # in the dev extra: installed by `make test`

from xllm_py.cli import build_parser  # noqa: E402
from xllm_py.cluster.ray_launch import RAY_NAMESPACE, bundles, node_argv, node_env  # noqa: E402

NUM_PROMPTS = 16
FLAGS = ["--dtype=float32", "--nnodes=2", "--max_cache_size=16000000", "--heartbeat_timeout=3"]


def ray_cli(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ray"), *words],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on this machine (4 logical CPUs: two 1-CPU bundles fit on 2 cores)."""
    port = free_port()
    started = ray_cli(
        "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false"
    )
    assert started.returncode == 0, started.stdout + started.stderr
    address = f"127.0.0.1:{port}"
    try:
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        ray_cli("stop", "--force")


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


def complete(url: str, prompt: str, api_key: str) -> str:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def our_node_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "xllm_py" in line and "--node_rank=" in line]


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


@pytest.fixture(scope="module")
def one_node_greedy():
    from tests.test_cluster import CACHE_BYTES, MAX_TOKENS
    from xllm_py import LLM, SamplingParams

    llm = LLM(dtype="float32", max_cache_size=CACHE_BYTES)
    outs = llm.generate(PROMPTS[:NUM_PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].text for o in outs]


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
        r = httpx.post(c.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
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
