"""DeepSeek-V3.1's FP8 layout (`scale_fmt: ue8m0`, every block scale a power of two), and
Kimi-K2-Thinking's INT4 routed experts (compressed-tensors `pack-quantized`).

The other families (V2-Lite, V2, Moonlight, Kimi-K2) are compared with HF transformers in
test_hf_reference.py. Here:
- a tiny HF DeepSeek-V3 checkpoint quantised to FP8 with ue8m0 scales decodes greedily as HF
  does on the same weights dequantised independently (tokens equal, logprobs within 1e-4,
  float32), and the reference is decisive on those weights;
- the bundled model in that layout: MTP k = 1 and 2 give the plain run's tokens, and drafts
  are accepted;
- a checkpoint that says ue8m0 but holds another scale, or names an unknown scale_fmt, is
  refused with an error naming the tensor or the value;
- a Kimi-K2-shaped HF checkpoint with its routed experts packed to INT4 by
  tools/quantize_int4.py (checked against the format's documented packing, read here
  independently) decodes as HF does on the same weights dequantised by this test; schemes
  the engine does not read are refused naming the field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_reference import (
    CHECKPOINT_SEEDS,
    MAX_NEW_TOKENS,
    hf_greedy_detailed,
    make_hf_checkpoint,
    reference_prompts,
)
from tests.test_checkpoints import all_tensors, reference_dequant
from tools.quantize_int4 import quantize_checkpoint
from xllm_py import LLM, SamplingParams
from xllm_py.assets import BUNDLED_MODEL_DIR
from xllm_py.weights.fp8 import quantize

QUESTIONS = ["How do I bake bread?", "Write a haiku about the sea.", "What is a prime number?"]
CONFIG = "qlora_yarn_allmoe"  # q-LoRA, grouped noaux_tc routing, YaRN: V3.1's architecture
BLOCK = (32, 32)  # the tiny dims leave partial edge blocks
MTP_RUN = SamplingParams(max_tokens=24, temperature=0.0)
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


def quantize_dir(src: Path, dst: Path, scale_fmt: str | None) -> Path:
    """src's checkpoint with every 2-D `*proj.weight` (experts, MLA, dense MLP) stored as
    FP8 e4m3 + weight_scale_inv, as DeepSeek ships it, and the quantization_config to say so."""
    dst.mkdir(parents=True)
    weights = sorted(src.glob("model*.safetensors"))
    for f in src.iterdir():  # tokenizer, chat template, generation config, token map
        if f.is_file() and f not in weights and not f.name.endswith("index.json"):
            shutil.copy(f, dst / f.name)
    stored = {}
    for name, t in {n: t for f in weights for n, t in load_file(str(f)).items()}.items():
        if t.dim() == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight")):
            stored[name], stored[name + "_scale_inv"] = quantize(t, BLOCK, scale_fmt)
        else:
            stored[name] = t
    save_file(stored, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    } | ({"scale_fmt": scale_fmt} if scale_fmt else {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def dequantised_dir(src: Path, dst: Path) -> Path:
    """The FP8 checkpoint's weights dequantised independently of xllm_py, for HF."""
    dst.mkdir(parents=True)
    stored = all_tensors(src)
    plain = {
        n: reference_dequant(t, stored[n + "_scale_inv"], BLOCK) if t.dtype == torch.float8_e4m3fn
        else t
        for n, t in stored.items()
        if not n.endswith("_scale_inv")
    }  # fmt: skip
    save_file(plain, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def decodes_as_hf(model: Path, plain: Path, config: str) -> None:
    """`model` decodes `config`'s reference prompts greedily as HF does on `plain` (the
    same weights, dequantised by the test): tokens equal, logprobs within 1e-4, with HF's
    choices decisive on these weights."""
    prompts = reference_prompts(config)
    ref = hf_greedy_detailed(plain, prompts, MAX_NEW_TOKENS)
    assert min(min(g) for g in ref["top1_top2_gaps"]) > 1e-3  # decisive on these weights
    assert ref["min_router_margin"] > 1e-4
    llm = LLM(model=str(model), device="cpu", dtype="float32", block_size=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for i, (o, (want_tokens, want_lps)) in enumerate(zip(outs, ref["results"])):
        out = o.outputs[0]
        assert list(out.token_ids) == want_tokens, f"prompt {i}"
        lps = [d[t] for d, t in zip(out.logprobs, out.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) <= 1e-4, f"prompt {i}"


@pytest.fixture(scope="module")
def v31(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("v31")
    hf = make_hf_checkpoint(CONFIG, root / "hf", seed=CHECKPOINT_SEEDS[CONFIG])
    return quantize_dir(hf, root / "fp8-ue8m0", "ue8m0")


def test_ue8m0_scales_are_powers_of_two_that_cover_each_block(v31):
    stored = load_file(str(v31 / "model.safetensors"))
    scales = [t for n, t in stored.items() if n.endswith("_scale_inv")]
    assert scales and all((torch.frexp(s).mantissa == 0.5).all() for s in scales)


def test_v31_fp8_checkpoint_decodes_as_hf_on_its_dequantised_weights(v31, tmp_path):
    decodes_as_hf(v31, dequantised_dir(v31, tmp_path / "plain"), CONFIG)


@pytest.fixture(scope="module")
def bundled_ue8m0(tmp_path_factory) -> tuple[Path, list[str], list[list[int]]]:
    """The bundled trained model (its MTP layer accepts most drafts) in V3.1's FP8 layout,
    prompts, and their plain greedy tokens."""
    path = quantize_dir(BUNDLED_MODEL_DIR, tmp_path_factory.mktemp("bundled") / "ue8m0", "ue8m0")
    prompts = [f"<|bos|><|user|>\n{q}\n<|assistant|>\n" for q in QUESTIONS]
    llm = LLM(model=str(path), dtype="float32", block_size=16)
    return path, prompts, [list(o.outputs[0].token_ids) for o in llm.generate(prompts, MTP_RUN)]


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_is_lossless_on_the_bundled_model_quantised_to_ue8m0(bundled_ue8m0, k):
    """The FP8 MTP layer loads, drafts are accepted, and the tokens are plain decoding's."""
    path, prompts, plain = bundled_ue8m0
    spec = LLM(model=str(path), dtype="float32", block_size=16, num_speculative_tokens=k,
               speculative_confidence="off")  # fmt: skip
    assert [list(o.outputs[0].token_ids) for o in spec.generate(prompts, MTP_RUN)] == plain
    assert spec.get_metrics().accepted_tokens > 0


def test_a_ue8m0_checkpoint_with_another_scale_is_refused_naming_it(v31, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(v31, bad)
    stored = load_file(str(bad / "model.safetensors"))
    name = next(n for n in sorted(stored) if n.endswith("_scale_inv"))
    stored[name] = stored[name] * 1.5
    save_file(stored, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name}.*power of two"):
        LLM(model=str(bad), dtype="float32")


def test_an_unknown_scale_fmt_is_refused_naming_it(v31, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(v31, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = "ue4m3"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="scale_fmt='ue4m3'"):
        LLM(model=str(bad), dtype="float32")


# ---- Kimi-K2-Thinking's INT4 routed experts (compressed-tensors pack-quantized) ---------------

KIMI = "kimi_like"
GROUP = 32  # Kimi-K2-Thinking's group size


def reference_unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The format's documented packing, read word by word with numpy, independently of
    xllm_py.weights.int4: column 8j+i in bits 4i..4i+3 of word j, stored as q + 8."""
    words = packed.numpy().view(np.uint32)
    out = np.zeros((words.shape[0], words.shape[1] * 8), dtype=np.int64)
    for i in range(8):
        out[:, i::8] = ((words >> np.uint32(4 * i)) & np.uint32(0xF)).astype(np.int64) - 8
    return torch.from_numpy(out[:, :cols])


@pytest.fixture(scope="module")
def kimi_int4(tmp_path_factory) -> tuple[Path, Path]:
    """(the INT4 checkpoint, the same weights dequantised by the test for HF)."""
    root = tmp_path_factory.mktemp("kimi-int4")
    hf = make_hf_checkpoint(KIMI, root / "hf", seed=CHECKPOINT_SEEDS[KIMI])
    q = quantize_checkpoint(hf, root / "int4", group_size=GROUP)
    plain = root / "plain"
    plain.mkdir()
    stored, out = load_file(str(q / "model.safetensors")), {}
    for name, t in stored.items():
        if name.endswith("_packed"):
            base = name.removesuffix("_packed")
            rows, cols = stored[base + "_shape"].tolist()
            scale = stored[base + "_scale"].float().repeat_interleave(GROUP, dim=1)[:, :cols]
            out[base] = reference_unpack(t, cols).float() * scale
        elif not name.endswith(("_scale", "_shape")):
            out[name] = t
    save_file(out, str(plain / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((q / "config.json").read_text())
    del cfg["quantization_config"]
    (plain / "config.json").write_text(json.dumps(cfg))
    return q, plain


def test_int4_experts_are_packed_as_the_format_documents(kimi_int4):
    q, _ = kimi_int4
    stored = load_file(str(q / "model.safetensors"))
    packed = [n for n in stored if n.endswith("weight_packed")]
    assert packed and all(".mlp.experts." in n for n in packed)  # experts only
    assert not any(n.endswith("_packed") for n in stored if "self_attn" in n)
    cfg = json.loads((q / "config.json").read_text())["quantization_config"]
    assert (cfg["quant_method"], cfg["format"]) == ("compressed-tensors", "pack-quantized")
    name = packed[0].removesuffix("_packed")
    rows, cols = stored[name + "_shape"].tolist()
    assert stored[packed[0]].dtype == torch.int32 and stored[packed[0]].shape == (rows, cols // 8)
    values = reference_unpack(stored[packed[0]], cols)
    assert values.min() >= -8 and values.max() <= 7 and values.abs().max() == 7


def test_int4_checkpoint_decodes_as_hf_on_its_dequantised_weights(kimi_int4):
    q, plain = kimi_int4
    decodes_as_hf(q, plain, KIMI)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["config_groups"]["group_0"]["weights"].update(num_bits=8), "num_bits=8"),
        (lambda c: c["config_groups"]["group_0"]["weights"].update(symmetric=False), "symmetric"),
        (lambda c: c.update(format="float-quantized"), "num_bits=4 is not supported; need 8"),
        (lambda c: c.update(format="int-quantized"), "format='int-quantized'"),
    ],
    ids=["int8", "asymmetric", "fp8-block-with-int4-weights", "int8-format"],
)
def test_an_int4_scheme_this_engine_does_not_read_is_refused_naming_it(
    kimi_int4, tmp_path, change, message
):
    bad = tmp_path / "bad"
    shutil.copytree(kimi_int4[0], bad)
    cfg = json.loads((bad / "config.json").read_text())
    change(cfg["quantization_config"])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(bad), dtype="float32")
