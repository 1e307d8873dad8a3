"""DeepSeek-V4 checkpoints in the release's quantised layout, served by the engine.

A tiny V4 saved by HF transformers (test_deepseek_v4.py; with a random MTP layer,
test_deepseek_v4_mtp.py) is written by tools/quantize_fp4.py --fp8-dense as the release
stores it: routed experts FP4 (int8 e2m1 pairs, ue8m0 `X.scale` per 32 columns), the
attention projections and shared experts block-FP8 (e4m3, ue8m0 `X.scale` per 128 x 128).
The reference is the same checkpoint dequantised as a whole state dict (weights/fp4.py
`dequantize_state_dict`) and saved unquantised; HF transformers, loading the tool's output
with its own FP8/FP4 dequantisation, gives exactly that copy's logits. Here:

- through `LLM`, float32, a ragged batch of four: dequantised at load (--weight_dtype auto)
  and kept packed (--weight_dtype fp4, `Fp4Linear`) both give the reference's greedy
  tokens, with logprobs within 1e-5;
- with --moe_backend triton (the fused MoE kernels, Triton's interpreter here) the
  routed experts are two stacks, packed FP4 ones still packed, and give the same tokens,
  logprobs within 1e-4;
- the packed experts' resident bytes, read off the model's buffers, are at most 30% of
  the same experts in bfloat16 (0.2656: 4.25 bits a weight);
- with MTP drafts (k = 2), the draft's experts are packed too, and greedy tokens equal
  plain decoding's; tools/export_deepseek_mtp.py writes the `mtp.*` layer alone,
  dequantised, and served with --draft_model it drafts exactly as in place (a DSpark
  drafter is refused by the tool, naming a tensor);
- what does not fit is refused naming the flag or field: weight_dtype=fp4 without FP4
  experts or on another model, weight_dtype=fp8/int4 with V4, a quant_method other than the
  release's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_deepseek_v4 import hf_checkpoint
from tests.test_deepseek_v4_mtp import with_mtp
from tests.test_fp4 import hf_load_fp4
from tools.export_deepseek_mtp import export
from tools.export_deepseek_mtp import main as export_main
from tools.quantize_fp4 import quantize_checkpoint
from xllm_py import LLM, SamplingParams
from xllm_py.config import ModelConfig
from xllm_py.weights import fp4

NAME = "hc2-sliding-csa-hca"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPTS = [[(7 * i + 3 * j) % 90 + 3 for j in range(n)] for i, n in enumerate((5, 29, 17, 40))]


def dequantised_copy(src: Path, dst: Path) -> Path:
    """src's tensors dequantised as one state dict, saved with an unquantised config."""
    cfg = json.loads((src / "config.json").read_text())
    assert fp4.expert_dtype(cfg) == "fp4"
    cfg = {k: v for k, v in cfg.items() if k not in ("expert_dtype", "quantization_config")}
    dst.mkdir()
    sd = fp4.dequantize_state_dict(load_file(src / "model.safetensors"), torch.float32)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(the tool's output, its dequantised copy)."""
    root = tmp_path_factory.mktemp("v4q")
    hf_checkpoint(NAME, root / "float")
    quantised = quantize_checkpoint(root / "float", root / "release", dense=True)
    return quantised, dequantised_copy(quantised, root / "dequantised")


def run(path: Path, prompts=PROMPTS, **kw):
    llm = LLM(model=str(path), dtype="float32", block_size=4, **kw)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    logprobs = [[entry[t] for entry, t in zip(o.logprobs, o.token_ids)] for o in outs]
    return llm, [list(o.token_ids) for o in outs], torch.tensor(logprobs)


@pytest.fixture(scope="module")
def reference(checkpoints):
    return run(checkpoints[1])[1:]


def experts(model) -> list[torch.nn.Module]:
    layers = model.model.layers
    return [m for layer in layers for e in layer.ffn.experts.values() for m in e.children()]


def test_the_tool_writes_the_release_layout(checkpoints):
    tensors = load_file(checkpoints[0] / "model.safetensors")
    layer = "model.layers.1."
    assert tensors[layer + "ffn.experts.0.w1.weight"].dtype == torch.int8
    for name in (
        "attn.wq_a",
        "attn.wkv",
        "attn.wo_b",
        "attn.indexer.wq_b",
        "ffn.shared_experts.w2",
    ):
        assert tensors[layer + name + ".weight"].dtype == torch.float8_e4m3fn, name
        assert tensors[layer + name + ".scale"].dtype == torch.float8_e8m0fnu, name
    assert tensors[layer + "attn.compressor.wkv.weight"].dtype == torch.float32  # left as is


def test_hf_reads_the_release_layout_as_the_dequantised_copy(checkpoints, monkeypatch):
    import transformers

    quantised, dequantised = checkpoints
    hf = hf_load_fp4(quantised, monkeypatch)
    assert type(hf.model.layers[1].self_attn.q_a_proj).__name__ == "Linear"  # dequantised
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(dequantised, dtype=torch.float32)
    ids = torch.tensor([PROMPTS[3]])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ref.eval()(ids).logits)


