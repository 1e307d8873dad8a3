"""scripts/launch_cluster.sh with its defaults (bundled model, CPU, 2 nodes, MTP on; a
small KV cache through EXTRA_ARGS, SMALL_CACHE): it brings the cluster up, the master
serves a completion, `stop` leaves nothing behind.
A PD deployment (PD_PREFILL, PD_DECODE) serves through its router with a prompt's blocks
moved. Across hosts (HOSTS / HOSTFILE): two loopback 'hosts' reached through a stub ssh, and
dry runs of the commands (visible-devices variables, ranks, addresses)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from tests.server_utils import HTTP, free_port_range

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "launch_cluster.sh"
# Each node's KV cache, 16 MB: left to --max_memory_utilization, every node of a launch
# would zero room for 256 full-length requests (1.8 GB) at its start.
SMALL_CACHE = "--max_cache_size=16000000"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def two_node_ports() -> tuple[int, str]:
    """START_PORT for two nodes (node i listens on START_PORT + i) and a MASTER_NODE_ADDR
    on START_PORT + 2, whose port + 1 holds torch.distributed's rendezvous: four ports that
    were all free together (two picked apart could overlap, or the rendezvous be taken)."""
    port = free_port_range(4)
    return port, f"127.0.0.1:{port + 2}"


def test_launch_serve_and_stop(tmp_path):
    port, master_addr = two_node_ports()
    env = os.environ | {
        "LOG_DIR": str(tmp_path / "log"),
        "START_PORT": str(port),
        "MASTER_NODE_ADDR": master_addr,
        "HEALTH_TIMEOUT": "240",
        "EXTRA_ARGS": SMALL_CACHE,
    }
    try:
        up = subprocess.run(
            ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300
        )
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"http://127.0.0.1:{port}/v1" in up.stdout
        pids = [int(p) for p in (tmp_path / "log" / "cluster.pids").read_text().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        r = HTTP.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 8, "ignore_eos": True},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert (tmp_path / "log" / "node_0.log").is_file()
        assert (tmp_path / "log" / "node_1.log").is_file()
        token = tmp_path / "log" / "cluster.token"  # made for this launch, for our eyes only
        assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
        worker_log = (tmp_path / "log" / "node_1.log").read_text()
        assert "cluster RPCs need the cluster token" in worker_log
    finally:
        down = subprocess.run(
            ["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120
        )
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(alive(p) for p in pids)
    assert not (tmp_path / "log" / "cluster.pids").exists()


def test_a_pd_deployment_launches_serves_and_stops(tmp_path):
    """PD_PREFILL=1 PD_DECODE=1: a router on START_PORT, a prefill and a decode instance
    after it; a prompt of several blocks is served through the router, its blocks moved."""
    port = free_port_range(3)
    env = os.environ | {"LOG_DIR": str(tmp_path / "log"), "START_PORT": str(port),
                        "PD_PREFILL": "1", "PD_DECODE": "1", "BLOCK_SIZE": "16",
                        "HEALTH_TIMEOUT": "240", "EXTRA_ARGS": SMALL_CACHE}  # fmt: skip
    dry = run_script(env | {"DRY_RUN": "1"})
    router, prefill, decode = [shlex.split(x) for x in dry.stdout.splitlines() if "xllm_py" in x]
    urls = [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
    assert flag(router, "--pd_role") == "router" and flag(router, "--port") == str(port)
    assert router[router.index("--pd_decode") + 1] == urls[1]
    assert router[router.index("--pd_prefill") + 1] == urls[0]
    assert flag(prefill, "--pd_role") == "prefill" and "--nnodes" not in prefill
    assert flag(decode, "--pd_role") == "decode" and flag(decode, "--pd_prefill") == urls[0]
    try:
        up = run_script(env, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "1 prefill and 1 decode instances is up" in up.stdout
        body = {"prompt": "Hello there. " * 40, "max_tokens": 8, "ignore_eos": True}
        r = HTTP.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        moved = HTTP.get(urls[1] + "/metrics", timeout=10).text
        assert any(line.startswith("xllm:pd_kv_blocks_total") and float(line.split()[-1]) > 0
                   for line in moved.splitlines()), moved  # fmt: skip
    finally:
        down = run_script(env, "stop", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped 3 processes" in down.stdout


# A node that dies during start-up; as a process that loaded Triton, it then prints the
# report of the objects its bindings never freed.
FAILING_NODE = """#!/usr/bin/env bash
echo "ValueError: --max_cache_size='lots' is not a number of bytes" >&2
echo "nanobind: leaked 3 instances!" >&2
for i in $(seq 30); do echo " - leaked type \\"ATOMIC_OP_$i\\"" >&2; done
echo " - ... skipped remainder" >&2
echo "nanobind: this is likely caused by a reference counting issue in the binding code." >&2
echo "See https://nanobind.readthedocs.io/en/latest/refleaks.html" >&2
exit 1
"""


def test_a_node_that_dies_at_start_up_is_named_with_its_error(tmp_path):
    """The launcher fails, names the node and shows the end of its log without the exit
    report, so the error that stopped it is on screen."""
    python = tmp_path / "python"
    python.write_text(FAILING_NODE)
    python.chmod(0o755)
    port, master_addr = two_node_ports()
    env = os.environ | {
        "PYTHON": str(python),
        "LOG_DIR": str(tmp_path / "log"),
        "START_PORT": str(port),
        "MASTER_NODE_ADDR": master_addr,
    }
    r = run_script(env)
    assert r.returncode != 0
    assert "exited during start-up" in r.stderr
    assert "--max_cache_size='lots' is not a number of bytes" in r.stderr
    assert "leaked" not in r.stderr and "nanobind" not in r.stderr
    assert "leaked type" in (tmp_path / "log" / "node_0.log").read_text()  # the log keeps it


# ---- several hosts: HOSTS / HOSTFILE, nodes started with $SSH ----------------------------

STUB_SSH = """#!/usr/bin/env bash
# ssh stand-in: record "HOST COMMAND" (one line per call), then run COMMAND here
printf '%s\\n' "$*" >> {log}
shift
exec bash -c "$*"
"""


def stub_ssh(tmp_path: Path) -> tuple[Path, Path]:
    """An executable that acts as `ssh HOST COMMAND` on this machine; returns it and the
    file where it records its calls."""
    calls = tmp_path / "ssh_calls.txt"
    stub = tmp_path / "fake_ssh"
    stub.write_text(STUB_SSH.replace("{log}", shlex.quote(str(calls))))
    stub.chmod(0o755)
    return stub, calls


def run_script(
    env: dict, *args: str, timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def node_commands(remote: str) -> list[list[str]]:
    """The node command lines inside a host's remote command (the words before '>')."""
    nodes = []
    for part in remote.split("; "):
        words = shlex.split(part)
        if "xllm_py" in words:
            nodes.append(words[: words.index(">")] if ">" in words else words)
    return nodes


