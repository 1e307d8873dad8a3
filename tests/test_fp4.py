"""DeepSeek-V4's FP4 routed experts (xllm_py/weights/fp4.py, tools/quantize_fp4.py):

- packing: all 16 e2m1 codes in both nibbles of a byte round-trip, in HF transformers'
  order (its own unpacking reads our bytes as the values we meant);
- rounding: every value goes to the nearest e2m1 multiple of its block's scale (ties to
  the even code), the scale is the smallest power of two that fits the block's largest
  magnitude in 6.0, so the error is at most half a grid step;
- dequantisation equals HF's `Fp8Dequantize` bit for bit (float32 and bfloat16);
- a tiny DeepseekV4ForCausalLM saved by HF, quantised by the tool: HF transformers loads
  the tool's output itself (its own FP4 dequantisation) and our module loads the same
  files through `dequantize_state_dict`; the expert weights are equal bit for bit, the
  greedy tokens are equal and the logits within 1e-4; on a GPU HF would convert only the
  experts (the config's `modules_to_not_convert`);
- the packed experts take at most 30% of their bfloat16 bytes (measured on the tensors:
  the checkpoint's, and an `Fp4Weight`'s buffers): 0.2656, 4.25 bits a weight;
- the tool's flags, errors and sharded output;
- experts kept packed (`Fp4Weight`) through ops/fused_moe.py's kernels under Triton's
  interpreter: equal to the torch reference on the load-time dequantised weights (experts
  with no, one and many tokens, other ranks' experts, partial K tiles), every code and
  scale decoded exactly, and both kernels build for a Hopper GPU (Triton's front end);
  on a CUDA device, the same at DeepSeek-V4-Flash's shapes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_deepseek_v4 import CONFIGS, OneRequest, hf_checkpoint
from tests.test_ops_fused_moe import HIDDEN, INTER, TOL, make_ids
from tests.triton_lowering import lower_packed_moe
from tools.quantize_fp4 import main as quantize_main
from tools.quantize_fp4 import quantize_checkpoint
from xllm_py.models.deepseek_v4 import DeepseekV4ForCausalLM, V4Config
from xllm_py.ops.fused_moe import fused_moe_reference, fused_moe_triton
from xllm_py.weights import fp4
from xllm_py.weights.fp8 import quantize as fp8_quantize

NAME = "hc2-sliding-csa-hca"
PROMPT, DECODE = 29, 12
GRID = torch.tensor(fp4.E2M1)
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def hf_dequantize(packed, scale, dtype):
    """HF transformers' own FP4 dequantisation (the loader's `Fp8Dequantize` op)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that -0.0 and 0.0 (and NaNs) compare as stored."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


# ---- packing and rounding ------------------------------------------------------------------


