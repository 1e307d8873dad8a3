"""Kimi-K2-Thinking's INT4 routed experts kept packed on the device (--weight_dtype int4,
xllm_py/weights/int4.py `Int4Weight`) against the same checkpoint dequantised at load.

The checkpoint is test_model_families.py's Kimi-like one (HF transformers' random
weights, routed experts packed by tools/quantize_int4.py at group 32). Here:
- greedy decoding with packed experts (the torch path, and the fused MoE kernels under
  Triton's interpreter) gives the tokens of load-time dequantisation, logprobs within 1e-4
  (float32: both multiply by the same weight values);
- the packed experts' resident bytes (words + bf16 scales, read off the model's tensors)
  are at most 30% of the same experts loaded in bf16;
- the fused MoE kernels on packed experts with partial words and groups match the
  reference on the same weights dequantised by the load-time code, and build for a
  Hopper GPU (Triton's front end, tests/triton_lowering.py: the interpreter skips its
  checks);
- tensor-/expert-parallel ranks hold exactly their slice of each packed expert, and a
  split of the input columns that does not fall on a group is refused naming the tensor;
- `weight_dtype=int4` on a checkpoint without INT4 tensors, or in graph mode, is refused;
- the memory plan prices packed experts at about 0.28 of bf16.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.hf_reference import CHECKPOINT_SEEDS, make_hf_checkpoint, reference_prompts
from tests.test_model_families import GROUP, KIMI
from tests.test_ops_fused_moe import CONTRACT_TOL, TOL, make_ids
from tests.triton_lowering import lower_packed_moe
from tools.make_header_checkpoint import family_config, make_header_checkpoint
from tools.quantize_int4 import quantize_checkpoint
from xllm_py import LLM, SamplingParams
from xllm_py.config import ModelConfig
from xllm_py.models.deepseek_v3 import DeepseekV3ForCausalLM
from xllm_py.models.layers.linear import Linear
from xllm_py.models.layers.moe import MoE, grouped_experts
from xllm_py.ops.fused_moe import fused_moe_reference, fused_moe_triton
from xllm_py.parallel.context import ParallelContext
from xllm_py.plan import make_plan
from xllm_py.weights.int4 import Int4Weight, dequantize_int4, int4_resident, quantize_int4
from xllm_py.weights.loader import Checkpoint, layer_index, load_weights

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return make_hf_checkpoint(KIMI, tmp_path_factory.mktemp("kimi-hf"), CHECKPOINT_SEEDS[KIMI])


@pytest.fixture(scope="module")
def ckpt(hf, tmp_path_factory) -> Path:
    return quantize_checkpoint(hf, tmp_path_factory.mktemp("kimi") / "int4", group_size=GROUP)


def run(path: Path, weight_dtype: str, dtype: str = "float32", moe_backend: str = "torch"):
    """(tokens and chosen-token logprobs of each reference prompt, the worker)."""
    llm = LLM(
        model=str(path),
        dtype=dtype,
        weight_dtype=weight_dtype,
        moe_backend=moe_backend,
        enable_graph=False,
        block_size=16,
        max_cache_size=8 << 20,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in reference_prompts(KIMI)], GREEDY)
    results = []
    for o in outs:
        c = o.outputs[0]
        results.append((list(c.token_ids), [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]))
    return results, llm.engine.core.executor.worker


@pytest.fixture(scope="module")
def dequantised(ckpt):
    return run(ckpt, "float32")


@pytest.fixture(scope="module")
def packed(ckpt):
    return run(ckpt, "int4")


def moe_layers(worker) -> list[MoE]:
    return [m for m in worker.model.modules() if isinstance(m, MoE)]


def check_same_decoding(got, want) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    worst = max(abs(a - b) for (_, g), (_, w) in zip(got, want) for a, b in zip(g, w))
    assert worst < 1e-4


def test_packed_experts_decode_as_load_time_dequantisation(packed, dequantised):
    got, worker = packed
    moes = moe_layers(worker)
    assert moes and all(isinstance(w, Int4Weight) for m in moes for w in (m.w13, m.w2))
    assert all(isinstance(m.w13, torch.Tensor) for m in moe_layers(dequantised[1]))
    check_same_decoding(got, dequantised[0])


@pytest.mark.skipif(not INTERPRETER, reason="the fused MoE kernels on CPU need TRITON_INTERPRET=1")
def test_packed_experts_through_the_fused_moe_kernels(ckpt, dequantised):
    got, worker = run(ckpt, "int4", moe_backend="triton")
    assert all(m.fused_moe is not None and isinstance(m.w13, Int4Weight)
               for m in moe_layers(worker))  # fmt: skip
    check_same_decoding(got, dequantised[0])


def test_packed_experts_take_at_most_30_percent_of_their_bf16_bytes(ckpt, packed):
    """Every tensor the packed experts hold (int32 words, bf16 group scales), against the
    same experts loaded dequantised in bf16."""
    _, bf16 = run(ckpt, "bf16", dtype="bfloat16")
    held = sum(
        t.numel() * t.element_size() for m in moe_layers(packed[1]) for w in (m.w13, m.w2)
        for t in w.buffers()
    )  # fmt: skip
    dense = [w for m in moe_layers(bf16) for w in (m.w13, m.w2)]
    assert all(w.dtype == torch.bfloat16 for w in dense)
    ratio = held / sum(w.numel() * w.element_size() for w in dense)
    scales = [w.scale for m in moe_layers(packed[1]) for w in (m.w13, m.w2)]
    assert all(s.dtype == torch.bfloat16 for s in scales)  # kept as the checkpoint stores them
    assert 0.25 < ratio <= 0.30, f"{ratio:.4f}"


# ---- the fused MoE kernels on packed experts ----------------------------------------------------

# hidden 76 and I 20: neither a multiple of 8 nor of the group, so each row of w13 and w2
# ends in a partial word and a partial group.
HIDDEN, INTER = 76, 20
RANKS = 3  # as test_ops_fused_moe's make_ids: this rank is rank 1, first_expert = E_local


def int4_experts(n: int, rows: int, cols: int, g: torch.Generator):
    """(the packed stack, the same weights dequantised by the load-time code, float32)."""
    packed, scales, plain = [], [], []
    for _ in range(n):
        p, s = quantize_int4(torch.randn(rows, cols, generator=g) / cols**0.5, GROUP)
        s = s.to(torch.bfloat16)
        packed.append(p)
        scales.append(s)
        plain.append(dequantize_int4(p, s, (rows, cols), GROUP, torch.float32))
    return Int4Weight(torch.stack(packed), torch.stack(scales), cols, GROUP), torch.stack(plain)


@pytest.mark.skipif(not INTERPRETER, reason="the fused MoE kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,top_k,n_local", [(3, 3, 6), (17, 4, 8)])
def test_fused_moe_on_packed_experts_matches_the_reference(T, top_k, n_local, dtype):
    g = torch.Generator().manual_seed(T)
    w13, plain13 = int4_experts(n_local, 2 * INTER, HIDDEN, g)
    w2, plain2 = int4_experts(n_local, HIDDEN, INTER, g)
    assert w13.packed.shape[1:] == (2 * INTER, 10) and w2.scale.shape[1:] == (HIDDEN, 1)
    x = torch.randn(T, HIDDEN, generator=g).to(dtype)
    ids = make_ids(T, top_k, n_local, g)
    weights = torch.rand(T, top_k, generator=g).to(dtype)
    got = fused_moe_triton(x, weights, ids, w13, w2, n_local, block_m=16)
    # the reference in fp32 on the float32 weights the load-time code gives
    dense = fused_moe_reference(x, weights, ids, plain13, plain2, n_local)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, dense, **TOL[dtype])
    torch.testing.assert_close(fused_moe_reference(x, weights, ids, w13, w2, n_local), dense)
    layer = grouped_experts(x, weights, ids, w13, w2, n_local)
    torch.testing.assert_close(layer, dense, **CONTRACT_TOL[dtype])
    if T == 3:  # token 1 picked only other ranks' experts
        assert got[1].eq(0).all()


@pytest.fixture(scope="module")
def kimi_k2_experts():
    """8 experts at Kimi-K2's shapes (hidden 7168, I 2048, group 32), packed and dequantised."""
    g = torch.Generator().manual_seed(0)
    return int4_experts(8, 2 * 2048, 7168, g), int4_experts(8, 7168, 2048, g)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("T", [1, 64, 512])