def flag(words: list[str], name: str) -> str:
    for i, w in enumerate(words):
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
        if w == name:
            return words[i + 1]
    raise AssertionError(f"{name} not in {words}")


def test_hosts_nnodes_mismatch_is_refused(tmp_path):
    stub, calls = stub_ssh(tmp_path)
    env = os.environ | {
        "HOSTS": "127.0.0.1:1,127.0.0.2:1",
        "NNODES": "3",
        "SSH": str(stub),
        "LOG_DIR": str(tmp_path / "log"),
    }
    r = run_script(env)
    assert r.returncode != 0
    assert "NNODES=3" in r.stderr and "2 slots" in r.stderr, r.stderr
    assert not calls.exists() and not (tmp_path / "log").exists()


def test_dry_run_sets_visible_devices_one_host(tmp_path):
    base = os.environ | {"DRY_RUN": "1", "LOG_DIR": str(tmp_path / "log"), "START_DEVICE": "2"}
    r = run_script(base | {"DEVICE_TYPE": "cuda"})
    assert r.returncode == 0, r.stderr
    lines = [shlex.split(x) for x in r.stdout.splitlines() if "xllm_py" in x]
    assert len(lines) == 2
    for rank, words in enumerate(lines):
        assert words[:2] == ["env", f"CUDA_VISIBLE_DEVICES={2 + rank}"]
        assert flag(words, "--devices") == "cuda:0" and flag(words, "--node_rank") == str(rank)
        assert flag(words, "--host") == "127.0.0.1"
    r = run_script(base | {"DEVICE_TYPE": "cpu"})
    assert r.returncode == 0 and "VISIBLE_DEVICES" not in r.stdout
    assert r.stdout.count("--devices=cpu") == 2
    assert not (tmp_path / "log").exists()


