"""The Triton RMSNorm, fused add + RMSNorm and rotary kernels (ops/rms_norm.py,
ops/rotary.py) against their torch references, run by Triton's interpreter on CPU
(conftest.py sets it up without a GPU); a model with the Triton kernels installed against
the same model with the torch ones; and the torch path against the unfused formula, bit
for bit (the fused layout must not change what --attention_backend=torch computes)."""

from __future__ import annotations

import pytest
import torch

from tools.make_random_checkpoint import BASE_CONFIG, random_tensors, tensor_shapes
from xllm_py.config import ModelConfig
from xllm_py.models.attention_layout import RequestLayout, build_context
from xllm_py.models.context import forward_context
from xllm_py.models.deepseek_mtp import DeepseekV3MTP
from xllm_py.models.deepseek_v3 import DeepseekV3ForCausalLM
from xllm_py.models.layers.rope import apply_rope
from xllm_py.ops import rms_norm, rotary
from xllm_py.ops.backends import Kernels, install
from xllm_py.ops.rms_norm import (
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from xllm_py.ops.rotary import apply_rope_triton

# Kernel output vs reference. Both compute in float32 and round once to the run dtype, so
# they differ by float32 rounding plus at most one rounding step of the output dtype --
# except that Triton's interpreter converts float32 to bfloat16 by truncation (its
# `_convert_float` without a rounding mode) where torch and the GPU round to nearest: one
# more bf16 ulp (2^-7 relative), hence the bf16 rtol of two ulps.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),  # one fp16 ulp is 2^-10 relative
    torch.bfloat16: dict(atol=1e-2, rtol=2 * 2**-7),
}
# The fused kernel's new residual (x + residual rounded once): exactly torch's add, except
# for the interpreter's truncation to bfloat16 (exact on a GPU: test_on_cuda).
RESIDUAL_TOL = {
    torch.float32: dict(atol=0.0, rtol=0.0),
    torch.float16: dict(atol=0.0, rtol=0.0),
    torch.bfloat16: dict(atol=0.0, rtol=2**-7),
}
# A whole model (4 decoder layers, the MTP layer) in float32, with the Triton paged-MLA
# kernel on decode rows too: float32 rounding, compounded over the layers.
MODEL_TOL = dict(atol=1e-4, rtol=1e-4)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6
# Without CUDA, conftest.py turns the interpreter on and the kernels run on CPU tensors;
# with CUDA it is off, and the same tests run the compiled kernels.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(T: int, d: int, dtype: torch.dtype, seed: int = 0, device: str = DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g).to(device, dtype)
    residual = (torch.randn(T, d, generator=g) * 3).to(device, dtype)
    scale = torch.empty(d).uniform_(0.5, 1.5, generator=g) * d**0.5  # weight * sqrt(d)
    return x, residual, scale.to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [80, 128, 160])  # 80 and 160: masked (not a power of 2)
@pytest.mark.parametrize("T", [1, 3, 17])  # 17 at d=160: two programs, the last partial
def test_rms_norm_triton_matches_the_reference(dtype, d, T):
    x, residual, scale = _inputs(T, d, dtype)
    got = rms_norm_triton(x, scale, EPS * d)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, rms_norm_reference(x, scale, EPS * d), **TOL[dtype])

    normed, new_residual = add_rms_norm_triton(x, residual, scale, EPS * d)
    want_normed, want_residual = add_rms_norm_reference(x, residual, scale, EPS * d)
    assert new_residual.dtype == dtype and normed.dtype == dtype
    torch.testing.assert_close(new_residual, want_residual, **RESIDUAL_TOL[dtype])
    torch.testing.assert_close(normed, want_normed, **TOL[dtype])


def test_add_rms_norm_reference_is_the_unfused_model_math():
    x, residual, scale = _inputs(3, 80, torch.bfloat16)
    normed, h = add_rms_norm_reference(x, residual, scale, EPS * 80)
    assert torch.equal(h, residual + x)  # rounded to bf16 before the norm reads it
    hf = h.float()
    want = hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + EPS) * (scale / 80**0.5)
    torch.testing.assert_close(normed, want.to(torch.bfloat16), **TOL[torch.bfloat16])