@pytest.mark.parametrize("weight_dtype", ["auto", "fp4"])
def test_quantised_v4_gives_its_dequantised_copys_tokens(checkpoints, reference, weight_dtype):
    llm, tokens, logprobs = run(checkpoints[0], weight_dtype=weight_dtype)
    held = {type(m).__name__ for m in experts(llm.engine.core.executor.worker.model)}
    assert held == {"Fp4Linear" if weight_dtype == "fp4" else "Linear"}
    want_tokens, want_logprobs = reference
    assert tokens == want_tokens
    assert torch.allclose(logprobs, want_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("weight_dtype", ["auto", "fp4"])
def test_the_fused_moe_kernels_give_the_expert_loops_tokens(checkpoints, reference, weight_dtype):
    """--moe_backend triton (Triton's interpreter here): the routed experts as two stacks
    through ops/fused_moe.py's kernels (packed FP4 unpacked tile by tile there, the
    swiglu clamp in the kernel), the draft's too: the per-expert loop's tokens, logprobs
    within 1e-4."""
    llm, tokens, logprobs = run(checkpoints[0], weight_dtype=weight_dtype, moe_backend="triton")
    moe = llm.engine.core.executor.worker.model.model.layers[0].ffn
    assert isinstance(moe.w13, fp4.Fp4Weight if weight_dtype == "fp4" else torch.Tensor)
    assert not hasattr(moe, "experts")  # the stacks replace the per-expert modules
    assert tokens == reference[0]
    assert torch.allclose(logprobs, reference[1], atol=1e-4, rtol=0)


def test_packed_experts_take_under_30_percent_of_their_bf16_bytes(checkpoints):
    model = run(checkpoints[0], PROMPTS[:1], weight_dtype="fp4")[
        0
    ].engine.core.executor.worker.model
    packed = sum(b.numel() * b.element_size() for m in experts(model) for b in m.buffers())
    bf16 = sum(m.weight.shape[0] * m.weight.shape[1] * 2 * 2 for m in experts(model))
    assert packed / bf16 <= 0.30, packed / bf16
    assert packed / bf16 == pytest.approx(4.25 / 16)


@pytest.fixture(scope="module")
def with_draft(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("v4q-mtp")
    return quantize_checkpoint(with_mtp(NAME, root / "float"), root / "release", dense=True)


@pytest.fixture(scope="module")
def drafted(with_draft):
    """Greedy tokens and (draft, accepted) counts, drafting with the checkpoint's own MTP
    layer at k = 2 on packed experts."""
    llm, tokens, _ = run(with_draft, weight_dtype="fp4", num_speculative_tokens=2)
    draft = llm.engine.core.executor.worker.draft
    assert any(isinstance(m, fp4.Fp4Linear) for m in draft.modules())  # its experts packed too
    m = llm.get_metrics()
    return tokens, (m.draft_tokens, m.accepted_tokens)


def test_mtp_drafts_on_packed_experts_keep_greedy_output(with_draft, drafted):
    tokens, (draft_tokens, _) = drafted
    assert draft_tokens > 0  # drafts were verified (a random MTP layer's are rarely accepted)
    assert tokens == run(with_draft, weight_dtype="fp4")[1]


def test_the_exported_mtp_layer_drafts_as_the_one_in_place(with_draft, drafted, tmp_path):
    """tools/export_deepseek_mtp.py on the release layout: the `mtp.*` layer alone,
    dequantised, served with --draft_model, drafts the same tokens (the same counts)."""
    out = tmp_path / "draft"
    assert export_main(["--input-dir", str(with_draft), "--output-dir", str(out)]) == 0
    tensors = load_file(out / "model-00001-of-00001.safetensors")
    assert tensors and all(n.startswith("mtp.0.") for n in tensors)
    assert {t.dtype for t in tensors.values()} <= {torch.bfloat16, torch.float32}
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "DeepseekV4MtpForCausalLM"
    ]
    exported = tmp_path / "f32"  # float32 like the run, so the drafts are the same numbers
    assert export_main(["--input-dir", str(with_draft), "--output-dir", str(exported),
                        "--dtype", "float32"]) == 0  # fmt: skip
    llm, tokens, _ = run(
        with_draft, weight_dtype="fp4", num_speculative_tokens=2, draft_model=str(exported)
    )
    m = llm.get_metrics()
    assert (tokens, (m.draft_tokens, m.accepted_tokens)) == drafted
    # a DSpark drafter under the same names is not MTP layers: refused, naming a tensor
    dspark = tmp_path / "dspark"
    dspark.mkdir()
    (dspark / "config.json").write_text((with_draft / "config.json").read_text())
    mtp = {"mtp.0.e_proj.weight": torch.zeros(2, 2), "mtp.2.markov_head.w.weight": torch.zeros(2)}
    save_file(mtp, dspark / "model.safetensors")
    with pytest.raises(ValueError, match="DSpark drafter \\(mtp.2.markov_head.w.weight\\)"):
        export(dspark, tmp_path / "no", torch.bfloat16, False)


def test_what_does_not_fit_is_refused_naming_it(checkpoints, tmp_path):
    quantised, dequantised = checkpoints
    with pytest.raises(ValueError, match="weight_dtype=fp4: this checkpoint's routed experts"):
        LLM(model=str(dequantised), dtype="float32", weight_dtype="fp4")
    for wd in ("fp8", "int4"):
        with pytest.raises(ValueError, match=f"weight_dtype={wd} with DeepseekV4ForCausalLM"):
            LLM(model=str(quantised), dtype="float32", weight_dtype=wd)
    with pytest.raises(ValueError, match="weight_dtype=fp4 with DeepseekV3ForCausalLM"):
        LLM(dtype="float32", weight_dtype="fp4")  # the bundled V3-shaped model
    raw = json.loads((quantised / "config.json").read_text())
    awq = raw | {"quantization_config": {"quant_method": "awq"}}
    with pytest.raises(ValueError, match="quant_method='awq' with DeepseekV4ForCausalLM"):
        ModelConfig.from_dict(awq)
