"""tools/train_mtp_head.py at toy scale: from the bundled model with its MTP layer stripped,
a few training steps write an exported draft and an in-place copy that the engine serves
losslessly; a second run resumes from the saved step; a checkpoint that already has an
MTP layer is refused unless --force."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.hf_reference import make_hf_checkpoint
from tools.distill_mtp import chain_mask
from tools.train_mtp_head import check_target, init_mtp, main, strip_mtp
from xllm_py import LLM, SamplingParams
from xllm_py.models.deepseek_mtp import DRAFT_ARCHITECTURE
from xllm_py.weights.loader import tensor_files

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "xllm_py" / "assets" / "tiny-deepseek-v3-mtp"
N_LAYERS = json.loads((BUNDLED / "config.json").read_text())["num_hidden_layers"]
TINY = [
    "--max-train-chars", "100000", "--gen-prompts", "2", "--gen-tokens", "8",
    "--eval-prompts", "1", "--eval-tokens", "16", "--batch-size", "2", "--seq-len", "32",
    "--save-every", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def stripped(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("strip") / "no-mtp"
    strip_mtp(BUNDLED, out)
    return out


def run_tool(capsys, *args: str) -> str:
    """The tool's main() in this process (saves a second interpreter's start-up)."""
    assert main([*args, *TINY]) == 0, capsys.readouterr().err[-3000:]
    return capsys.readouterr().out


def greedy_tokens(**options) -> list[list[int]]:
    prompts = [{"prompt_token_ids": [0, 5, 9, 17, 33]}, {"prompt_token_ids": [0, 300, 41, 7]}]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = LLM(dtype="float32", block_size=16, **options)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]


def test_strip_leaves_the_target_and_no_mtp(stripped):
    cfg = json.loads((stripped / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 0
    names = tensor_files(stripped)
    assert names and not any(n.startswith(f"model.layers.{N_LAYERS}.") for n in names)
    assert (stripped / "tokenizer.json").is_file()


def test_init_is_the_last_layer_applied_to_the_hidden_state(stripped):
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(stripped, dtype=torch.float32).eval()
    cfg = model.config
    mtp = init_mtp(model, cfg)
    h = cfg.hidden_size
    w = mtp.eh_proj.weight
    assert torch.equal(w[:, :h], torch.zeros(h, h)) and torch.equal(w[:, h:], torch.eye(h))
    last = model.model.layers[N_LAYERS - 1].state_dict()
    assert all(torch.equal(v, last[k]) for k, v in mtp.block.state_dict().items())
    for norm in (mtp.enorm, mtp.hnorm, mtp.head_norm):
        assert torch.equal(norm.weight, torch.ones(h))


def test_refuses_a_checkpoint_with_mtp_and_foreign_outputs(tmp_path, capsys):
    assert main(["--model", str(BUNDLED), "--output-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "already has MTP weights" in err and "--force" in err
    assert check_target(BUNDLED, force=True)["num_nextn_predict_layers"] == 1
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("keep me")
    no_mtp = tmp_path / "no-mtp"
    strip_mtp(BUNDLED, no_mtp)
    assert main(["--model", str(no_mtp), "--in-place-copy", str(foreign)]) == 2
    assert "not written by this tool" in capsys.readouterr().err
    assert (foreign / "x").read_text() == "keep me"


def test_trains_exports_resumes_and_serves_losslessly(stripped, tmp_path, capsys):
    work, draft, copy = tmp_path / "work", tmp_path / "draft", tmp_path / "copy"
    first = run_tool(
        capsys,
        "--model", str(stripped), "--output-dir", str(draft), "--work-dir", str(work),
        "--steps", "2", "--lr", "0.01",
    )  # fmt: skip
    assert "training from step 0" in first and "held-out top-1 agreement after 2 steps" in first
    assert json.loads((work / "state.json").read_text())["step"] == 2
    second = run_tool(
        capsys,
        "--model", str(stripped), "--in-place-copy", str(copy), "--work-dir", str(work),
        "--steps", "3", "--lr", "0.01", "--resume",
    )  # fmt: skip
    assert "resuming at step 2" in second  # the saved state, not a fresh start
    meta = json.loads((copy / "mtp_head_training.json").read_text())
    assert meta["steps"] == 3 and [e["step"] for e in meta["log"]][:1] == [1]
    assert [0 <= a <= 1 for a in meta["held_out_agreement_after"]] == [True]  # depth 1

    # the exported draft: export_deepseek_mtp's layout, copies equal to the target's
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["architectures"] == [DRAFT_ARCHITECTURE] and cfg["num_hidden_layers"] == 1
    d = {n: t for f in sorted(draft.glob("*.safetensors")) for n, t in load_file(str(f)).items()}
    assert "model.eh_proj.weight" in d and "model.layers.0.self_attn.q_a_proj.weight" in d
    src = {
        n: t for f in sorted(stripped.glob("*.safetensors")) for n, t in load_file(str(f)).items()
    }
    assert torch.equal(d["model.shared_head.head.weight"], src["lm_head.weight"])
    assert torch.equal(d["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    h = cfg["hidden_size"]
    assert not torch.equal(d["model.eh_proj.weight"][:, :h].float(), torch.zeros(h, h))  # trained

    # the in-place copy: the target's tensors untouched, the new layer N beside them
    cfg = json.loads((copy / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    c = {n: t for f in sorted(copy.glob("*.safetensors")) for n, t in load_file(str(f)).items()}
    assert all(torch.equal(c[n], t) for n, t in src.items())
    new = sorted(set(c) - set(src))
    assert new and all(n.startswith(f"model.layers.{N_LAYERS}.") for n in new)
    assert {n for n in new if "experts" not in n} >= {
        f"model.layers.{N_LAYERS}.{k}.weight"
        for k in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")
    }
    assert all(c[n].dtype == torch.bfloat16 for n in new if "e_score" not in n)

    # the engine serves both, and greedy tokens with MTP drafts equal plain decoding
    base = greedy_tokens(model=str(stripped))
    assert greedy_tokens(model=str(copy), num_speculative_tokens=1) == base
    assert (
        greedy_tokens(model=str(stripped), draft_model=str(draft), num_speculative_tokens=2) == base
    )


def test_chain_mask_attends_as_chained_drafting_does():
    """Depth 1 is causal; row i of depth m > 1 sees depth 1's rows 0..i and its own row i
    of depths 2..m: what the MTP layer's cache holds at chained draft step m - 1."""
    allowed = chain_mask(3, 3, torch.float32)[0, 0] == 0
    rows = {(m, i): m * 3 + i for m in range(3) for i in range(3)}
    for (m, i), q in rows.items():
        seen = {key for key, k in rows.items() if allowed[q, k]}
        want = {(0, j) for j in range(i + 1)} | {(d, i) for d in range(1, m + 1)}
        assert seen == want, (m, i)