def test_fused_moe_on_packed_experts_on_cuda_at_kimi_k2_shapes(kimi_k2_experts, T):
    """bf16 activations, top 8: the kernels on the packed words match the reference on the
    same weights dequantised by the load-time code."""
    ((w13, plain13), (w2, plain2)), n_local, dev = kimi_k2_experts, 8, "cuda"
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 7168, generator=g).to(dev, torch.bfloat16)
    ids = make_ids(T, 8, n_local, g).to(dev)
    weights = (torch.rand(T, 8, generator=g) * 2).to(dev)
    got = fused_moe_triton(x, weights, ids, w13.to(dev), w2.to(dev), n_local)
    # on a GPU the kernels round each dequantised weight to bf16 once, before the dot
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    want = fused_moe_reference(x, weights, ids, plain13.to(**bf16), plain2.to(**bf16), n_local)
    torch.testing.assert_close(got.float(), want.float(), **TOL["cuda"])


def test_fused_moe_int4_kernels_build_for_hopper():
    """Both kernels lower for sm_90 with INT4 weights: each unpacks (tt.reshape) and
    multiplies (tt.dot)."""
    pytest.importorskip("triton")
    built = lower_packed_moe("*i32", "*bf16", True, ["tt.reshape", "tt.dot"])
    assert len(built) == 4 and all(v == [True, True] for v in built.values()), built


