"""perf/mtp_sweep.py end to end at toy scale: it starts the daemon without and with MTP,
benchmarks both on the same prompts and writes the table, the plot and the JSON."""

from __future__ import annotations

import json

import pytest

from perf import mtp_sweep
from perf.daemon import free_port


def test_sweep_writes_table_plot_and_json(tmp_path):
    summary = mtp_sweep.main(
        [
            "--concurrency", "1", "2",
            "--num-prompts", "3",
            "--input-len", "24",
            "--output-len", "6",
            "--port", str(free_port()),
            "--server-args", "--dtype float32",
            "--adaptive",
            "--result-dir", str(tmp_path),
        ]
    )  # fmt: skip
    rows = summary["rows"]
    assert [(r["method"], r["concurrency"]) for r in rows] == [
        ("baseline", 1),
        ("MTP k=1", 1),
        ("MTP adaptive k<=1", 1),
        ("baseline", 2),
        ("MTP k=1", 2),
        ("MTP adaptive k<=1", 2),
    ]
    assert all(r["failed"] == 0 and r["completed"] == 3 for r in rows)
    tags = {"baseline": "k0", "MTP k=1": "k1", "MTP adaptive k<=1": "adaptive"}
    for r in rows:
        raw = tmp_path / "raw" / f"{tags[r['method']]}_c{r['concurrency']}.json"
        assert r["output_throughput"] == json.loads(raw.read_text())["output_throughput"]
    assert "MTP adaptive k<=1" in (tmp_path / "server_adaptive.log").read_text()
    base, mtp = rows[0], rows[1]
    assert base["speedup"] == 1.0
    assert mtp["speedup"] == mtp["output_throughput"] / base["output_throughput"]
    assert base["spec_decode_acceptance_length"] is None
    assert 1.0 <= mtp["spec_decode_acceptance_length"] <= 2.0
    # acceptance per draft position (k = 1: one), which the acceptance length is made of
    assert base[mtp_sweep.POS] is None and len(mtp[mtp_sweep.POS]) == 1
    assert mtp["spec_decode_acceptance_length"] == pytest.approx(1 + sum(mtp[mtp_sweep.POS]))
    md = (tmp_path / "results.md").read_text()
    assert "| MTP k=1 | 2 |" in md and "speedup" in md and "acceptance at 1..k" in md
    assert f"| {mtp[mtp_sweep.POS][0]:.2f} |" in md
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "sweep.json").read_text())["machine"]["cores"]


def test_sweep_through_a_launcher(tmp_path):
    """--launch with a launcher that returns once its server runs (the cluster script, one
    node here) and --launch-stop to stop it: both methods measured, nothing left running."""
    port = free_port()
    log_dir = tmp_path / "cluster-log"
    env = f"env START_PORT={{port}} NUM_SPECULATIVE_TOKENS={{k}} NNODES=1 LOG_DIR={log_dir}"
    master = f"MASTER_NODE_ADDR=127.0.0.1:{free_port()}"
    summary = mtp_sweep.main(
        [
            "--concurrency", "2",
            "--num-prompts", "2",
            "--input-len", "16",
            "--output-len", "4",
            "--port", str(port),
            "--launch", f"{env} {master} EXTRA_ARGS=--dtype=float32 bash scripts/launch_cluster.sh",
            "--launch-stop", f"env LOG_DIR={log_dir} bash scripts/launch_cluster.sh stop",
            "--result-dir", str(tmp_path / "out"),
        ]
    )  # fmt: skip
    rows = summary["rows"]
    assert [r["method"] for r in rows] == ["baseline", "MTP k=1"]
    assert all(r["failed"] == 0 and r["completed"] == 2 for r in rows)
    assert rows[1]["spec_decode_acceptance_length"] >= 1.0
    assert rows[0]["spec_decode_acceptance_length"] is None  # the baseline really ran k=0
    assert not (log_dir / "cluster.pids").exists()  # stopped by --launch-stop


def test_sweep_with_llama_cpp_as_peer(tmp_path):
    """--peer llama.cpp: the bundled model converted to GGUF, served by llama.cpp's OpenAI
    server and benchmarked like ours; its greedy tokens agree with ours. Needs
    llama-cpp-python (pip install -e .[llamacpp], a 20-minute compile): skipped without it."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (.[llamacpp])")
    summary = mtp_sweep.main(
        [
            "--concurrency", "1",
            "--num-prompts", "2",
            "--input-len", "24",
            "--output-len", "6",
            "--k", "1",
            "--peer", "llama.cpp",
            "--peer-prompts", "2",
            "--peer-tokens", "8",
            "--no-ceiling",
            "--port", str(free_port()),
            "--server-args", "--dtype float32",
            "--result-dir", str(tmp_path),
        ]
    )  # fmt: skip
    rows = summary["rows"]
    assert [r["method"] for r in rows] == ["baseline", "MTP k=1", "llama.cpp (no MTP)"]
    assert rows[2]["completed"] == 2 and rows[2]["failed"] == 0
    # EOS suppressed by logit_bias, so every request ran to its length
    raw = json.loads((tmp_path / "raw" / "llama_cpp_c1.json").read_text())
    assert raw["total_output_tokens"] >= 2 * 6 - 1  # re-tokenized text: at most 1 short
    agreement = summary["peer_engine"]["agreement"]
    assert agreement["num_prompts"] == 2 and agreement["mean_identical_fraction"] > 0.9
    assert "llama.cpp (tiny-deepseek-v3-mtp.f32.gguf" in (tmp_path / "results.md").read_text()
