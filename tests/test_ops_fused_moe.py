"""The fused MoE kernels (xllm_py/ops/fused_moe.py) against their torch reference, run by
Triton's interpreter on CPU (conftest.py sets TRITON_INTERPRET=1 without a GPU): experts
with no, one and many tokens, assignments to other ranks' experts, run-dtype and FP8
weights with partial edge blocks; and the sort-and-pad step exactly, with no host sync.

The reference rounds where the kernels round (fp32 products, act and each assignment's
output in the run dtype, FP8 activations quantised 1 x 128 at both GEMMs), so kernel vs
reference differ only by accumulation order: the tolerances below. The reference is tied
to the layer's contract by a second comparison, with models/layers/moe.py's
`grouped_experts` (which rounds at other points, and for FP8 does not quantise
activations: a relative bound)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from xllm_py.models.layers.moe import grouped_experts
from xllm_py.ops import fused_moe
from xllm_py.ops.fused_moe import (
    align_by_expert,
    fused_moe_reference,
    fused_moe_triton,
    padded_slots,
)
from xllm_py.weights.fp8 import Fp8Weight, block_index, quantize

# Kernel vs reference: the same roundings, another summation order (under the
# interpreter only at fp32 level; a GPU's tiles may flip an output's last bit, or, for FP8,
# an activation's e4m3 rounding: one step, of one of I terms).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    "fp8": dict(atol=3e-2, rtol=1.6e-2),  # bf16 run dtype
    # DeepSeek-V3 shapes on a GPU (bf16 run dtype): sums of 7168 and 2048 products in
    # another order, so more of act's bf16 and e4m3 roundings flip than at tiny shapes.
    "cuda": dict(atol=3e-2, rtol=2e-2),
    "cuda fp8": dict(atol=6e-2, rtol=3e-2),
}
# Reference vs grouped_experts (rounds gate/up and the weighted sum in the run dtype).
CONTRACT_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=8e-3, rtol=8e-3),
    torch.bfloat16: dict(atol=6e-2, rtol=4e-2),
}
# FP8: grouped_experts dequantises the weights but keeps activations in the run dtype; two
# e4m3 activation quantisations cost a few percent of the output's norm.
FP8_CONTRACT_REL = 0.08
BLOCK = (128, 128)
RANKS = 3  # expert parallel: this rank is rank 1, so first_expert = E_local
# (T, top_k, E_local); hidden and I of each are below. T = 17: local expert 0 takes all
# 17 tokens, a run of two blocks of 16.
CASES = [(1, 2, 4), (3, 3, 6), (17, 4, 8)]
HIDDEN, INTER = 160, 96  # neither a multiple of 128: partial edge blocks for FP8
BLOCK_M = 16


def make_ids(T: int, top_k: int, n_local: int, g: torch.Generator) -> torch.Tensor:
    """[T, top_k] global ids, distinct per token: local expert 0 in every token (many),
    local 1 only in token 0 (one), local 2 in none (zero); with T = 3, token 1 picks only
    other ranks' experts; the rest drawn from the other local and the remote experts."""
    first = n_local
    remote = [e for e in range(RANKS * n_local) if not first <= e < first + n_local]
    others = list(range(first + 3, first + n_local)) + remote
    rows = []
    for t in range(T):
        if T == 3 and t == 1:
            picks = [remote[i] for i in torch.randperm(len(remote), generator=g)[:top_k]]
        else:
            picks = [first] + ([first + 1] if t == 0 else [])
            fill = torch.randperm(len(others), generator=g)[: top_k - len(picks)]
            picks += [others[i] for i in fill]
        rows.append([picks[i] for i in torch.randperm(top_k, generator=g)])
    return torch.tensor(rows)


def problem(case, dtype, seed: int):
    T, top_k, n_local = case
    g = torch.Generator().manual_seed(seed)
    ids = make_ids(T, top_k, n_local, g)
    x = torch.randn(T, HIDDEN, generator=g).to(dtype)
    weights = torch.rand(T, top_k, generator=g) * 2  # float32, as the router returns them
    return x, weights, ids