def test_pack_unpack_round_trips_every_code_in_both_nibbles():
    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    codes = torch.stack((lo.flatten(), hi.flatten()), dim=-1).flatten().to(torch.uint8)
    packed = fp4.pack_fp4(codes.view(8, 64))  # 256 bytes: every (low, high) pair
    assert packed.dtype == torch.int8 and packed.shape == (8, 32)
    byte = packed.view(torch.uint8).flatten()
    assert torch.equal(byte, (lo + 16 * hi).flatten().to(torch.uint8))  # low nibble first
    assert sorted(byte.tolist()) == list(range(256))
    assert torch.equal(fp4.unpack_fp4(packed), codes.view(8, 64))
    # read back as values, by us and by HF: the e2m1 table, even columns from low nibbles
    one = torch.full((8, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2 ** 0
    want = GRID[codes.long()].view(8, 64)
    for got in (
        fp4.dequantize_fp4(packed, one, torch.float32),
        hf_dequantize(packed, one, torch.float32),
    ):
        assert torch.equal(bits(got), bits(want))
    with pytest.raises(ValueError, match="codes in"):
        fp4.pack_fp4(torch.tensor([3, 16], dtype=torch.uint8))


def test_rounding_is_to_nearest_with_ties_to_the_even_code():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert [fp4.E2M1[c] for c in fp4.e2m1_codes(ties)] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert [fp4.E2M1[c] for c in fp4.e2m1_codes(-ties)] == [
        -0.0,
        -1.0,
        -1.0,
        -2.0,
        -2.0,
        -4.0,
        -4.0,
    ]
    assert fp4.e2m1_codes(torch.tensor([-0.1, 0.1, 9.0, -7.0])).tolist() == [8, 0, 7, 15]
    x = (torch.rand(20000, generator=torch.Generator().manual_seed(0)) - 0.5) * 13
    got = GRID[fp4.e2m1_codes(x).long()]
    nearest = (x[:, None] - GRID[None, :]).abs().min(dim=1).values
    in_range = x.abs() <= 6
    assert torch.equal((x - got).abs()[in_range], nearest[in_range])
    assert torch.equal(got[~in_range], 6 * x[~in_range].sign())  # beyond 6: saturated


def half_step(q: torch.Tensor) -> torch.Tensor:
    """Half the gap between the e2m1 values around |q| (q in [-6, 6])."""
    return torch.where(q.abs() < 2, 0.25, torch.where(q.abs() < 4, 0.5, 1.0))


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 96)])  # a stack of experts too
def test_quantization_error_is_at_most_half_a_grid_step(shape):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=gen) * torch.exp2(
        torch.randint(-30, 30, shape[:-1] + (1,), generator=gen)
    )
    w[..., 0, :32] = 0.0  # an all-zero block
    w[..., 1, 32:64] *= 1e-36  # a block whose scale is below float32's normal range
    packed, scale = fp4.quantize_fp4(w)
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and packed.dtype == torch.int8
    assert scale.shape == (*shape[:-1], shape[-1] // 32) and scale.dtype == torch.float8_e8m0fnu
    s = scale.float().unsqueeze(-1)  # [..., blocks, 1]
    amax = w.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    assert bool((amax <= 6 * s).all())
    assert bool(((amax > 3 * s) | (scale.view(torch.uint8).unsqueeze(-1) == 0)).all())  # smallest
    assert int(scale.view(torch.uint8)[..., 0, 0].max()) == 0  # all zero: 2 ** -127
    got = fp4.dequantize_fp4(packed, scale, torch.float32).unflatten(-1, (-1, 32))
    q = w.unflatten(-1, (-1, 32)) / s
    assert bool(((got - w.unflatten(-1, (-1, 32))).abs() <= half_step(q) * s).all())
    # the dequantised value is the nearest point of the block's grid
    nearest = (q.unsqueeze(-1) - GRID).abs().min(-1).values * s
    assert torch.equal((got - w.unflatten(-1, (-1, 32))).abs(), nearest)


def test_columns_must_be_whole_blocks_of_32():
    with pytest.raises(
        ValueError, match="tensor 'x.w1.weight': 48 input columns is not a multiple of 32"
    ):
        fp4.quantize_fp4(torch.ones(2, 48), "tensor 'x.w1.weight'")
    packed, scale = fp4.quantize_fp4(torch.ones(2, 64))
    with pytest.raises(ValueError, match="one scale per 32 columns"):
        fp4.dequantize_fp4(packed, scale[:, :1], torch.float32)


# ---- HF's dequantisation ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantization_equals_hf_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (48, 256), generator=gen, dtype=torch.uint8)
    exps = torch.randint(127 - 40, 127 + 40, (48, 8), generator=gen, dtype=torch.uint8)
    exps[0, 0], exps[0, 1] = 0, 1  # 2 ** -127, 2 ** -126: subnormal products in float32
    packed, scale = fp4.pack_fp4(codes), exps.view(torch.float8_e8m0fnu)
    ours = fp4.dequantize_fp4(packed, scale, dtype)
    assert torch.equal(bits(ours), bits(hf_dequantize(packed, scale, dtype)))
    w = torch.randn(64, 128, generator=gen)  # and on what quantize_fp4 writes
    packed, scale = fp4.quantize_fp4(w)
    assert torch.equal(
        bits(fp4.dequantize_fp4(packed, scale, dtype)), bits(hf_dequantize(packed, scale, dtype))
    )


def test_dequantize_state_dict_reads_fp4_experts_and_fp8_blocks():
    gen = torch.Generator().manual_seed(3)
    w_exp, w_attn, norm = (
        torch.randn(32, 64, generator=gen),
        torch.randn(200, 130, generator=gen),
        torch.ones(64),
    )
    packed, scale = fp4.quantize_fp4(w_exp)
    f8, f8_scale = fp8_quantize(w_attn, (128, 128), "ue8m0")
    sd = {
        "layers.0.ffn.experts.0.w1.weight": packed,
        "layers.0.ffn.experts.0.w1.scale": scale,
        "layers.0.attn.wq_b.weight": f8,
        "layers.0.attn.wq_b.scale": f8_scale.to(torch.float8_e8m0fnu),  # the release's type
        "layers.0.attn_norm.weight": norm,
    }
    out = fp4.dequantize_state_dict(sd, torch.bfloat16)
    assert sorted(out) == [
        "layers.0.attn.wq_b.weight",
        "layers.0.attn_norm.weight",
        "layers.0.ffn.experts.0.w1.weight",
    ]
    assert torch.equal(
        out["layers.0.ffn.experts.0.w1.weight"], fp4.dequantize_fp4(packed, scale, torch.bfloat16)
    )
    assert out["layers.0.attn.wq_b.weight"].dtype == torch.bfloat16
    assert (
        out["layers.0.attn.wq_b.weight"].float() - w_attn
    ).abs().max() < 0.1 * w_attn.abs().max()
    assert out["layers.0.attn_norm.weight"] is norm
    missing = "'layers.0.ffn.experts.0.w1.weight' is torch.int8 but '.*w1.scale' is missing"
    with pytest.raises(ValueError, match=missing):
        fp4.dequantize_state_dict(
            {k: v for k, v in sd.items() if k != "layers.0.ffn.experts.0.w1.scale"}, torch.float32
        )
    with pytest.raises(ValueError, match="'x.scale' scales a weight that is not"):
        fp4.dequantize_state_dict({"x.scale": scale}, torch.float32)


def test_expert_dtype_is_read_where_v4_and_v41_put_it():
    assert (
        fp4.expert_dtype({"expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8"}})
        == "fp4"
    )
    assert fp4.expert_dtype({"quantization_config": {"expert_dtype": "fp8"}}) == "fp8"
    assert fp4.expert_dtype({}) is None
    with pytest.raises(
        ValueError, match=r"expert_dtype='nvfp4' is not supported; expected one of \['fp4', 'fp8'\]"
    ):
        fp4.expert_dtype({"quantization_config": {"expert_dtype": "nvfp4"}})


