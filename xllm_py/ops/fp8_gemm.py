"""Block-FP8 GEMM: y = x @ W^T for an FP8-resident weight, as DeepSeek-V3's recipe runs it.

Contract:

    x        [..., K]  bfloat16 / float16 / float32
    w        Fp8Weight [N, K]: float8 e4m3 `data`, float32 `scale [R, C]`, and the scale
             block of each row and column (`rows [N]`, `cols [K]`; weights/fp8.py), so
             W[n, k] = data[n, k] * scale[rows[n], cols[k]]. Blocks are B0 x B1 (128 x 128
             in DeepSeek-V3); edges that are not a multiple of the block are partial blocks.
    -> y     [..., N]  in x.dtype

Activations are quantised per token and group of B1 columns (1 x 128), `per_token_group_quant`:

    x[m, g*B1 : (g+1)*B1]  ->  x_fp8 (e4m3) * x_scale[m, g],  x_scale = amax / 448

The last group of a row is partial when K is not a multiple of B1. Since the activation
groups and the weight's column blocks line up (`w.cols_aligned`: column k is in block
k // B1), every K tile of BLOCK_K | B1 columns has one scale per row of x and one per row
of W, so the kernel multiplies FP8 tiles and applies the scales to the fp32 product:

    y[m, n] = sum_g  (x_fp8[m, G_g] . data[n, G_g]) * x_scale[m, g] * scale[rows[n], g]

`rows` is a gather, not `n // B0`: a fused matrix (q|kv, gate|up) whose parts end inside a
block keeps each part's own scale rows (Fp8Weight.cat), and the kernel reads them as such.

Implementations:
    fp8_gemm_reference  the same math in torch (x quantised by `per_token_group_quant`,
                        both sides dequantised, fp32 matmul): the tests' oracle
    fp8_gemm_triton     the Triton kernel; on a GPU `tl.dot` multiplies the e4m3 tiles
                        natively (Hopper's FP8 MMA) with fp32 accumulation

Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) in Triton 3.9 loads and dots
float8_e4m3fn tensors as they are (it widens 8-bit floats to float16 for the dot, which is
exact for e4m3), so the kernel takes the float8 tensors themselves, no uint8 views. Its
fp32 -> e4m3 cast does not round as a GPU's does, but no kernel here casts to e4m3
(activations are quantised in torch). It cannot dot bfloat16: it stores bf16 as uint16
and multiplies the bit patterns (triton-lang/triton#11584; its other bf16 arithmetic is
on bit patterns too), and its fp32 -> bf16 cast truncates where a GPU, like torch, rounds
to nearest even. So the kernels convert loaded bf16 before any arithmetic; the float
(non-FP8) kernels of fused_moe.py take the dtype the dot runs in as a constexpr
(`dot_dtype`: the operands' own on a GPU, float32 for bf16 under the interpreter); and
under the interpreter bf16 results are written as float32 and rounded by torch
(`store_dtype`). The kernel source is the same either way; only those launch arguments
differ.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from xllm_py.ops.launch import check_launch, interpreted
from xllm_py.weights.fp8 import FP8, Fp8Weight, block_index, quantize

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch references need no Triton; the launchers say so
    triton = None

FP8_MAX = torch.finfo(FP8).max  # 448: e4m3's largest finite value
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---- activation quantisation (torch; also the reference) ---------------------------------------


def per_token_group_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_fp8 [..., K] float8_e4m3fn, scales [..., ceil(K / group)] float32),
    x ~= x_fp8 * scales (each scale repeated over its group's columns).

    scale = amax / 448 per group, so the group's largest value maps to e4m3's largest; an
    all-zero group gets scale 1 (any scale would do; 1 keeps it finite). The last group of
    a row is partial when K is not a multiple of `group`: it is padded with zeros for the
    amax, which does not change it."""
    K = x.shape[-1]
    groups = -(-K // group)
    xf = F.pad(x.float(), (0, groups * group - K)).unflatten(-1, (groups, group))
    amax = xf.abs().amax(dim=-1)  # [..., G]
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[..., :K]
    return q.to(FP8).contiguous(), scale


def dequant_groups(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    """float32 values of `per_token_group_quant`'s output."""
    return q.float() * scale.repeat_interleave(group, dim=-1)[..., : q.shape[-1]]


def fp8_gemm_reference(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """The kernel's math in torch: x quantised 1 x B1 exactly as the kernel's caller
    quantises it, both sides dequantised, one fp32 matmul, rounded once to x.dtype."""
    group = w.block[1]
    xq, xs = per_token_group_quant(x, group)
    y = dequant_groups(xq, xs, group) @ w.dequant(torch.float32).T
    return y.to(x.dtype)


# ---- launch checks, shared with fused_moe.py ---------------------------------------------------


def dot_dtype(dtype: torch.dtype, kernel):
    """The Triton dtype a float (non-FP8) kernel multiplies `dtype` tiles in: the operands'
    own on a GPU; float32 for bfloat16 under the interpreter, which cannot dot bf16."""
    if dtype == torch.bfloat16 and interpreted(kernel):
        return tl.float32
    triton_dtypes = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    return triton_dtypes.get(dtype, tl.float32)


def store_dtype(dtype: torch.dtype, kernel) -> torch.dtype:
    """The dtype a kernel writes `dtype` results in: `dtype` itself on a GPU (which rounds
    fp32 to bf16 to nearest even, as torch does); float32 for bf16 under the interpreter,
    whose fp32 -> bf16 cast truncates, so that torch rounds them after (caller's job)."""
    return torch.float32 if dtype == torch.bfloat16 and interpreted(kernel) else dtype


def block_k_for(group: int) -> int:
    """The K tile: 128 or a power of two >= 16 that divides the scale group, so that each
    tile lies in one group (one scale per row on either side)."""
    for bk in (128, 64, 32, 16):
        if group % bk == 0:
            return bk
    raise ValueError(
        f"FP8 block width {group} has no power-of-two divisor >= 16; the Triton FP8 kernels "
        "need one (DeepSeek-V3's is 128)"
    )


def check_fp8_weight(w: Fp8Weight, what: str) -> None:
    if not w.cols_aligned:
        raise ValueError(
            f"{what}: the FP8 weight's columns do not start on a scale-block edge (a slice "
            "cut inside a block); the activation groups could not line up with its blocks"
        )


# ---- the kernel ---------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _fp8_gemm_kernel(
        x_ptr,  # [M, K] float8 e4m3
        xs_ptr,  # [M, ceil(K / GROUP_K)] float32
        w_ptr,  # [N, K] float8 e4m3
        ws_ptr,  # [R, C] float32
        rows_ptr,  # [N] int32: scale row of each weight row
        y_ptr,  # [M, N]
        M,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_xsm,
        stride_xsg,
        stride_wn,
        stride_wk,
        stride_wsr,
        stride_wsc,
        stride_ym,
        stride_yn,
        GROUP_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        scale_row = tl.load(rows_ptr + rn, mask=n_ok, other=0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            a = tl.load(
                x_ptr + rm[:, None] * stride_xm + k[None, :] * stride_xk,
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_ptr + rn[:, None] * stride_wn + k[None, :] * stride_wk,
                mask=n_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            g = k0 // GROUP_K  # BLOCK_K divides GROUP_K: the whole tile is in group g
            a_scale = tl.load(xs_ptr + rm * stride_xsm + g * stride_xsg, mask=m_ok, other=0.0)
            b_scale = tl.load(
                ws_ptr + scale_row * stride_wsr + g * stride_wsc, mask=n_ok, other=0.0
            )
            acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale[None, :]
        tl.store(
            y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn,
            acc.to(y_ptr.dtype.element_ty),
            mask=m_ok[:, None] & n_ok[None, :],
        )


def fp8_gemm_triton(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """The contract above as one Triton kernel (x quantised in torch first)."""
    check_launch(_fp8_gemm_kernel if triton else None, x.device, "fp8_gemm_triton")
    check_fp8_weight(w, "fp8_gemm_triton")
    if w.data.dim() != 2 or x.shape[-1] != w.shape[1] or x.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"fp8_gemm_triton: x {tuple(x.shape)} {x.dtype} @ W^T {tuple(w.shape)}: need x "
            "[..., K] in bf16/fp16/fp32 and one [N, K] weight"
        )
    N, K = w.shape
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*x.shape[:-1], N)
    y = torch.empty(M, N, dtype=store_dtype(x.dtype, _fp8_gemm_kernel), device=x.device)
    group = w.block[1]
    xq, xs = per_token_group_quant(x2, group)
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_n, block_k = 128, block_k_for(group)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _fp8_gemm_kernel[grid](
        xq, xs, w.data, w.scale, w.rows, y,
        M, N, K,
        *xq.stride(), *xs.stride(), *w.data.stride(), *w.scale.stride(), *y.stride(),
        GROUP_K=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return y.to(x.dtype).view(*x.shape[:-1], N)


# ---- the seam the dense linears call (models/layers/linear.py) ----------------------------


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [..., in] @ W^T for an FP8-resident W [out, in]: the first block-scaled FP8 GEMM
    that `fp8_gemm_available` found on x's device and that takes W's shape (x quantised per
    token and group of B1 columns, as DeepSeek-V3's recipe does), else the reference: W
    dequantised for this call."""
    for gemm in _GEMM.get(str(x.device)) or ():
        if _takes(gemm, w):
            return gemm(x, w)
    return torch.nn.functional.linear(x, w.dequant(x.dtype))


def _takes(gemm: Callable, w: Fp8Weight) -> bool:
    """Whether `gemm` multiplies by W's shape. cuBLAS's block-scaled GEMM (torch._scaled_mm)
    wants whole blocks both ways, and refuses (CUBLAS_STATUS_NOT_SUPPORTED, seen on an H200)
    an N that is not a multiple of the block, such as DeepSeek-V3's fused q_a|kv_a of
    1536 + 576 rows. The Triton kernel maps each row to its scale block, so only the
    columns must be whole blocks."""
    if gemm is _scaled_gemm:
        n, k = w.data.shape[-2:]
        return w.aligned and n % w.block[0] == 0 and k % w.block[1] == 0
    return w.cols_aligned


# Per device: the block-scaled FP8 GEMMs that passed the probe there, best first (probed
# once; empty: none).
_GEMM: dict[str, list[Callable[[torch.Tensor, Fp8Weight], torch.Tensor]]] = {}


def fp8_gemm_available(device: torch.device) -> bool:
    """Whether `device` runs a block-scaled FP8 GEMM (probed once per device against the
    reference; logged): the Triton kernel above where Triton runs, and torch._scaled_mm's
    where it takes block scales. CPU: no (the reference is for tests there)."""
    key = str(device)
    if key not in _GEMM:
        _GEMM[key] = _probe(device) if device.type == "cuda" else []
    return bool(_GEMM[key])


def _candidates() -> list[tuple[str, Callable]]:
    """Best first. The Triton kernel leads: on an H200 (torch 2.11, CUDA 13) cuBLAS's
    block-scaled GEMM passed the probe, then refused DeepSeek-V3-shaped weights whose N and
    K are whole blocks (CUBLAS_STATUS_NOT_SUPPORTED at the first decode step)."""
    found = [("the Triton block-FP8 GEMM", fp8_gemm_triton)] if triton else []
    return found + [("torch._scaled_mm", _scaled_gemm)]


def _probe(device: torch.device) -> list[Callable]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) / 16
    q, s = quantize(w, (128, 128))
    weight = Fp8Weight(q, s, block_index(256, 128), block_index(512, 128), (128, 128)).to(device)
    x = torch.randn(16, 512, generator=g).to(device, torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), weight.dequant(torch.float32))
    passed = []
    for name, gemm in _candidates():
        try:
            got = gemm(x, weight).float()
        except (RuntimeError, TypeError, ValueError) as e:
            logger.info("FP8: %s does not run on %s (%s)", name, device, e)
            continue
        err = ((got - want).norm() / want.norm()).item()
        ok = err < 0.05  # activation quantisation to e4m3 costs about 2-3% relative error
        logger.info("FP8: %s on %s %s (relative error %.3g)",
                    name, device, "in use" if ok else "REJECTED", err)  # fmt: skip
        if ok:
            passed.append(gemm)
    if not passed:
        logger.info("FP8: no block-scaled FP8 GEMM on %s; weights are dequantised", device)
    return passed


def _scaled_gemm(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """torch._scaled_mm with 1 x B1 activation scales and B0 x B1 weight scales."""
    b1 = w.block[1]
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    k = x2.shape[1]
    pad = -k % b1
    xp = torch.nn.functional.pad(x2.float(), (0, pad)).view(x2.shape[0], -1, b1)
    amax = xp.abs().amax(dim=-1).clamp(min=1e-12)  # [M, K / B1]
    sx = amax / torch.finfo(FP8).max
    xq = (xp / sx.unsqueeze(-1)).view(x2.shape[0], -1)[:, :k].to(FP8)
    y = torch._scaled_mm(
        xq,
        w.data.t(),
        scale_a=sx.t().contiguous().t(),  # outer-dim-major, as the kernel wants
        scale_b=w.scale.t(),
        out_dtype=x.dtype if x.dtype != torch.float32 else torch.bfloat16,
    )
    return y.to(x.dtype).view(*shape[:-1], w.data.shape[0])
