"""perf/mtp_sweep.py end to end at toy scale: it starts the daemon without and with MTP,
benchmarks both on the same prompts and writes the table, the plot and the JSON."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from perf import mtp_sweep, peers
from perf.daemon import free_port
from xllm_py.assets import bundled_model


def test_sweep_writes_table_plot_and_json(tmp_path):
    """Interleaved (--rounds 2): the three servers up at once, two rounds of each at each
    concurrency; a row is a method's round of median throughput, its speedup the median of
    the rounds' own ratios to the baseline."""
    summary = mtp_sweep.main(
        [
            "--concurrency", "1", "2",
            "--num-prompts", "3",
            "--input-len", "24",
            "--output-len", "6",
            "--port", str(free_port()),
            # drafts on every step: the acceptance columns are checked below, and
            # --speculative_confidence=auto may draft nothing in so short a run (a fast
            # machine's CI run: its gate chose plain decoding for the three requests)
            "--server-args", "--dtype float32 --enable_graph=false --speculative_confidence=off",
            "--adaptive",
            "--rounds", "2",
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

    def rounds(method: str, c: int) -> list[float]:
        raw = [tmp_path / "raw" / f"{tags[method]}_c{c}_r{r}.json" for r in (0, 1)]
        return [json.loads(f.read_text())["output_throughput"] for f in raw]

    for r in rows:
        tput, base = rounds(r["method"], r["concurrency"]), rounds("baseline", r["concurrency"])
        assert r["output_throughput"] == min(tput)  # of two rounds, the lower median
        ratios = [t / b for t, b in zip(tput, base)]
        assert r["round_speedups"] == ratios
        assert r["speedup"] == pytest.approx(sum(ratios) / 2)
    assert "MTP adaptive k<=1" in (tmp_path / "server_adaptive.log").read_text()
    base, mtp = rows[0], rows[1]
    assert base["speedup"] == 1.0
    assert base["spec_decode_acceptance_length"] is None
    assert 1.0 <= mtp["spec_decode_acceptance_length"] <= 2.0
    # acceptance per draft position (k = 1: one), which the acceptance length is made of
    assert base[mtp_sweep.POS] is None and len(mtp[mtp_sweep.POS]) == 1
    assert mtp["spec_decode_acceptance_length"] == pytest.approx(1 + sum(mtp[mtp_sweep.POS]))
    md = (tmp_path / "results.md").read_text()
    assert "| MTP k=1 | 2 |" in md and "speedup" in md and "acceptance at 1..k" in md
    assert "ran side by side" in md and f"{ratios[0]:.2f}x / {ratios[1]:.2f}x" in md
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
            # every step drafts: the acceptance length below needs drafts verified, which
            # --speculative_confidence=auto need not do on a loaded machine; eager, and a
            # small KV cache: one node would otherwise compile its graphs in the background
            # (minutes of both cores) and zero a cache for 256 full-length requests
            "--launch", f"{env} {master} 'EXTRA_ARGS=--dtype=float32 --speculative_confidence=off"
                        " --enable_graph=false --max_cache_size=16000000'"
                        " bash scripts/launch_cluster.sh",
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


def test_peers_are_served_at_our_k_and_concurrency(monkeypatch, tmp_path):
    """--peer vllm --peer llama.cpp: vLLM plain and with deepseek_mtp at each --k, llama-server
    with a slot per request in flight, all at our daemon's dtype on the sweep's port, and our
    greedy tokens ready for the agreement check (the peers themselves are not started)."""
    monkeypatch.setattr(peers, "missing", lambda engine: None)
    monkeypatch.setattr(peers, "convert", lambda model, outtype: tmp_path / f"m.{outtype}.gguf")
    monkeypatch.setattr(peers, "ours_greedy", lambda model, dtype, ids, n: [(dtype, n)] * len(ids))
    argv = ["--k", "1", "2", "--concurrency", "1", "4", "--port", "8123", "--peer", "vllm",
            "--peer", "llama.cpp", "--server-args", "--dtype bfloat16 --enable_graph=false",
            "--peer-prompts", "2", "--peer-tokens", "8"]  # fmt: skip
    args = mtp_sweep.parser(None, mtp_sweep.FLAGS).parse_args(argv)
    methods, info = mtp_sweep.peer_methods(args)
    assert [(m.name, m.engine) for m in methods] == [
        ("vLLM", "vllm"), ("vLLM MTP k=1", "vllm"), ("vLLM MTP k=2", "vllm"),
        ("llama.cpp (no MTP)", "llama.cpp"),
    ]  # fmt: skip
    for m, k in zip(methods, (0, 1, 2)):
        assert m.cmd == peers.vllm_command(Path(bundled_model()), 8123, k, "bfloat16", 448)
    assert methods[3].cmd == peers.llama_server_command(
        tmp_path / "m.bf16.gguf", 8123, 4, 448, peers.server_threads()
    )
    assert len(info["prompts"]) == 2 and info["ours"] == [("bfloat16", 8)] * 2
    monkeypatch.undo()
    monkeypatch.setattr(peers, "LLAMA_SERVER", tmp_path / "absent")
    with pytest.raises(SystemExit, match="run `make peers`"):
        mtp_sweep.peer_methods(args)


def test_a_peer_that_fails_is_noted_and_the_sweep_goes_on(monkeypatch, tmp_path):
    """vLLM's CPU attention cannot serve the tiny bundled model (its latent is 64 wide): its
    first method's error is kept, its later methods are not started, llama.cpp still runs;
    an error of ours still ends the sweep."""
    started = []

    def run(args, m, raw, peer):
        started.append(m.name)
        if m.engine == "vllm" or (m.engine is None and m.name == "MTP k=1" and peer["ours_fail"]):
            raise RuntimeError("Server error '500 Internal Server Error'\nTraceback ...")
        return {1: {"output_throughput": 1.0}}, {"ok": True} if m.engine else None

    monkeypatch.setattr(mtp_sweep, "run_method", run)
    sequential = SimpleNamespace(rounds=1)  # one method after another
    Method = mtp_sweep.Method
    methods = [Method("baseline", "k0", []), Method("MTP k=1", "k1", []),
               Method("vLLM", "vllm_k0", [], engine="vllm"),
               Method("vLLM MTP k=1", "vllm_k1", [], engine="vllm"),
               Method("llama.cpp (no MTP)", "llama_cpp", [], engine="llama.cpp")]  # fmt: skip
    results, agree, failed = mtp_sweep.run_methods(
        sequential, methods, tmp_path, {"ours_fail": False}
    )
    assert started == ["baseline", "MTP k=1", "vLLM", "llama.cpp (no MTP)"]
    assert list(results) == ["baseline", "MTP k=1", "llama.cpp (no MTP)"]
    assert agree == {"llama.cpp (no MTP)": {"ok": True}}
    assert failed == {
        "vLLM": "RuntimeError: Server error '500 Internal Server Error' (log: server_vllm_k0.log)",
        "vLLM MTP k=1": "Not started: vLLM failed.",
    }
    with pytest.raises(RuntimeError, match="500"):
        mtp_sweep.run_methods(sequential, methods, tmp_path, {"ours_fail": True})


@pytest.mark.skipif(peers.missing("llama.cpp") is not None, reason=f"{peers.missing('llama.cpp')}")
def test_sweep_with_llama_cpp_as_peer(tmp_path):
    """--peer llama.cpp: the bundled model converted to GGUF, served by llama-server and
    benchmarked like ours; its greedy tokens agree with ours. Needs `make peers`."""
    summary = mtp_sweep.main(
        [
            "--concurrency", "2",
            "--num-prompts", "2",
            "--input-len", "24",
            "--output-len", "6",
            "--k", "1",
            "--peer", "llama.cpp",
            "--peer-prompts", "2",
            "--peer-tokens", "8",
            "--no-ceiling",
            "--port", str(free_port()),
            "--server-args", "--dtype float32 --enable_graph=false",
            "--result-dir", str(tmp_path),
        ]
    )  # fmt: skip
    rows = summary["rows"]
    assert [r["method"] for r in rows] == ["baseline", "MTP k=1", "llama.cpp (no MTP)"]
    assert rows[2]["completed"] == 2 and rows[2]["failed"] == 0
    raw = json.loads((tmp_path / "raw" / "llama_cpp_c2.json").read_text())
    assert raw["total_output_tokens"] == 2 * 6  # ignore_eos: every request ran to its length
    agreement = summary["peers"]["agreement"]["llama.cpp (no MTP)"]
    assert agreement["num_prompts"] == 2 and agreement["mean_identical_fraction"] > 0.9
    assert "- llama.cpp (no MTP): " in (tmp_path / "results.md").read_text()


def mla_checkpoint(path: Path) -> Path:
    """A random checkpoint of DeepSeek-V3's attention geometry (vLLM's CPU MLA takes only
    kv_lora_rank 512 + qk_rope_head_dim 64) with one MTP layer and the bundled tokenizer."""
    import torch

    from tests.conftest import copy_bundled_tokenizer
    from tools.make_random_checkpoint import make_random_checkpoint

    dims = dict(vocab_size=8208, hidden_size=512, intermediate_size=1024,
                moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=4,
                n_group=4, topk_group=2, max_position_embeddings=2048)  # fmt: skip
    make_random_checkpoint(path, dims, num_mtp=1, dtype=torch.bfloat16)
    copy_bundled_tokenizer(path)
    return path


@pytest.mark.slow
@pytest.mark.skipif(peers.missing("vllm") is not None, reason=f"{peers.missing('vllm')}")
def test_sweep_with_vllm_as_peer(tmp_path):
    """--peer vllm (slow: each vLLM start compiles, minutes here): plain and deepseek_mtp
    served and benchmarked like ours, greedy tokens equal to ours, drafts counted."""
    model = mla_checkpoint(tmp_path / "mla")
    summary = mtp_sweep.main(
        [
            "--model", str(model),
            "--concurrency", "2",
            "--num-prompts", "2",
            "--input-len", "24",
            "--output-len", "6",
            "--k", "1",
            "--peer", "vllm",
            "--peer-prompts", "2",
            "--peer-tokens", "8",
            "--no-ceiling",
            "--port", str(free_port()),
            "--server-args", "--dtype float32 --enable_graph=false",
            "--result-dir", str(tmp_path / "out"),
        ]
    )  # fmt: skip
    rows = {r["method"]: r for r in summary["rows"]}
    assert list(rows) == ["baseline", "MTP k=1", "vLLM", "vLLM MTP k=1"]
    assert all(r["completed"] == 2 and r["failed"] == 0 for r in rows.values())
    assert rows["vLLM"]["spec_decode_acceptance_length"] is None
    assert rows["vLLM MTP k=1"]["spec_decode_acceptance_length"] >= 1.0
    for name in ("vLLM", "vLLM MTP k=1"):
        assert summary["peers"]["agreement"][name]["prompts_identical"] == 1.0
