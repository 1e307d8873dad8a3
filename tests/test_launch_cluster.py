"""scripts/launch_cluster.sh with its defaults (bundled model, CPU, 2 nodes, MTP on):
it brings the cluster up, the master serves a completion, `stop` leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx

from tests.server_utils import free_port, free_port_range

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "launch_cluster.sh"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_launch_serve_and_stop(tmp_path):
    port = free_port_range(2)  # node i listens on START_PORT + i
    env = os.environ | {
        "LOG_DIR": str(tmp_path / "log"),
        "START_PORT": str(port),
        "MASTER_NODE_ADDR": f"127.0.0.1:{free_port()}",
        "HEALTH_TIMEOUT": "240",
    }
    try:
        up = subprocess.run(
            ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300
        )
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"http://127.0.0.1:{port}/v1" in up.stdout
        pids = [int(p) for p in (tmp_path / "log" / "cluster.pids").read_text().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 8, "ignore_eos": True},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert (tmp_path / "log" / "node_0.log").is_file()
        assert (tmp_path / "log" / "node_1.log").is_file()
    finally:
        down = subprocess.run(
            ["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120
        )
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(alive(p) for p in pids)
    assert not (tmp_path / "log" / "cluster.pids").exists()
