"""The block-FP8 GEMM kernel (xllm_py/ops/fp8_gemm.py) against its torch reference, run by
Triton's interpreter on CPU (conftest.py sets TRITON_INTERPRET=1 without a GPU), on
shapes whose N and K end in partial 128-blocks; and the 1 x 128 activation quantisation
both share, checked exactly.

Kernel and reference quantise x identically and multiply the same e4m3 values, so they
differ only by fp32 summation order and the final rounding: the tolerances below. The
reference is tied to the linear layer's contract by a relative bound against the weight
dequantised and x unquantised (weights/fp8.py's reference path)."""

from __future__ import annotations

import functools
import importlib.util
import sys

import pytest
import torch

from xllm_py.ops import fp8_gemm
from xllm_py.ops.fp8_gemm import (
    dequant_groups,
    fp8_gemm_reference,
    fp8_gemm_triton,
    per_token_group_quant,
)
from xllm_py.weights.fp8 import Fp8Weight, block_index, quantize

# Kernel vs reference, by x's dtype (the output's): an ulp or two of it.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
# Reference vs x @ dequant(W)^T: e4m3 activations (3 mantissa bits) cost ~2-3% of the norm.
CONTRACT_REL = 0.05
BLOCK = (128, 128)
E4M3_MAX = 448.0
# (N, K): partial last row block and column block (K = 96 is one partial group).
SHAPES = [(160, 96), (200, 320)]


def fp8_weight(n: int, k: int, g: torch.Generator) -> Fp8Weight:
    q, scale = quantize(torch.randn(n, k, generator=g) / k**0.5, BLOCK)
    return Fp8Weight(q, scale, block_index(n, BLOCK[0]), block_index(k, BLOCK[1]), BLOCK)


# ---- per_token_group_quant -----------------------------------------------------------------------


def test_per_token_group_quant_scales_each_group_by_its_amax():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=g) * torch.logspace(-3, 2, 5).unsqueeze(1)
    x[2, 128:256] = 0  # an all-zero group
    x[3, 256:] *= 1e-6  # a tiny partial last group (44 columns)
    q, scale = per_token_group_quant(x.bfloat16(), 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 300) and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (5, 3)
    xb = x.bfloat16().float()
    for m in range(5):
        for gi, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 300))):
            amax = xb[m, cols].abs().max().item()
            if amax == 0:  # guarded: finite scale, zeros
                assert scale[m, gi].item() == 1.0 and q[m, cols].float().eq(0).all()
                continue
            assert scale[m, gi].item() == pytest.approx(amax / E4M3_MAX, rel=1e-6)
            assert q[m, cols].float().abs().max().item() == E4M3_MAX  # the amax maps to 448
    # Rounding error: half an e4m3 step (3 mantissa bits) of the value, or of the smallest
    # subnormal (2^-9 of the scale) where the value is below e4m3's normal range.
    err = (dequant_groups(q, scale, 128) - xb).abs()
    floor = scale.repeat_interleave(128, dim=1)[:, :300] * 2.0**-10
    assert (err <= torch.maximum(xb.abs() * 2.0**-4, floor) * (1 + 1e-6)).all()


