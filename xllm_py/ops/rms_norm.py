"""RMSNorm, alone and fused with the residual add before it (DeepSeek-V3's decoder norms).

Contract (every implementation):

    x         [..., d]   any float dtype (bf16, fp16, fp32); the last dim unit-stride or not
    residual  [..., d]   same shape and dtype as x (fused form only)
    scale     [d]        float32: the norm weight times sqrt(d) (`RMSNorm.scale`)
    eps_d     float      eps * d
    ->  rms_norm      y = h * rsqrt(sum(h^2) + eps_d) * scale, h = x in float32, y cast to x.dtype
        add_rms_norm  (y, h) with h = residual + x rounded to x.dtype (exactly the add the
                      model did before: h = h + delta), y = rms_norm(h)

    rsqrt(sum(h^2) + eps * d) * (w * sqrt(d))  =  rsqrt(mean(h^2) + eps) * w

so the folded form is DeepSeek's and HF's norm to float32 rounding (models/layers/norm.py).
The residual sum is rounded to the run dtype *before* it is normalised, as in the unfused
model: the fused kernel writes exactly the residual the torch path computes, and its
normed output differs from the torch path's by float32 rounding only. (Triton's CPU
interpreter converts float32 to bfloat16 by truncation, not to nearest: there, bf16
results may differ from torch's by one more ulp; a GPU rounds as torch does.)

Implementations:
    rms_norm_reference, add_rms_norm_reference  the torch path (RMSNorm's with
                             --attention_backend=torch) and the tests' oracle
    rms_norm_triton, add_rms_norm_triton        one pass over a few rows per program:
                             load (x, residual), add, store the residual, reduce, scale,
                             store; fp32 math, a masked block for any d
"""

from __future__ import annotations

import torch

from xllm_py.ops.launch import check_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path needs no Triton
    triton = None

# Elements of x one program normalises: a single row at DeepSeek-V3's hidden size (7168,
# padded to 8192), several rows of the narrower latent norms (kv_lora_rank 512) and of
# the tiny test models, so that few-token steps are not one program per short row.
ELEMENTS_PER_PROGRAM = 4096


def rms_norm_reference(x: torch.Tensor, scale: torch.Tensor, eps_d: float) -> torch.Tensor:
    # vector_norm gives sqrt(sum(x^2)) in one kernel: five small kernels in all, where at
    # decode sizes the count, not the arithmetic, is the cost (models/layers/norm.py).
    xf = x if x.dtype == torch.float32 else x.float()
    inv = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().add_(eps_d).rsqrt_()
    y = xf * inv * scale
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, eps_d: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the new residual in x.dtype."""
    h = residual + x
    return rms_norm_reference(h, scale, eps_d), h


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        scale_ptr,
        out_ptr,
        res_out_ptr,
        n_rows,
        d,
        stride_x,
        stride_res,
        stride_out,
        eps_d,
        ADD_RESIDUAL: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # int64 row offsets: a long prefill x 7168 passes 2^31 elements.
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < d)
        h = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        h = h.to(tl.float32)
        if ADD_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
            # Rounded to the run dtype first, as the unfused `h = h + delta` is; the norm
            # then reads the rounded residual, exactly what the next add will see.
            h = (h + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + rows[:, None] * stride_out + cols[None, :], h, mask=mask)
            h = h.to(tl.float32)
        # eps in fp32 also where Inductor passes the float as fp64 (the sum stays fp32)
        inv = tl.rsqrt(tl.sum(h * h, axis=1) + tl.cast(eps_d, tl.float32))  # masked columns add 0
        scale = tl.load(scale_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
        y = h * inv[:, None] * scale[None, :]
        out = out_ptr + rows[:, None] * stride_out + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, d] with unit stride along d (a view when t allows one)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, residual, scale, eps_d) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = out if residual is None else torch.empty_like(out)
    n = x2.shape[0]
    if n == 0:
        return out, res_out
    res2 = x2 if residual is None else _rows(residual)
    block_d = triton.next_power_of_2(d)
    block_t = max(1, min(ELEMENTS_PER_PROGRAM // block_d, triton.next_power_of_2(n)))
    _rms_norm_kernel[(triton.cdiv(n, block_t),)](
        x2,
        res2,
        scale,
        out,
        res_out,
        n,
        d,
        x2.stride(0),
        res2.stride(0),
        d,  # out and res_out are contiguous
        float(eps_d),
        ADD_RESIDUAL=residual is not None,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=min(max(block_t * block_d // 512, 1), 8),
    )
    return out, res_out


def rms_norm_triton(x: torch.Tensor, scale: torch.Tensor, eps_d: float) -> torch.Tensor:
    """rms_norm_reference as one Triton kernel."""
    check_launch(_rms_norm_kernel if triton else None, x.device, "rms_norm_triton")
    return _launch(x, None, scale, eps_d)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, eps_d: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_reference as one Triton kernel: (normed, residual + x), new tensors."""
    check_launch(_rms_norm_kernel if triton else None, x.device, "add_rms_norm_triton")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm_triton: residual {tuple(residual.shape)} {residual.dtype} must have "
            f"x's shape and dtype ({tuple(x.shape)} {x.dtype})"
        )
    return _launch(x, residual, scale, eps_d)
