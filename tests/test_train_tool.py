"""tools/train_tiny_model.py end to end at toy scale: it writes a checkpoint our
engine and HF both load, logs held-out loss, and resumes where it stopped."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from xllm_py import LLM, SamplingParams

TOOL = Path(__file__).resolve().parent.parent / "tools" / "train_tiny_model.py"
# a KV cache for a few short requests (left to the engine, it zeroes up to 1.8 GB)
ENGINE = dict(dtype="float32", block_size=16, max_cache_size=16 << 20)


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


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    """A checkpoint after 2 steps, and what the tool printed: the source of both tests
    (each writes only into its own copy or output directory)."""
    out = tmp_path_factory.mktemp("train") / "model"
    return out, train(out, 2)


def test_train_tool_writes_a_loadable_checkpoint_and_resumes(trained, tmp_path):
    src, first = trained
    out = tmp_path / "model"
    shutil.copytree(src, out)  # the whole output directory, its work/ state included
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
    llm = LLM(model=str(out), **ENGINE)
    text = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    res = llm.generate(text, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(res[0].outputs[0].token_ids) == 4


def test_distill_tool_changes_only_the_mtp_layer(trained, tmp_path):
    """tools/distill_mtp.py at toy scale: the written checkpoint has new MTP tensors, every
    other tensor byte-identical, and serves the same greedy tokens with MTP on."""
    from safetensors.torch import load_file

    src, out = trained[0], tmp_path / "distilled"
    r = subprocess.run(
        [
            sys.executable,
            str(TOOL.parent / "distill_mtp.py"),
            "--model",
            str(src),
            "--output-dir",
            str(out),
            "--minutes",
            "0.05",
            "--max-train-chars",
            "200000",
            "--gen-prompts",
            "4",
            "--gen-tokens",
            "8",
            "--eval-prompts",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--lr",
            "0.05",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((out / "distillation.json").read_text())
    assert meta["steps"] >= 1 and 0 <= meta["held_out_agreement_after"] <= 1
    n_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    mtp_prefix = f"model.layers.{n_layers}."  # the MTP layer follows the main layers
    changed = []
    for f in sorted(src.glob("*.safetensors")):
        a, b = load_file(str(f)), load_file(str(out / f.name))
        assert a.keys() == b.keys()
        for name in a:
            if not a[name].equal(b[name]):
                changed.append(name)
    assert changed and all(n.startswith(mtp_prefix) for n in changed), changed
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in changed)
    prompt = {"prompt_token_ids": [0, 5, 9, 17, 33]}
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    base = LLM(model=str(src), **ENGINE).generate(prompt, greedy)
    spec = LLM(model=str(out), num_speculative_tokens=2, **ENGINE)
    assert spec.generate(prompt, greedy)[0].outputs[0].token_ids == base[0].outputs[0].token_ids
