"""Master and worker in two Linux network namespaces joined by a veth pair: nothing in
the cluster may assume loopback. Skips (with the reason) where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MASTER_IP, WORKER_IP = "10.231.7.1", "10.231.7.2"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def namespaces():
    tag = uuid.uuid4().hex[:6]
    a, b = f"xm{tag}", f"xw{tag}"
    try:
        sh("ip", "netns", "add", a)
    except (OSError, subprocess.CalledProcessError) as e:
        msg = e.stderr if isinstance(e, subprocess.CalledProcessError) else e
        pytest.skip(f"cannot create network namespaces here: {str(msg).strip()}")
    try:
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        sh("ip", "link", "set", f"va{tag}", "netns", a)
        sh("ip", "link", "set", f"vb{tag}", "netns", b)
        sh("ip", "-n", a, "addr", "add", f"{MASTER_IP}/24", "dev", f"va{tag}")
        sh("ip", "-n", b, "addr", "add", f"{WORKER_IP}/24", "dev", f"vb{tag}")
        for ns, dev in ((a, f"va{tag}"), (b, f"vb{tag}")):
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        sh("ip", "netns", "del", a, check=False)
        sh("ip", "netns", "del", b, check=False)


def in_ns(ns: str, *cmd: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *cmd],
        cwd=ROOT,
        stdout=open(log, "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_master_and_worker_in_separate_namespaces(namespaces, tmp_path):
    a, b = namespaces
    common = ["--nnodes=2", "--dp_size=2", f"--master_node_addr={MASTER_IP}:42123"]
    master = in_ns(
        a, sys.executable, "-m", "xllm_py", *common, "--node_rank=0",
        "--host", MASTER_IP, "--port", "8000", log=tmp_path / "master.log",
    )  # fmt: skip
    worker = in_ns(
        b, sys.executable, "-m", "xllm_py", *common, "--node_rank=1",
        # bound to every interface: the master must dial the address it registered from
        "--host", "0.0.0.0", "--port", "8001", log=tmp_path / "worker.log",
    )  # fmt: skip
    probe = (
        "import httpx, sys; "
        f"r = httpx.post('http://{MASTER_IP}:8000/v1/completions', timeout=120, "
        "json={'prompt': 'Hello', 'max_tokens': 6, 'ignore_eos': True, 'n': 4}); "
        "print(r.status_code, r.text)"
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert master.poll() is None, (tmp_path / "master.log").read_text()[-3000:]
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            health = subprocess.run(
                ["ip", "netns", "exec", a, "curl", "-sf", f"http://{MASTER_IP}:8000/health"],
                capture_output=True,
                text=True,
            )
            if health.returncode == 0:
                break
            time.sleep(1)
        else:
            pytest.fail("master never became healthy:\n" + (tmp_path / "master.log").read_text())
        r = subprocess.run(
            ["ip", "netns", "exec", a, sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
        )
        status, body = r.stdout.split(" ", 1)
        assert status == "200", r.stdout + r.stderr
        assert json.loads(body)["usage"]["completion_tokens"] == 24
        # the master dialled the worker across the veth, at the address it registered from
        assert f"using {WORKER_IP}:8001" in (tmp_path / "master.log").read_text()
    finally:
        for p in (master, worker):
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in (master, worker):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
