"""Rotary embedding of MLA's rope slice as one Triton kernel.

Contract (as `apply_rope` in models/layers/rope.py, the torch path and the tests' oracle):

    x      [T, H, D]  any float dtype, any strides; D = qk_rope_head_dim, even
    table  [T, 1, D / 2] complex64  scale * (cos + i sin) of each token's position
           (`RotaryEmbedding.forward` in eager code), or the same as real pairs
           [T, 1, D / 2, 2] (cos, sin) (under torch.compile)
    -> out [T, H, D]  in x.dtype, a new contiguous tensor

DeepSeek-V3 rotates interleaved pairs: pair p of a head is (x[2p], x[2p + 1]), rotated by
the angle of table[t, p], in float32:

    out[2p]     = x[2p] cos - x[2p + 1] sin
    out[2p + 1] = x[2p] sin + x[2p + 1] cos

(the complex product (x[2p] + i x[2p + 1]) * table[t, p], written out). The YaRN scale is
in the table's magnitude, so the kernel needs nothing but the table.

Grid: (token, group of heads); a program rotates all pairs of BLOCK_H heads of one token,
reading that token's table row once.
"""

from __future__ import annotations

import torch

from xllm_py.ops.launch import check_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path needs no Triton
    triton = None

# Pairs one program rotates: every head of DeepSeek-V3's [T, 128 + 1, 64] per token in
# two programs; a whole token of the tiny test models in one.
PAIRS_PER_PROGRAM = 4096


if triton is not None:

    @triton.jit
    def _rope_kernel(
        x_ptr,
        table_ptr,
        out_ptr,
        H,
        P,
        stride_xt,
        stride_xh,
        stride_xd,
        stride_tt,
        stride_tp,
        BLOCK_H: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        pairs = tl.arange(0, BLOCK_P)
        mask = (heads[:, None] < H) & (pairs[None, :] < P)
        row = table_ptr + t * stride_tt + pairs * stride_tp  # (cos, sin) adjacent
        cos = tl.load(row, mask=pairs < P, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(row + 1, mask=pairs < P, other=0.0).to(tl.float32)[None, :]
        x0_ptr = x_ptr + t * stride_xt + heads[:, None] * stride_xh + 2 * pairs[None, :] * stride_xd
        x0 = tl.load(x0_ptr, mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(x0_ptr + stride_xd, mask=mask, other=0.0).to(tl.float32)
        out0_ptr = out_ptr + (t * H + heads[:, None]) * (2 * P) + 2 * pairs[None, :]
        dtype = out_ptr.dtype.element_ty
        tl.store(out0_ptr, (x0 * cos - x1 * sin).to(dtype), mask=mask)
        tl.store(out0_ptr + 1, (x0 * sin + x1 * cos).to(dtype), mask=mask)


def apply_rope_triton(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`apply_rope(x, table)` as one Triton kernel (the contract above)."""
    check_launch(_rope_kernel if triton else None, x.device, "apply_rope_triton")
    T, H, D = x.shape
    P = D // 2
    pairs = torch.view_as_real(table) if table.is_complex() else table
    pairs = pairs.reshape(T, P, 2)  # a view of the [T, 1, P, 2] table
    if pairs.stride(-1) != 1:
        pairs = pairs.contiguous()
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    block_p = triton.next_power_of_2(P)
    block_h = max(1, min(PAIRS_PER_PROGRAM // block_p, triton.next_power_of_2(H)))
    _rope_kernel[(T, triton.cdiv(H, block_h))](
        x,
        pairs,
        out,
        H,
        P,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        pairs.stride(0),
        pairs.stride(1),
        BLOCK_H=block_h,
        BLOCK_P=block_p,
    )
    return out