def test_per_token_group_quant_keeps_leading_dims_and_group_size():
    x = torch.randn(2, 3, 70)
    q, scale = per_token_group_quant(x, 32)
    assert q.shape == (2, 3, 70) and scale.shape == (2, 3, 3)
    q2, scale2 = per_token_group_quant(x.view(6, 70), 32)
    assert torch.equal(q.view(6, 70).view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(scale.view(6, 3), scale2)


# ---- the kernel ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}K{}".format(*s))
@pytest.mark.parametrize("M", [1, 5, 33])
def test_fp8_gemm_with_partial_edge_blocks_matches_reference(M, shape, dtype):
    N, K = shape
    g = torch.Generator().manual_seed(M * 1000 + N)
    w = fp8_weight(N, K, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    got = fp8_gemm_triton(x, w)
    want = fp8_gemm_reference(x, w)
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(got, want, **TOL[dtype])
    dense = x.float() @ w.dequant(torch.float32).T
    assert (want.float() - dense).norm() <= CONTRACT_REL * dense.norm()


def test_fp8_gemm_reads_each_rows_scale_block_of_a_fused_weight():
    """q|kv-like: two parts of 96 and 64 rows fused, each keeping its own partial scale
    block, so rows 96..159 use scale row 1 although they sit in block 0 of 128."""
    g = torch.Generator().manual_seed(3)
    w = Fp8Weight.cat([fp8_weight(96, 200, g), fp8_weight(64, 200, g)])
    assert not w.aligned and w.rows.tolist() == [0] * 96 + [1] * 64
    x = torch.randn(2, 3, 200, generator=g).bfloat16()  # leading dims are kept
    got = fp8_gemm_triton(x, w)
    assert got.shape == (2, 3, 160)
    torch.testing.assert_close(got, fp8_gemm_reference(x, w), **TOL[torch.bfloat16])


def test_fp8_gemm_of_no_rows():
    w = fp8_weight(32, 64, torch.Generator().manual_seed(0))
    assert fp8_gemm_triton(torch.zeros(0, 64), w).shape == (0, 32)


def test_fp8_gemm_refuses_columns_cut_inside_a_block():
    g = torch.Generator().manual_seed(0)
    full = fp8_weight(64, 256, g)  # a tensor-parallel slice of its columns 64..191:
    part = Fp8Weight(
        full.data[:, 64:192], full.scale, full.rows, block_index(128, 128, offset=64), BLOCK
    )
    with pytest.raises(ValueError, match="columns do not start on a scale-block edge"):
        fp8_gemm_triton(torch.randn(1, 128), part)


def _fresh_module(monkeypatch, name: str):
    """A second copy of xllm_py.ops.fp8_gemm, imported under the current environment."""
    spec = importlib.util.spec_from_file_location(name, fp8_gemm.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_fp8_gemm_launch_is_refused_naming_the_fix(monkeypatch):
    w, x = fp8_weight(32, 64, torch.Generator().manual_seed(0)), torch.randn(2, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled = _fresh_module(monkeypatch, "fp8_gemm_compiled")
    with pytest.raises(RuntimeError, match="CPU tensors.*set TRITON_INTERPRET=1"):
        compiled.fp8_gemm_triton(x, w)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    missing = _fresh_module(monkeypatch, "fp8_gemm_no_triton")
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        missing.fp8_gemm_triton(x, w)
    torch.testing.assert_close(missing.fp8_gemm_reference(x, w), fp8_gemm_reference(x, w))


# ---- DeepSeek-V3 shapes on a GPU -----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("M", [1, 64, 512])
@pytest.mark.parametrize(
    "shape",
    [(576, 7168), (7168, 2048), (4096, 7168)],  # kv_a_proj (partial row block), o_proj, gate|up
    ids=lambda s: "N{}K{}".format(*s),
)
def test_fp8_gemm_on_cuda_at_deepseek_v3_shapes(M, shape):
    w = cuda_weight(*shape)
    x = torch.randn(M, shape[1], generator=torch.Generator().manual_seed(M))
    x = x.to("cuda", torch.bfloat16)
    got = fp8_gemm_triton(x, w)
    torch.testing.assert_close(got, fp8_gemm_reference(x, w), **TOL[torch.bfloat16])


@functools.cache
def cuda_weight(n: int, k: int) -> Fp8Weight:
    return fp8_weight(n, k, torch.Generator().manual_seed(n + k)).to("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("M", [1, 64])
def test_fp8_linear_on_cuda_takes_the_fused_q_a_kv_a_weight(M):
    """The seam the engine calls, at the one DeepSeek-V3 shape cuBLAS's block-scaled GEMM
    refused on an H200 (N = 1536 + 576, not a multiple of 128): it must still multiply."""
    g = torch.Generator().manual_seed(M)
    parts = [fp8_weight(1536, 2048, g), fp8_weight(576, 2048, g)]
    w = Fp8Weight.cat(parts).to("cuda")
    assert fp8_gemm.fp8_gemm_available(torch.device("cuda"))
    x = torch.randn(M, 2048, generator=g).to("cuda", torch.bfloat16)
    got = fp8_gemm.fp8_linear(x, w).float()
    want = torch.nn.functional.linear(x.float(), w.dequant(torch.float32))
    assert ((got - want).norm() / want.norm()).item() < CONTRACT_REL


def test_only_whole_block_shapes_go_to_cublas():
    """torch._scaled_mm is given a weight only when N and K are whole blocks; the Triton
    kernel takes any N (each row finds its scale block) with whole column blocks."""
    g = torch.Generator().manual_seed(0)
    whole = fp8_weight(256, 512, g)
    fused = Fp8Weight.cat([fp8_weight(1536, 256, g), fp8_weight(576, 256, g)])
    ragged_k = fp8_weight(256, 320, g)
    takes = fp8_gemm._takes
    assert takes(fp8_gemm._scaled_gemm, whole) and takes(fp8_gemm_triton, whole)
    assert fused.aligned and not takes(fp8_gemm._scaled_gemm, fused)
    assert takes(fp8_gemm_triton, fused)
    assert not takes(fp8_gemm._scaled_gemm, ragged_k)
