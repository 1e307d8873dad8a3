"""The Triton kernels that take a float argument build for a Hopper GPU, on this machine.

Triton's interpreter (the CPU tests) runs a kernel without the compiler's type checks. On
an H200, graph mode failed to build the paged-MLA kernel: Inductor passes a Python float
to a kernel as fp64 where Triton's own launcher passes fp32, and the fp64 scale turned
the scores and the loop-carried row maxima into fp64. These lower each such kernel to
Triton IR for sm_90 (tests/triton_lowering.py) with the float as fp32 and as fp64, and
check that it builds and that no tile is computed in fp64 either way."""

from __future__ import annotations

import re

import pytest

from tests.triton_lowering import lower_in_subprocess

FP64_TILE = re.compile(r"tensor<[0-9x]*xf64>")


def paged_mla(dtype: str, splits: int, float_type: str):
    types = {n: f"*{dtype}" for n in ("q_ptr", "cache_ptr", "out_ptr")}
    types |= {n: "*fp32" for n in ("mid_o_ptr", "mid_lse_ptr")}
    types |= {n: "*i32" for n in ("table_ptr", "ctx_ptr", "qlen_ptr", "win_ptr")}
    constexprs = dict(
        HG=16, BLOCK_HG=16, BLOCK_M=16, BLOCK_N=64, BLOCK_R=512, BLOCK_P=64,
        NUM_SPLITS=splits, HAS_WINDOW=False,
        PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST=False,
    )  # fmt: skip
    return (
        "xllm_py.ops.paged_mla",
        "_split_kernel",
        types | {"scale_log2": float_type},
        constexprs,
    )


def rms_norm(add_residual: bool, float_type: str):
    types = {n: "*bf16" for n in ("x_ptr", "res_ptr", "scale_ptr", "out_ptr", "res_out_ptr")}
    constexprs = dict(ADD_RESIDUAL=add_residual, BLOCK_T=2, BLOCK_D=1024)
    return ("xllm_py.ops.rms_norm", "_rms_norm_kernel", types | {"eps_d": float_type}, constexprs)


CASES = {
    f"paged_mla-{dtype}-splits{s}-{f}": paged_mla(dtype, s, f)
    for dtype in ("fp32", "bf16")
    for s in (1, 4)
    for f in ("fp32", "fp64")
} | {f"rms_norm-add{a}-{f}": rms_norm(a, f) for a in (False, True) for f in ("fp32", "fp64")}


@pytest.fixture(scope="module")
def lowered():
    pytest.importorskip("triton")
    return lower_in_subprocess(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_builds_for_hopper_with_its_float_as_fp32_or_fp64(lowered, case):
    ir = lowered[case]
    assert not ir.startswith("CompilationError"), ir
    assert not FP64_TILE.search(ir), f"{case}: tiles computed in fp64"