def test_int4_weight_rows_fuse_and_stack_as_the_whole_tensor():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 45, generator=g)
    p, s = quantize_int4(w, GROUP)
    full = dequantize_int4(p, s, (10, 45), GROUP, torch.float32)
    whole = Int4Weight(p, s, 45, GROUP)
    upper, lower = Int4Weight(p[:3], s[:3], 45, GROUP), Int4Weight(p[3:], s[3:], 45, GROUP)
    assert torch.equal(Int4Weight.cat([upper, lower]).dequant(torch.float32), full)
    stack = Int4Weight.stack([whole, Int4Weight.cat([upper, lower])])
    assert stack.shape == (2, 10, 45)
    assert torch.equal(stack[torch.tensor([1, 0, 1])].dequant(torch.float32)[2], full)
    with pytest.raises(ValueError, match="share columns"):
        Int4Weight.cat([whole, Int4Weight(p[:, :2], s[:, :1], 16, GROUP)])


# ---- tensor- and expert-parallel slices ---------------------------------------------------------


def rank_model(path: Path, parallel: ParallelContext, group: int | None):
    """This rank's target model, loaded (routed experts packed at `group`; None: not)."""
    cfg = ModelConfig.from_pretrained(path)
    with int4_resident(group):
        model = DeepseekV3ForCausalLM(cfg, parallel)
    n = cfg.num_hidden_layers
    load_weights(
        model, Checkpoint(path), lambda name: None if (layer_index(name) or 0) >= n else name
    )
    return model


@pytest.fixture(scope="module")
def ckpt_g8(hf, tmp_path_factory) -> Path:
    """Group 8: a 2-way split of the experts' 16 intermediate columns falls on a group."""
    return quantize_checkpoint(hf, tmp_path_factory.mktemp("kimi") / "int4-g8", group_size=8)