def test_rms_norm_triton_reads_strided_rows():
    """MLA normalises column slices of one projection's output (q_a, c_kv)."""
    x, residual, scale = _inputs(5, 200, torch.float32)
    part, res_part = x[:, 40:120], residual[:, 40:120]  # row stride 200, d = 80
    torch.testing.assert_close(
        rms_norm_triton(part, scale[:80], EPS * 80), rms_norm_reference(part, scale[:80], EPS * 80)
    )
    got = add_rms_norm_triton(part, res_part, scale[:80], EPS * 80)
    want = add_rms_norm_reference(part, res_part, scale[:80], EPS * 80)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def _table(T: int, D: int, seed: int = 1, device: str = DEVICE) -> torch.Tensor:
    """[T, 1, D / 2] complex64 with a magnitude that is not 1 (YaRN's cos/sin scale)."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(T, 1, D // 2, generator=g) * 200.0
    return torch.polar(torch.full_like(angles, 1.25), angles).to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("pairs_per_program", [rotary.PAIRS_PER_PROGRAM, 64])
def test_rope_triton_matches_apply_rope(dtype, D, pairs_per_program, monkeypatch):
    """H query heads and the shared key, as MLA rotates them: [T, H + 1, D]; the complex
    table (eager) and the real one (compiled); with 64 pairs a program, several head
    groups a token, the last one partial."""
    monkeypatch.setattr(rotary, "PAIRS_PER_PROGRAM", pairs_per_program)
    T, H = 3, 4
    g = torch.Generator().manual_seed(2)
    q = torch.randn(T, H, 16 + D, generator=g).to(DEVICE, dtype)  # [nope | rope] per head
    k_pe = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    x = torch.cat([q[..., 16:], k_pe.unsqueeze(1)], dim=1)
    cis = _table(T, D)
    want = apply_rope(x, cis)
    for table in (cis, torch.view_as_real(cis)):
        got = apply_rope_triton(x, table)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got, want, **TOL[dtype])
    # A strided view (the rope slice of q, not concatenated) reads the same pairs.
    got = apply_rope_triton(q[..., 16:], cis)
    torch.testing.assert_close(got, apply_rope(q[..., 16:].contiguous(), cis), **TOL[dtype])


def test_launchers_say_what_is_missing(monkeypatch):
    x, residual, scale = _inputs(2, 80, torch.float32, device="cpu")
    table = _table(2, 16, device="cpu")
    monkeypatch.setattr(rms_norm, "_rms_norm_kernel", object())  # as if compiled for a GPU
    monkeypatch.setattr(rotary, "_rope_kernel", object())
    with pytest.raises(RuntimeError, match="interpreter is off: set TRITON_INTERPRET=1"):
        rms_norm_triton(x, scale, EPS)
    with pytest.raises(RuntimeError, match="interpreter is off: set TRITON_INTERPRET=1"):
        add_rms_norm_triton(x, residual, scale, EPS)
    with pytest.raises(RuntimeError, match="interpreter is off: set TRITON_INTERPRET=1"):
        apply_rope_triton(x.view(2, 5, 16), table)
    monkeypatch.setattr(rms_norm, "triton", None)
    monkeypatch.setattr(rotary, "triton", None)
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        add_rms_norm_triton(x, residual, scale, EPS)
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        apply_rope_triton(x.view(2, 5, 16), table)


# ---- the model ----------------------------------------------------------------------

BLOCK_SIZE = 16
PREFILL = (11, 9)  # two prompts (expanded MLA), then one decode row each (absorbed MLA)


@pytest.fixture(scope="module")
def models():
    raw = dict(BASE_CONFIG, num_hidden_layers=4)  # one dense layer, three MoE; one MTP layer
    cfg = ModelConfig.from_dict(raw, "<random>")
    tensors = random_tensors(tensor_shapes(raw, 1), seed=5)
    with torch.device(DEVICE):
        target = DeepseekV3ForCausalLM(cfg).eval()
        draft = DeepseekV3MTP(cfg, target, 1).eval()
    target.load_state_dict({k: tensors[k] for k in target.state_dict()})
    n = cfg.num_hidden_layers
    draft.load_state_dict({k: tensors[f"model.layers.{n}.{k[9:]}"] for k in draft.state_dict()})
    target.process_weights_after_loading()
    draft.process_weights_after_loading()
    return cfg, target, draft


def _steps(cfg):
    """(layouts, input_ids, positions) of a prefill step, then of a decode step."""
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(2, cfg.vocab_size, (n + 1,), generator=g) for n in PREFILL]
    prefill = [RequestLayout(sum(PREFILL[:i]), n, n, [i]) for i, n in enumerate(PREFILL)]
    decode = [RequestLayout(i, 1, n + 1, [i]) for i, n in enumerate(PREFILL)]
    steps = [
        (prefill, torch.cat([t[:-1] for t in ids]), torch.cat([torch.arange(n) for n in PREFILL])),
        (decode, torch.stack([t[-1] for t in ids]), torch.tensor(PREFILL)),
    ]
    return [(layouts, ids.to(DEVICE), pos.to(DEVICE)) for layouts, ids, pos in steps]


def _run(cfg, forward) -> list[torch.Tensor]:
    """forward(input_ids, positions) over both steps with a fresh cache; its outputs."""
    head = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    n = cfg.num_hidden_layers + 1
    caches = [torch.zeros(4, BLOCK_SIZE, head, device=DEVICE) for _ in range(n)]
    outs = []
    with torch.no_grad():
        for layouts, ids, pos in _steps(cfg):
            with forward_context(build_context(layouts, pos, caches, BLOCK_SIZE)):
                outs.append(forward(ids, pos))
    return outs


def _with_draft(target, draft):
    def forward(ids, pos):
        hidden = target(ids, pos)
        return torch.cat([hidden, draft(ids, pos, hidden)], dim=-1)  # the draft reads hidden

    return forward


def _unfused(target, draft):
    """The model as written before the fused layout: h = h + f(norm(h)), per layer."""

    def block(layer, h, rope):
        h = h + layer.self_attn(layer.input_layernorm(h), rope)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def forward(ids, pos):
        rope, h = target.rotary(pos), target.model.embed_tokens(ids)
        for layer in target.model.layers:
            h = block(layer, h, rope)
        hidden = target.model.norm(h)
        mtp = draft.layers[0]
        x = torch.cat([mtp.enorm(target.model.embed_tokens(ids)), mtp.hnorm(hidden)], dim=-1)
        return torch.cat([hidden, block(mtp, mtp.eh_proj(x), rope)], dim=-1)

    return forward


def test_model_with_triton_kernels_gives_the_torch_hidden_states(models):
    cfg, target, draft = models
    torch_kernels, triton_kernels = Kernels("torch", "torch"), Kernels("triton", "torch")
    try:
        for model in (target, draft):
            install(model, torch_kernels)
        want = _run(cfg, _with_draft(target, draft))
        assert all(torch.equal(a, b) for a, b in zip(want, _run(cfg, _unfused(target, draft))))
        for model in (target, draft):
            install(model, triton_kernels)
        assert target.model.norm.triton and draft.layers[0].self_attn.kv_a_layernorm.triton
        got = _run(cfg, _with_draft(target, draft))
    finally:
        for model in (target, draft):
            install(model, torch_kernels)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **MODEL_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_on_cuda(dtype):
    """DeepSeek-V3's sizes on a GPU: hidden 7168 (one row a program), 128 heads + the key;
    the bf16 residual is exactly torch's add there (no interpreter truncation)."""
    d, T = 7168, 33
    x, residual, scale = _inputs(T, d, dtype, device="cuda")
    normed, h = add_rms_norm_triton(x, residual, scale, EPS * d)
    want_normed, want_h = add_rms_norm_reference(x, residual, scale, EPS * d)
    assert torch.equal(h, want_h)
    torch.testing.assert_close(normed, want_normed, **TOL[dtype])
    got = rms_norm_triton(x[:, :512], scale[:512], EPS * 512)
    want = rms_norm_reference(x[:, :512], scale[:512], EPS * 512)
    torch.testing.assert_close(got, want, **TOL[dtype])
    q = torch.randn(T, 129, 64, device="cuda").to(dtype)
    cis = _table(T, 64, device="cuda")
    torch.testing.assert_close(apply_rope_triton(q, cis), apply_rope(q, cis), **TOL[dtype])