def test_dry_run_hostfile_npu(tmp_path):
    stub, calls = stub_ssh(tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two machines\nhostA 2  # first: the master\n\nhostB:2\n")
    env = os.environ | {
        "DRY_RUN": "1",
        "HOSTFILE": str(hostfile),
        "DEVICE_TYPE": "npu",
        "START_DEVICE": "4",
        "START_PORT": "20000",
        "SSH": str(stub),
        "LOG_DIR": "rel/log",
    }
    r = run_script(env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ssh_lines = [shlex.split(x) for x in r.stdout.splitlines() if x.startswith(str(stub))]
    assert [x[1] for x in ssh_lines] == ["hostA", "hostB"]
    rank = 0
    for words in ssh_lines:
        host, remote = words[1], words[2]
        assert f"cd {ROOT}" in remote
        nodes = node_commands(remote)
        assert len(nodes) == 2
        for local, node in enumerate(nodes):
            assert node[:2] == ["env", f"ASCEND_RT_VISIBLE_DEVICES={4 + local}"]
            assert flag(node, "--devices") == "npu:0"
            assert flag(node, "--node_rank") == str(rank)
            assert flag(node, "--nnodes") == "4"
            assert flag(node, "--host") == host
            assert flag(node, "--port") == str(20000 + rank)
            assert flag(node, "--master_node_addr") == "hostA:42123"
            assert f"{tmp_path}/rel/log/node_{rank}.log" in remote  # LOG_DIR made absolute
            rank += 1
    assert "http://hostA:20000/health" in r.stdout
    assert not calls.exists()  # a dry run reaches no host


def test_launch_across_two_hosts(tmp_path):
    """Two 'hosts' on loopback (127.0.0.1 and 127.0.0.2), reached through a stub ssh that
    runs the command here: one ssh call per host, the worker serves on 127.0.0.2."""
    stub, calls = stub_ssh(tmp_path)
    port, master_addr = two_node_ports()
    log = tmp_path / "log"
    env = os.environ | {
        "HOSTS": "127.0.0.1:1,127.0.0.2:1",
        "SSH": str(stub),
        "LOG_DIR": str(log),
        "START_PORT": str(port),
        "MASTER_NODE_ADDR": master_addr,
        "HEALTH_TIMEOUT": "240",
        "EXTRA_ARGS": SMALL_CACHE,
    }
    env.pop("NNODES", None)
    records: list[tuple[str, int]] = []
    try:
        up = run_script(env, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"http://127.0.0.1:{port}/v1" in up.stdout
        records = [
            (h, int(p))
            for h, p in (x.split() for x in (log / "cluster.pids").read_text().splitlines())
        ]
        assert [h for h, _ in records] == ["127.0.0.1", "127.0.0.2"]
        assert all(alive(p) for _, p in records)

        starts = [x for x in calls.read_text().splitlines() if "xllm_py" in x]
        assert [x.split(" ", 1)[0] for x in starts] == ["127.0.0.1", "127.0.0.2"]
        for rank, line in enumerate(starts):
            (node,) = node_commands(line.split(" ", 1)[1])
            assert flag(node, "--node_rank") == str(rank)
            assert flag(node, "--host") == f"127.0.0.{rank + 1}"
            assert flag(node, "--master_node_addr") == master_addr
            assert flag(node, "--nnodes") == "2"
        worker_log = (log / "node_1.log").read_text()
        assert f"worker 1 serving on 127.0.0.2:{port + 1}" in worker_log, worker_log[-2000:]

        r = HTTP.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 8, "ignore_eos": True},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        st = run_script(env, "status")
        assert st.returncode == 0, st.stdout + st.stderr
        assert f"node 1: pid {records[1][1]} on 127.0.0.2 running" in st.stdout
    finally:
        before = len(calls.read_text().splitlines()) if calls.exists() else 0
        down = run_script(env, "stop", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped 2 processes" in down.stdout
    assert records and not any(alive(p) for _, p in records)
    assert not (log / "cluster.pids").exists()
    # the master got SIGTERM through ssh; the worker was checked there (the master's
    # shutdown usually ends it before `stop` would signal it)
    stop_calls = calls.read_text().splitlines()[before:]
    assert any(x.startswith("127.0.0.1 ") and "kill -TERM" in x for x in stop_calls)
    assert any(x.startswith("127.0.0.2 ") and "kill -" in x for x in stop_calls)


def test_a_secret_in_extra_args_is_refused(tmp_path):
    """A command line is visible to every user of a host: the API key comes from
    XLLM_API_KEY, the cluster token from a file."""
    for extra in ("--api_key=k3y", "--cluster_token k3y", "--log_level=info --cluster_token=k3y"):
        env = os.environ | {"EXTRA_ARGS": extra, "DRY_RUN": "1", "LOG_DIR": str(tmp_path)}
        r = run_script(env)
        assert r.returncode != 0 and "EXTRA_ARGS carries a secret" in r.stderr, r.stderr
        assert "k3y" not in r.stdout