@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp", "ep"])
def test_parallel_ranks_hold_exactly_their_slice_of_each_packed_expert(ckpt_g8, ep_size):
    whole = rank_model(ckpt_g8, ParallelContext(), None)  # dequantised at load
    part = rank_model(ckpt_g8, ParallelContext(1, 2, ep_size), 8)
    full = {n: m for n, m in whole.named_modules() if isinstance(m, Linear)}
    names = []
    for name, m in part.named_modules():
        if not isinstance(m, Linear) or not m.group:
            continue
        shard = m.weight_packed.int4.shard
        want = full[name].weight if shard is None else shard.take(full[name].weight)
        m.process_weights_after_loading()
        assert isinstance(m.weight, Int4Weight)
        assert torch.equal(m.weight.dequant(torch.float32), want), name
        names.append(name)
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in names}
    assert experts == (set(range(6, 12)) if ep_size == 2 else set(range(12)))  # 12 experts


def test_a_split_of_the_input_columns_inside_a_group_is_refused_naming_the_tensor(ckpt):
    """2-way tensor parallel: each rank's down_proj takes 8 of the 16 intermediate columns,
    inside a group of 32."""
    want = (
        r"INT4 tensor 'model\.layers\.1\.mlp\.experts\.\d+\.down_proj\.weight' .* gives "
        r"each rank 8 columns, not a multiple of its group size 32"
    )
    with pytest.raises(ValueError, match=want):
        rank_model(ckpt, ParallelContext(0, 2, 1), GROUP)


def test_weight_dtype_int4_is_refused_where_it_cannot_hold(ckpt):
    with pytest.raises(ValueError, match="weight_dtype=int4: the checkpoint has no INT4"):
        LLM(dtype="float32", weight_dtype="int4")  # the bundled model is not quantised
    with pytest.raises(ValueError, match="weight_dtype=int4 with enable_graph=True"):
        LLM(model=str(ckpt), weight_dtype="int4", enable_graph=True)
    with pytest.raises(ValueError, match="weight_dtype='int8' must be auto, fp8, int4"):
        LLM(model=str(ckpt), weight_dtype="int8")


# ---- the memory plan ----------------------------------------------------------------------------


def test_plan_prices_packed_experts_as_the_engine_holds_them(tmp_path):
    """Kimi-K2-Thinking's published shapes (3 of its 61 layers, for speed): packed experts
    cost 0.5 byte a value plus a bf16 scale per 32, (0.5 + 2 / 32) / 2 = 0.28 of bf16; auto
    keeps them packed, as the engine does on CUDA."""
    cfg = family_config("kimi-k2-thinking") | {"num_hidden_layers": 3}
    path = make_header_checkpoint(tmp_path / "k2t", shards=1, config=cfg)
    plans = {
        wd: make_plan(path, 8, tp=8, ep=8, num_speculative_tokens=0, weight_dtype=wd)
        for wd in ("auto", "int4", "bf16")
    }
    assert plans["auto"].opts.weight_dtype == "int4"
    experts = {  # the routed experts' tensors (the router, float32, is the same in all)
        wd: sum(t.nbytes for t in p.tensors if ".mlp.experts." in t.name) for wd, p in plans.items()
    }
    assert abs(experts["int4"] / experts["bf16"] - (0.5 + 2 / 32) / 2) < 1e-9
    assert experts["auto"] == experts["int4"]
    with pytest.raises(ValueError, match="--weight_dtype=fp8"):
        make_plan(path, 8, tp=8, ep=8, weight_dtype="fp8")
    with pytest.raises(ValueError, match="--weight_dtype=int4"):
        make_plan(family_dir(tmp_path), 8, tp=8, ep=8, weight_dtype="int4")


def family_dir(tmp_path: Path) -> Path:
    """A Kimi-K2 (FP8) header replica, 3 layers: no INT4 tensors."""
    cfg = family_config("kimi-k2") | {"num_hidden_layers": 3}
    return make_header_checkpoint(tmp_path / "k2", shards=1, config=cfg)
