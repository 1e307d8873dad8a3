"""tools/train_tiny_model.py end to end at toy scale: it writes a checkpoint our
engine and HF both load, logs held-out loss, and resumes where it stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from xllm_py import LLM, SamplingParams

TOOL = Path(__file__).resolve().parent.parent / "tools" / "train_tiny_model.py"


def train(out: Path, steps: int) -> str:
    r = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--output-dir",
            str(out),
            "--max-steps",
            str(steps),
            "--max-train-chars",
            "400000",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--eval-every",
            "1",
            "--minutes",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_train_tool_writes_a_loadable_checkpoint_and_resumes(tmp_path):
    out = tmp_path / "model"
    first = train(out, 2)
    assert "resuming at step 0" in first
    meta = json.loads((out / "training.json").read_text())
    assert meta["steps"] == 2 and [e["step"] for e in meta["log"]][:2] == [1, 2]
    assert all("held_out_loss" in e and "held_out_mtp_acc" in e for e in meta["log"])
    second = train(out, 3)  # picks up the saved state instead of starting over
    assert "resuming at step 2" in second
    assert json.loads((out / "training.json").read_text())["steps"] == 3
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_cfg
    llm = LLM(model=str(out), dtype="float32", block_size=16)
    text = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    res = llm.generate(text, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(res[0].outputs[0].token_ids) == 4