def test_chained_fine_tuning_of_the_checkpoint_layer_serves_losslessly(tmp_path, capsys):
    """--init checkpoint --chain 2 --loss lk, with the target's T=1 continuations too: the
    bundled model's own MTP layer trained for depths 1 and 2, the target unchanged."""
    copy = tmp_path / "chained"
    out = run_tool(
        capsys,
        "--model", str(BUNDLED), "--in-place-copy", str(copy), "--init", "checkpoint",
        "--chain", "2", "--loss", "lk", "--sampled-prompts", "2", "--steps", "1",
    )  # fmt: skip
    assert "depth 2:" in out
    meta = json.loads((copy / "mtp_head_training.json").read_text())
    assert meta["chain"] == 2 and meta["loss"] == "lk" and meta["chain_weights"] == [1.0, 0.8]
    assert len(meta["held_out_agreement_init"]) == len(meta["held_out_agreement_after"]) == 2
    assert (tmp_path / "chained.work" / "sampled.npy").is_file()
    base = greedy_tokens(model=str(BUNDLED), num_speculative_tokens=0)
    assert greedy_tokens(model=str(copy), num_speculative_tokens=2) == base


@pytest.mark.parametrize("family", ["v2lite_softmax_greedy", "kimi_like"])
def test_a_v2_or_kimi_checkpoint_gets_a_head_the_engine_serves_losslessly(family, tmp_path, capsys):
    """The families without an MTP layer: a DeepseekV2ForCausalLM (its own decoder layer
    and softmax routing) and Kimi-K2's `model_type: kimi_k2` (read by HF under V3's, or
    its experts would stay random) train a head through the same tool."""
    vocab = json.loads((BUNDLED / "config.json").read_text())["vocab_size"]
    target = make_hf_checkpoint(family, tmp_path / "target", seed=0, overrides={
        "vocab_size": vocab})  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, target / name)
    copy = tmp_path / "copy"
    out = run_tool(
        capsys, "--model", str(target), "--in-place-copy", str(copy),
        "--work-dir", str(tmp_path / "work"), "--steps", "2", "--lr", "0.01",
    )  # fmt: skip
    assert "held-out top-1 agreement after 2 steps" in out
    cfg = json.loads((copy / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    assert cfg["architectures"] == json.loads((target / "config.json").read_text())["architectures"]
    base = greedy_tokens(model=str(target))
    assert greedy_tokens(model=str(copy), num_speculative_tokens=1) == base