def dense_experts(n_local: int, dtype, g: torch.Generator):
    w13 = torch.randn(n_local, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(n_local, HIDDEN, INTER, generator=g) / INTER**0.5
    return w13.to(dtype), w2.to(dtype)


def fp8_matrix(rows: int, cols: int, g: torch.Generator) -> Fp8Weight:
    q, scale = quantize(torch.randn(rows, cols, generator=g) / cols**0.5, BLOCK)
    return Fp8Weight(q, scale, block_index(rows, BLOCK[0]), block_index(cols, BLOCK[1]), BLOCK)


def fp8_experts(n_local: int, g: torch.Generator) -> tuple[Fp8Weight, Fp8Weight]:
    """As the model holds them (MoE.process_weights_after_loading): gate and up quantised
    apart, fused along rows (each keeps its own partial scale block), experts stacked."""
    w13 = Fp8Weight.stack(
        [
            Fp8Weight.cat([fp8_matrix(INTER, HIDDEN, g), fp8_matrix(INTER, HIDDEN, g)])
            for _ in range(n_local)
        ]
    )
    w2 = Fp8Weight.stack([fp8_matrix(HIDDEN, INTER, g) for _ in range(n_local)])
    return w13, w2


def test_the_cases_give_experts_no_one_and_many_tokens():
    for case in CASES:
        T, top_k, n_local = case
        _, _, ids = problem(case, torch.float32, seed=T)
        local = ids.view(-1) - n_local
        counts = [int((local == e).sum()) for e in range(n_local)]
        assert counts[:3] == [T - (T == 3), 1, 0]  # many (T = 17: two blocks), one, none
        assert all(len(set(row)) == top_k for row in ids.tolist())  # distinct, as top-k is
        if T > 1:
            assert ((local < 0) | (local >= n_local)).any()  # other ranks' experts


# ---- align_by_expert ---------------------------------------------------------------------------


def expected_alignment(ids, n_local, first, block_m):
    """The layout in plain Python: each local expert's assignments in increasing order,
    padded with the sentinel A to a multiple of block_m; the blocks' experts."""
    A = ids.numel()
    local = [e - first for e in ids.view(-1).tolist()]
    slots, experts = [], []
    for e in range(n_local):
        run = [a for a in range(A) if local[a] == e]
        pad = -len(run) % block_m
        slots += run + [A] * pad
        experts += [e] * ((len(run) + pad) // block_m)
    return slots, experts


ALIGN_CASES = [  # (T, top_k, E_local, first_expert, block_m, ids drawn from [0, E_total))
    (1, 1, 1, 0, 16, 1),
    (1, 8, 16, 16, 16, 64),
    (5, 2, 4, 4, 4, 12),
    (17, 4, 8, 8, 16, 24),
    (33, 6, 3, 0, 8, 3),  # every assignment local: runs of many blocks
    (9, 3, 4, 8, 4, 8),  # every assignment remote: nothing to run
    (40, 8, 32, 32, 64, 256),
    (7, 3, 5, 2, 1, 10),  # block_m 1: no padding
]


@pytest.mark.parametrize("case", ALIGN_CASES, ids=lambda c: "T{}k{}E{}f{}m{}".format(*c[:5]))
def test_align_by_expert_sorts_and_pads_every_owned_assignment_once(case):
    T, top_k, n_local, first, block_m, total = case
    g = torch.Generator().manual_seed(T * 100 + top_k)
    ids = torch.stack([torch.randperm(total, generator=g)[:top_k] for _ in range(T)])
    A = ids.numel()
    sorted_ids, expert_of_block, num_padded = align_by_expert(ids, n_local, first, block_m)
    P = padded_slots(A, n_local, block_m)
    assert sorted_ids.shape == (P,) and P % block_m == 0
    assert expert_of_block.shape == (P // block_m,) and num_padded.shape == ()
    local = ids.view(-1) - first
    owned = ((local >= 0) & (local < n_local)).nonzero().view(-1).tolist()
    got = sorted_ids.tolist()
    assert sorted(a for a in got if a != A) == owned  # each owned assignment exactly once
    slots, experts = expected_alignment(ids, n_local, first, block_m)
    n = num_padded.item()
    assert n == len(slots) <= P
    assert got[:n] == slots and got[n:] == [A] * (P - n)  # sentinels past the runs
    assert expert_of_block.tolist() == experts + [-1] * (P // block_m - len(experts))
    for b, e in enumerate(experts):  # every used block: one expert, at least one real row
        block = got[b * block_m : (b + 1) * block_m]
        assert any(a != A for a in block)
        assert all(local[a] == e for a in block if a != A)


def test_align_by_expert_needs_no_host_sync():
    """On meta tensors (shapes, no data) any `.item()`, `.tolist()`, bincount, nonzero or
    data-dependent shape raises: the op's sizes follow from the input shapes alone, so a
    CUDA graph can capture it."""
    ids = torch.randint(0, 24, (17, 4), device="meta")
    sorted_ids, expert_of_block, num_padded = align_by_expert(ids, 8, 8, 16)
    P = padded_slots(68, 8, 16)
    assert (sorted_ids.shape, expert_of_block.shape, num_padded.shape) == ((P,), (P // 16,), ())


# ---- the kernels -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}k{}E{}".format(*c))
def test_fused_moe_matches_reference(case, dtype):
    x, weights, ids = problem(case, dtype, seed=case[0])
    n_local = case[2]
    w13, w2 = dense_experts(n_local, dtype, torch.Generator().manual_seed(1))
    if dtype != torch.float16:  # routing weights in x.dtype (as MoE passes them) or float32
        weights = weights.to(dtype)
    got = fused_moe_triton(x, weights, ids, w13, w2, n_local, block_m=BLOCK_M)
    want = fused_moe_reference(x, weights, ids, w13, w2, n_local)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    layer = grouped_experts(x, weights.to(dtype), ids, w13, w2, n_local)
    torch.testing.assert_close(want, layer, **CONTRACT_TOL[dtype])
    if case[0] == 3:  # token 1 picked only other ranks' experts
        assert got[1].eq(0).all()


def test_the_swiglu_limit_clamps_as_deepseek_v4s_experts_do():
    """DeepSeek-V4's experts clamp gate at most L and up to [-L, L] before the silu
    (models/deepseek_v4.py `Expert`); at L = 0.5 most of these activations are clamped, so
    the kernel, the reference and V4's own expert modules must agree on it."""
    from xllm_py.models.deepseek_v4 import Expert

    case, limit = (17, 4, 8), 0.5
    x, weights, ids = problem(case, torch.float32, seed=5)
    n_local = case[2]
    w13, w2 = dense_experts(n_local, torch.float32, torch.Generator().manual_seed(3))
    got = fused_moe_triton(x, weights, ids, w13, w2, n_local, block_m=BLOCK_M,
                           swiglu_limit=limit)  # fmt: skip
    want = fused_moe_reference(x, weights, ids, w13, w2, n_local, swiglu_limit=limit)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    unclamped = fused_moe_reference(x, weights, ids, w13, w2, n_local)
    assert (unclamped - want).abs().max() > 0.1  # the clamp acts here
    modules = []
    with torch.no_grad():
        for e in range(n_local):
            m = Expert(HIDDEN, INTER, limit)
            m.w1.weight.copy_(w13[e, :INTER]), m.w3.weight.copy_(w13[e, INTER:])
            m.w2.weight.copy_(w2[e])
            modules.append(m)
        loop = torch.zeros_like(x)
        for t in range(case[0]):
            for j, g in enumerate(ids[t].tolist()):
                if n_local <= g < 2 * n_local:
                    loop[t] += weights[t, j] * modules[g - n_local](x[t : t + 1])[0]
    torch.testing.assert_close(want, loop, **CONTRACT_TOL[torch.float32])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}k{}E{}".format(*c))
def test_fused_moe_fp8_with_partial_edge_blocks_matches_reference(case):
    """hidden 160 and I 96: the last column block of w13 and of w2, the last row block of
    w2 and both row blocks of w13's gate and up parts are partial."""
    x, weights, ids = problem(case, torch.bfloat16, seed=case[0] + 7)
    n_local = case[2]
    w13, w2 = fp8_experts(n_local, torch.Generator().manual_seed(2))
    assert w13.scale.shape[1:] == (2, 2) and w2.scale.shape[1:] == (2, 1)
    got = fused_moe_triton(x, weights, ids, w13, w2, n_local, block_m=BLOCK_M)
    want = fused_moe_reference(x, weights, ids, w13, w2, n_local)
    torch.testing.assert_close(got, want, **TOL["fp8"])
    layer = grouped_experts(x, weights.to(x.dtype), ids, w13, w2, n_local).float()
    assert (want.float() - layer).norm() <= FP8_CONTRACT_REL * layer.norm()


def test_fused_moe_no_tokens_and_bad_shapes():
    w13, w2 = dense_experts(4, torch.float32, torch.Generator().manual_seed(0))
    x, ids = torch.zeros(0, HIDDEN), torch.zeros(0, 2, dtype=torch.long)
    out = fused_moe_triton(x, torch.zeros(0, 2), ids, w13, w2, 0)
    assert out.shape == (0, HIDDEN)
    with pytest.raises(ValueError, match="w13 .* w2 .*need x"):
        fused_moe_triton(torch.zeros(2, HIDDEN + 1), torch.zeros(2, 2), ids[:0], w13, w2, 0)


def _fresh_module(monkeypatch, name: str):
    """A second copy of xllm_py.ops.fused_moe, imported under the current environment."""
    spec = importlib.util.spec_from_file_location(name, fused_moe.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_fused_moe_launch_is_refused_naming_the_fix(monkeypatch):
    x, weights, ids = problem(CASES[0], torch.float32, seed=0)
    w13, w2 = dense_experts(CASES[0][2], torch.float32, torch.Generator().manual_seed(0))
    args = (x, weights, ids, w13, w2, CASES[0][2])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled = _fresh_module(monkeypatch, "fused_moe_compiled")
    with pytest.raises(RuntimeError, match="CPU tensors.*set TRITON_INTERPRET=1"):
        compiled.fused_moe_triton(*args)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    missing = _fresh_module(monkeypatch, "fused_moe_no_triton")
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        missing.fused_moe_triton(*args)
    torch.testing.assert_close(missing.fused_moe_reference(*args), fused_moe_reference(*args))


# ---- DeepSeek-V3 shapes on a GPU -----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("T", [1, 64, 512])
def test_fused_moe_on_cuda_at_deepseek_v3_shapes(T, fp8):
    """One rank of 8-way expert parallelism: 32 of 256 experts, hidden 7168, I 2048, top 8;
    the launch makes no host sync (CUDA's sync debug mode raises on one)."""
    n_local, top_k, hidden, inter, dev = 32, 8, 7168, 2048, "cuda"
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(256, generator=g)[:top_k] for _ in range(T)]).to(dev)
    x = torch.randn(T, hidden, generator=g).to(dev, torch.bfloat16)
    weights = (torch.rand(T, top_k, generator=g) * 2).to(dev)
    first = 32  # rank 1
    if fp8:
        w13 = Fp8Weight.stack([fp8_on_device(2 * inter, hidden, dev) for _ in range(n_local)])
        w2 = Fp8Weight.stack([fp8_on_device(hidden, inter, dev) for _ in range(n_local)])
    else:
        gd = torch.Generator(dev).manual_seed(T)
        w13 = torch.randn(n_local, 2 * inter, hidden, generator=gd, device=dev) / hidden**0.5
        w2 = torch.randn(n_local, hidden, inter, generator=gd, device=dev) / inter**0.5
        w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    fused_moe_triton(x, weights, ids, w13, w2, first)  # compile first: compiling syncs
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = fused_moe_triton(x, weights, ids, w13, w2, first)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = fused_moe_reference(x, weights, ids, w13, w2, first)
    torch.testing.assert_close(got, want, **TOL["cuda fp8" if fp8 else "cuda"])


def fp8_on_device(rows: int, cols: int, dev: str) -> Fp8Weight:
    """`fp8_matrix` for dims that are whole blocks, quantised on the device (fast)."""
    w = torch.randn(rows, cols, device=dev) / cols**0.5
    blocks = w.view(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).view(rows, cols).to(torch.float8_e4m3fn)
    rows_i, cols_i = block_index(rows, BLOCK[0]), block_index(cols, BLOCK[1])
    return Fp8Weight(q, scale, rows_i.to(dev), cols_i.to(dev), BLOCK)
