"""python -m perf.gpu_report, end to end on CPU with the tiny preset: its JSON holds every figure
the report promises (decode tok/s per batch, the step split, the batch-1 roofline, the MTP
step cost with an oracle draft), with the values that must hold whatever this machine's
speed; and its byte model (perf/step_cost.py's) agrees with the checkpoint layout of our
model classes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from perf import gpu_report, step_cost
from tools.make_random_checkpoint import BASE_CONFIG, tensor_shapes

ROOT = Path(__file__).resolve().parent.parent
BATCHES, KS, NEW_TOKENS = [1, 3], [1, 3], 8


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """(the JSON, what was printed, the work dir holding the checkpoints)."""
    work = tmp_path_factory.mktemp("gpu_report")
    cmd = [sys.executable, "-m", "perf.gpu_report", "--preset", "tiny", "--device", "cpu"]
    cmd += ["--batch-sizes", *map(str, BATCHES), "--k", *map(str, KS), "--prompt-len", "8"]
    cmd += ["--new-tokens", str(NEW_TOKENS), "--threads", "1", "--output", str(work / "r.json")]
    cmd += ["--work-dir", str(work)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((work / "r.json").read_text()), proc.stdout, work


def layout(preset: str) -> tuple[dict, int, int, int, int]:
    """(config, target and MTP parameters by tools/make_random_checkpoint.py's layout, the
    MTP layer's copies of the embedding and head left out; those of `*proj` matrices, the
    ones an FP8 checkpoint quantises; their FP8 block scales at 32 x 32)."""
    cfg = dict(BASE_CONFIG, **gpu_report.PRESETS[preset]["overrides"], num_nextn_predict_layers=1)
    target = mtp = proj = scales = 0
    for name, shape in tensor_shapes(cfg, 1).items():
        size = math.prod(shape)
        if name.startswith(f"model.layers.{cfg['num_hidden_layers']}."):
            if not name.endswith(("embed_tokens.weight", "shared_head.head.weight")):
                mtp += size
        else:
            target += size
        if len(shape) == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight")):
            proj += size
            scales += math.ceil(shape[0] / 32) * math.ceil(shape[1] / 32)
    return cfg, target, mtp, proj, scales


def test_every_format_reports_decode_speed_and_where_fp8_weights_live(report):
    result = report[0]
    assert set(result["formats"]) == {"bf16", "fp8"}
    assert result["complete"] is True and result["graph_mode"] is False
    for fmt, res in result["formats"].items():
        assert res["weights_in_memory_dtype"] == result["run_dtype"] == "float32"
        assert set(res["weights_in_memory_bytes"]) == {"float32"}  # FP8 expanded at load
        assert res["fp8_block"] == ([32, 32] if fmt == "fp8" else None)
        assert set(res["decode_tok_s"]) == {str(b) for b in BATCHES}
        assert all(v > 0 for v in res["decode_tok_s"].values())
        assert sorted((r["k"], r["batch"]) for r in res["runs"]) == sorted(
            (k, b) for k in [0, *KS] for b in BATCHES
        )


def test_a_run_stopped_part_way_keeps_the_rows_it_measured(tmp_path):
    """The JSON is written again after every row (a device lent for minutes can take a run
    away at any point): killed after its first row, the file holds that row, marked not
    complete."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "perf.gpu_report", "--preset", "tiny", "--device", "cpu"]
    cmd += ["--formats", "bf16", "--batch-sizes", "1", "8", "--k", "1", "--prompt-len", "8"]
    cmd += ["--new-tokens", "4", "--threads", "1", "--output", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "k=0 batch   1:" in line:
                break
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    result = json.loads(out.read_text())
    assert result["complete"] is False
    runs = result["formats"]["bf16"]["runs"]
    assert [(r["k"], r["batch"]) for r in runs][:1] == [(0, 1)] and runs[0]["decode_tok_s"] > 0


def test_step_split_covers_the_step_once(report):
    for res in report[0]["formats"].values():
        for r in res["runs"]:
            frac = r["split"]["fraction"]
            assert set(frac) == {*gpu_report.LABELS, "other"}
            assert all(v >= 0 for v in frac.values())
            assert sum(frac[n] for n in gpu_report.LABELS) <= 1 + 1e-9  # no part counted twice
            assert sum(frac.values()) == pytest.approx(1.0)
            assert frac["attention"] > 0 and frac["moe"] > 0 and frac["head"] > 0
            assert frac["dense_mlp"] > 0  # the tiny preset's first layer is dense
            assert (frac["draft"] > 0) == (r["k"] > 0)  # the real MTP layer runs under the oracle


def test_oracle_runs_accept_every_draft_and_choose_the_plain_tokens(report):
    for res in report[0]["formats"].values():
        for r in res["runs"]:
            k = r["k"]
            # greedy, EOS ignored: after the prefill step each step emits k + 1 tokens
            assert r["decode_steps"] == math.ceil((NEW_TOKENS - 1) / (k + 1))
            if k:
                assert r["acceptance_rate"] == 1.0
                # float32 on CPU: the verification itself chose every token the plain run
                # did, so pinning the emitted tokens to the plain run's changed nothing
                assert r["verification_agreement"] == 1.0
                assert r["step_cost_vs_plain"] > 0 and r["speedup_vs_plain"] > 0


def test_roofline_at_batch_1(report):
    result, _, work = report
    cfg, target, _, _, _ = layout("tiny")
    assert "measured" in result["peak_bandwidth"]["source"]  # no datasheet figure for a CPU
    # one token reads one embedding row and top-k of the routed experts of each MoE layer
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    unread = (cfg["n_routed_experts"] - cfg["num_experts_per_tok"]) * 3 * cfg["hidden_size"]
    unread = moe_layers * unread * cfg["moe_intermediate_size"]
    unread += (cfg["vocab_size"] - 1) * cfg["hidden_size"]
    for fmt, res in result["formats"].items():
        bm = step_cost.byte_model(str(work / f"tiny-{fmt}"))  # float32, FP8 expanded at load
        assert res["byte_model"] == json.loads(json.dumps(asdict(bm)))
        roof = res["roofline_batch1"]
        assert roof["weight_bytes_per_step"] == 4 * (target - unread)  # float32 run
        assert roof["kv_bytes_per_step"] > 0
        assert 0 < roof["fraction_of_peak"] <= 1


def test_table_is_printed(report):
    out = report[1]
    assert "tok/s" in out and "% of" in out and "wrote" in out
    assert "agree < 1" not in out


def test_byte_model_counts_the_checkpoint_layout(report):
    """Every tensor once (the MTP layer's copies of the embedding and head not), in the run
    dtype; held in FP8, the `*proj` matrices at 1 byte plus a float32 scale per block."""
    _, target, mtp, proj, scales = layout("tiny")
    work = report[2]
    for fmt in ("bf16", "fp8"):
        assert step_cost.byte_model(str(work / f"tiny-{fmt}")).total_weights == 4 * (target + mtp)
    held = step_cost.byte_model(str(work / "tiny-fp8"), "bfloat16", fp8_held=True)
    assert held.total_weights == 2 * (target + mtp - proj) + proj + 4 * scales


def test_gpu_preset_has_2_to_3_billion_parameters():
    _, target, mtp, _, _ = layout("gpu")
    assert 1e9 <= target + mtp <= 3e9


def test_peak_bandwidth_by_device_name():
    table = gpu_report.table_bandwidth
    assert table("NVIDIA H100 80GB HBM3") == 3.35e12
    assert table("NVIDIA H100 PCIe") == 2.0e12
    assert table("NVIDIA H200") == 4.8e12
    assert table("NVIDIA A100-SXM4-80GB") == table("NVIDIA A100 80GB PCIe") == 2.0e12
    assert table("NVIDIA L4") is None


def test_help_explains_every_flag():
    parser = gpu_report.build_parser()
    assert all(a.help for a in parser._actions)