# ---- a tiny V4 quantised by the tool, in HF and in our module ---------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    src = tmp_path_factory.mktemp("v4-float")
    hf_checkpoint(NAME, src)
    return src, quantize_checkpoint(src, tmp_path_factory.mktemp("v4") / "fp4")


def hf_load_fp4(path: Path, monkeypatch):
    """HF transformers' own loader on the tool's output: its FP8 quantizer, reading the
    `expert_dtype: fp4` experts and dequantising them (as it does without a GPU). Its
    environment check wants `accelerate`, which that CPU path never calls and this venv
    does not install; the check is all that is patched."""
    import transformers
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer

    monkeypatch.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def ours_from_state_dict(path: Path) -> DeepseekV4ForCausalLM:
    """Our module's normal load, from the state dict `dequantize_state_dict` gives."""
    cfg_dict = json.loads((path / "config.json").read_text())
    assert fp4.expert_dtype(cfg_dict) == "fp4"
    model = DeepseekV4ForCausalLM(V4Config.from_dict(cfg_dict)).eval()
    sd = fp4.dequantize_state_dict(load_file(path / "model.safetensors"), torch.float32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model.process_weights_after_loading()
    return model


def greedy(model: DeepseekV4ForCausalLM, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The prompt in one chunk, then DECODE greedy tokens one a step: (tokens, logits)."""
    request, tokens = OneRequest(model, PROMPT + DECODE), prompt.tolist()
    with torch.no_grad():
        logits = [request(prompt)]
        for _ in range(DECODE):
            tokens.append(int(logits[-1][-1].argmax()))
            logits.append(request(torch.tensor(tokens[-1:])))
    return tokens, torch.cat(logits)


def test_tool_output_gives_hf_greedy_tokens_through_dequantize(checkpoints, monkeypatch):
    src, dst = checkpoints
    hf, model = hf_load_fp4(dst, monkeypatch), ours_from_state_dict(dst)
    sd = fp4.dequantize_state_dict(load_file(dst / "model.safetensors"), torch.float32)
    cfg = CONFIGS[NAME]
    for i in range(cfg["num_hidden_layers"]):  # HF's dequantised experts are ours, bit for bit
        experts, pre = hf.model.layers[i].mlp.experts, f"model.layers.{i}.ffn.experts"
        w = {
            j: torch.stack([sd[f"{pre}.{e}.w{j}.weight"] for e in range(cfg["n_routed_experts"])])
            for j in (1, 2, 3)
        }
        assert torch.equal(bits(experts.gate_up_proj), bits(torch.cat([w[1], w[3]], dim=1)))
        assert torch.equal(bits(experts.down_proj), bits(w[2]))
        original = load_file(src / "model.safetensors")[f"{pre}.0.w1.weight"]
        assert not torch.equal(w[1][0], original)  # it is the quantised copy
    prompt = torch.randint(
        2, cfg["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(1)
    )
    tokens, got = greedy(model, prompt)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    assert tokens[PROMPT:] == want[PROMPT - 1 : -1].argmax(-1).tolist()
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


def test_on_a_gpu_hf_would_convert_only_the_experts(checkpoints):
    """The config's modules_to_not_convert, through HF's own module replacement (run on
    the meta device, as HF does before loading; without a GPU it dequantises instead)."""
    import transformers
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.auto import AutoHfQuantizer

    cfg = transformers.AutoConfig.from_pretrained(checkpoints[1])
    qc = FineGrainedFP8Config.from_dict(dict(cfg.quantization_config))
    assert qc.expert_dtype == "fp4" and qc.scale_fmt == "ue8m0" and not qc.dequantize
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(cfg)
    AutoHfQuantizer.from_config(qc, pre_quantized=True)._process_model_before_weight_loading(model)
    converted = {n: m for n, m in model.named_modules() if type(m).__name__.startswith("FP8")}
    assert sorted(converted) == [
        f"model.layers.{i}.mlp.experts" for i in range(CONFIGS[NAME]["num_hidden_layers"])
    ]
    experts = next(iter(converted.values()))  # FP4 storage: int8 [E, 2 I, hidden / 2]
    assert experts.gate_up_proj.dtype == torch.int8 and experts.gate_up_proj.shape[-1] == 32


def test_packed_experts_take_at_most_30_percent_of_bf16_bytes(checkpoints):
    sd = load_file(checkpoints[1] / "model.safetensors")
    weights = [n for n in sd if fp4.EXPERT.search(n)]
    packed = sum(sd[n].nbytes + sd[n.removesuffix(".weight") + ".scale"].nbytes for n in weights)
    bf16 = sum(sd[n].numel() * 2 * torch.bfloat16.itemsize for n in weights)  # 2 values a byte
    assert len(weights) == 3 * 3 * CONFIGS[NAME]["n_routed_experts"]
    assert packed / bf16 == (0.5 + 1 / 32) / 2 <= 0.30  # 0.2656: 4.25 bits a weight over 16


# ---- the tool ----------------------------------------------------------------------------------


def test_tool_config_says_fp4_experts_as_the_release_does(checkpoints):
    cfg = json.loads((checkpoints[1] / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4"
    qc = cfg["quantization_config"]
    assert qc["expert_dtype"] == "fp4"
    assert {k: qc[k] for k in ("quant_method", "fmt", "scale_fmt", "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]
    }  # fmt: skip
    assert (checkpoints[1] / "generation_config.json").is_file()


def test_tool_help_names_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        quantize_main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--input-dir", "--output-dir", "--force", "--fp8-dense"):
        assert flag in text
    assert text.count("\n  -") == 5  # -h and the four flags, each with its help


def write_v4(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1, **cfg) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", **cfg}))
    names, weight_map = sorted(tensors), {}
    for i in range(shards):
        f = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / f))
        weight_map.update(dict.fromkeys(part, f))
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_tool_errors_name_the_bad_value(tmp_path, capsys):
    good = write_v4(tmp_path / "in", {"layers.0.ffn.experts.0.w1.weight": torch.ones(4, 64)})
    (tmp_path / "out").mkdir()
    cases = [
        (
            ["--input-dir", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o1")],
            "--input-dir=.*nope: no config.json",
        ),
        (
            ["--input-dir", str(good), "--output-dir", str(tmp_path / "out")],
            "--output-dir=.*out exists .use --force",
        ),
        (
            ["--input-dir", str(good), "--output-dir", str(good), "--force"],
            "--output-dir=.* is the input directory",
        ),
    ]
    odd = write_v4(tmp_path / "odd", {"mtp.0.ffn.experts.3.w2.weight": torch.ones(4, 40)})
    cases.append(
        (
            ["--input-dir", str(odd), "--output-dir", str(tmp_path / "o2")],
            "'mtp.0.ffn.experts.3.w2.weight': 40 input columns",
        )
    )
    done = write_v4(
        tmp_path / "done", {"x.weight": torch.ones(1)}, quantization_config={"quant_method": "fp8"}
    )
    cases.append(
        (["--input-dir", str(done), "--output-dir", str(tmp_path / "o3")], "already quantised")
    )
    none = write_v4(tmp_path / "none", {"x.weight": torch.ones(1)})
    cases.append(
        (
            ["--input-dir", str(none), "--output-dir", str(tmp_path / "o4")],
            "no routed expert tensors",
        )
    )
    for argv, match in cases:
        with pytest.raises(SystemExit) as e:
            quantize_main(argv)
        assert e.match(match)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))  # nothing half-written
    assert good.is_dir() and (good / "config.json").is_file()


def test_tool_keeps_shards_and_writes_their_index(tmp_path):
    gen = torch.Generator().manual_seed(4)
    tensors = {
        f"layers.0.ffn.experts.{e}.w{j}.weight": torch.randn(32, 64, generator=gen)
        for e in range(2)
        for j in (1, 2, 3)
    }
    tensors["layers.0.attn.wkv.weight"] = torch.randn(8, 64, generator=gen).bfloat16()
    src = write_v4(tmp_path / "in", tensors, shards=2)
    quantize_main(["--input-dir", str(src), "--output-dir", str(tmp_path / "out")])
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())[
        "weight_map"
    ]
    out = {}
    for f in sorted(set(index.values())):
        out |= load_file(tmp_path / "out" / f)
    assert sorted(index) == sorted(out) and len(out) == len(tensors) + 6
    assert out["layers.0.attn.wkv.weight"].dtype == torch.bfloat16  # copied as it was
    for name, w in tensors.items():
        if fp4.EXPERT.search(name):
            scale = out[name.removesuffix(".weight") + ".scale"]
            assert index[name] == index[name.removesuffix(".weight") + ".scale"]
            assert torch.equal(out[name], fp4.quantize_fp4(w)[0]) and torch.equal(
                scale.view(torch.uint8), fp4.quantize_fp4(w)[1].view(torch.uint8)
            )


# ---- FP4 kept packed: the fused MoE kernels ------------------------------------------------


def fp4_experts(n: int, rows: int, cols: int, g: torch.Generator, parts: int = 1):
    """(the packed stack, the same weights dequantised by the load-time code, float32):
    each expert's matrix quantised in `parts` row ranges and fused (w1 | w3), as a model
    would hold them."""

    def one():
        w = torch.randn(rows // parts, cols, generator=g) / cols**0.5
        return fp4.Fp4Weight.quantize(w)

    stack = fp4.Fp4Weight.stack(
        [fp4.Fp4Weight.cat([one() for _ in range(parts)]) for _ in range(n)]
    )
    return stack, fp4.dequantize_fp4(stack.packed, stack.scale, torch.float32)


@pytest.mark.skipif(not INTERPRETER, reason="the fused MoE kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,top_k,n_local", [(1, 2, 4), (3, 3, 6), (17, 4, 8)])
def test_fused_moe_on_packed_fp4_experts_matches_the_reference(T, top_k, n_local, dtype):
    """hidden 160 and I 96: 5 and 3 scale blocks, the last K tile (64 columns) partial;
    experts with no, one and many tokens, and other ranks' experts (make_ids)."""
    g = torch.Generator().manual_seed(T)
    w13, plain13 = fp4_experts(n_local, 2 * INTER, HIDDEN, g, parts=2)
    w2, plain2 = fp4_experts(n_local, HIDDEN, INTER, g)
    assert w13.packed.shape[1:] == (2 * INTER, HIDDEN // 2) and w2.scale.shape[1:] == (HIDDEN, 3)
    x = torch.randn(T, HIDDEN, generator=g).to(dtype)
    ids = make_ids(T, top_k, n_local, g)
    weights = torch.rand(T, top_k, generator=g) * 2
    got = fused_moe_triton(x, weights, ids, w13, w2, n_local, block_m=16)
    # the reference in fp32 on the float32 weights the load-time code gives
    dense = fused_moe_reference(x, weights, ids, plain13, plain2, n_local)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, dense, **TOL[dtype])
    torch.testing.assert_close(fused_moe_reference(x, weights, ids, w13, w2, n_local), dense)
    if T == 3:  # token 1 picked only other ranks' experts
        assert got[1].eq(0).all()


@pytest.mark.skipif(not INTERPRETER, reason="the fused MoE kernels on CPU need TRITON_INTERPRET=1")
def test_fused_moe_kernels_decode_every_fp4_code_and_scale_exactly():
    """One expert, one-hot tokens (token t reads weight column t): gate rows 96 each, so
    silu(gate) = 96 exactly in float32 (sigmoid(96) rounds to 1), w2 the identity (4.0 at
    scale 2 ** -2), so out[t, r] = 96 * up[r, t], one product each: exact for all 16 codes
    in both nibbles, at scales from 2 ** -127 (a subnormal product) to 2 ** 100."""
    hidden, inter = 64, 32
    codes = torch.arange(inter * hidden).remainder(16).to(torch.uint8).view(inter, hidden)
    codes[1::2] = codes[1::2].roll(1, dims=1)  # each code at even and odd columns
    exps = torch.tensor([0, 1, 100, 127, 140, 227], dtype=torch.uint8).repeat(11)[: inter * 2]
    up = fp4.Fp4Weight(fp4.pack_fp4(codes), exps.view(inter, 2).view(torch.float8_e8m0fnu))
    gate = fp4.Fp4Weight.quantize(torch.full((inter, hidden), 96.0))
    w13 = fp4.Fp4Weight.stack([fp4.Fp4Weight.cat([gate, up])])
    w2 = fp4.Fp4Weight.stack([fp4.Fp4Weight.quantize(torch.eye(hidden, inter))])
    x, ids, weights = (
        torch.eye(hidden),
        torch.zeros(hidden, 1, dtype=torch.long),
        torch.ones(hidden, 1),
    )
    got = fused_moe_triton(x, weights, ids, w13, w2, 0, block_m=16)
    want = torch.zeros(hidden, hidden)
    want[:, :inter] = 96 * up.dequant(torch.float32).T
    assert want.isfinite().all() and (want[:, :inter] != 0).float().mean() > 0.8
    assert torch.equal(got, want)  # values: a -0.0 weight sums with +0.0 products to +0.0


def test_fp4_weight_rows_fuse_and_stack_as_the_whole_tensor():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(10, 96, generator=g)
    whole = fp4.Fp4Weight.quantize(w)
    upper, lower = fp4.Fp4Weight.quantize(w[:3]), fp4.Fp4Weight.quantize(w[3:])
    full = whole.dequant(torch.float32)
    assert torch.equal(fp4.Fp4Weight.cat([upper, lower]).dequant(torch.float32), full)
    stack = fp4.Fp4Weight.stack([whole, fp4.Fp4Weight.cat([upper, lower])])
    assert stack.shape == (2, 10, 96) and torch.equal(stack[1].dequant(torch.float32), full)
    assert torch.equal(stack[torch.tensor([1, 0])].dequant(torch.bfloat16)[0], full.bfloat16())
    with pytest.raises(ValueError, match="need int8 codes and float8_e8m0fnu scales"):
        fp4.Fp4Weight(whole.packed, whole.scale.float())
    with pytest.raises(ValueError, match=r"scale \(10, 2\) does not fit packed \(10, 48\)"):
        fp4.Fp4Weight(whole.packed, whole.scale[:, :2])


@pytest.mark.parametrize("shape", [(8, 2 * 64, 256), (8, 256, 64)])  # w13, w2 of 8 experts
def test_resident_fp4_experts_take_at_most_30_percent_of_bf16_bytes(shape):
    """Measured on the tensors an Fp4Weight holds (its buffers) against the same
    experts held as bfloat16 tensors."""
    weight = fp4.Fp4Weight.quantize(torch.randn(shape))
    resident = sum(b.nbytes for b in weight.buffers())
    bf16 = fp4.dequantize_fp4(weight.packed, weight.scale, torch.bfloat16).nbytes
    assert resident / bf16 == 0.265625 <= 0.30


def test_fused_moe_fp4_kernels_build_for_hopper():
    """Both kernels lower for sm_90 with FP4 weights (int8 bytes, uint8 exponents): each
    unpacks (tt.reshape), builds the values' bits (tt.bitcast) and multiplies. The
    interpreter skips the front end's type checks, and the FP4 branch is chosen by the
    weight pointer's type, which only the front end sees."""
    pytest.importorskip("triton")
    built = lower_packed_moe("*i8", "*u8", False, ["tt.reshape", "tt.bitcast", "tt.dot"])
    assert len(built) == 4 and all(v == [True, True, True] for v in built.values()), built


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("T", [1, 64, 512])
def test_fused_moe_on_packed_fp4_experts_on_cuda_at_v4_flash_shapes(T):
    """bf16 activations, top 6 of 8 local experts at DeepSeek-V4-Flash's shapes (hidden
    4096, I 2048): the kernels on the packed bytes match the reference on the same
    weights dequantised by the load-time code (each rounded to bf16 once, as the kernels'
    tiles are)."""
    g, n_local, dev = torch.Generator().manual_seed(T), 8, "cuda"
    w13, plain13 = fp4_experts(n_local, 2 * 2048, 4096, g, parts=2)
    w2, plain2 = fp4_experts(n_local, 4096, 2048, g)
    x = torch.randn(T, 4096, generator=g).to(dev, torch.bfloat16)
    ids = make_ids(T, 6, n_local, g).to(dev)
    weights = (torch.rand(T, 6, generator=g) * 2).to(dev)
    got = fused_moe_triton(x, weights, ids, w13.to(dev), w2.to(dev), n_local)
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    want = fused_moe_reference(x, weights, ids, plain13.to(**bf16), plain2.to(**bf16), n_local)
    torch.testing.assert_close(got.float(), want.float(), **TOL["cuda"])
