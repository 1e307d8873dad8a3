"""FP8 block-quantised weights (DeepSeek-V3's `quant_method: fp8`).

A quantised weight `W [out, in]` is stored as float8 e4m3 plus
`weight_scale_inv [ceil(out / B0), ceil(in / B1)]` (float32), where
`(B0, B1) = quantization_config.weight_block_size`:

    W[i, j] = fp8[i, j] * scale_inv[i // B0, j // B1]

Edges that are not a multiple of the block size belong to a partial block.
Dequantisation happens per tensor at load time, so the model is never held in
float32 as a whole; scale tensors never reach the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"


@dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int]

    @classmethod
    def from_quantization_config(cls, qc: dict | None) -> Fp8Config | None:
        if not qc:
            return None
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(
                f"quantization_config.quant_method={method!r} is not supported; only 'fp8' "
                "(block-quantised e4m3, as DeepSeek-V3 ships) is"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt={fmt!r} is not supported; only 'e4m3'")
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise ValueError(f"quantization_config.weight_block_size={block!r}: need [rows, cols]")
        return cls((int(block[0]), int(block[1])))


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def dequantize(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """float8 `[out, in]` with `[ceil(out/B0), ceil(in/B1)]` scales -> `dtype`."""
    out_dim, in_dim = w.shape
    b0, b1 = block
    expect = (-(-out_dim // b0), -(-in_dim // b1))
    if tuple(scale_inv.shape) != expect:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}; "
            f"a {out_dim}x{in_dim} weight with "
            f"blocks of {b0}x{b1} needs {expect}"
        )
    scale = (
        scale_inv.float().repeat_interleave(b0, 0)[:out_dim].repeat_interleave(b1, 1)[:, :in_dim]
    )
    return (w.float() * scale).to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tools and tests: per-block absmax scaling into e4m3's range."""
    out_dim, in_dim = w.shape
    b0, b1 = block
    rows, cols = -(-out_dim // b0), -(-in_dim // b1)
    padded = torch.zeros(rows * b0, cols * b1)
    padded[:out_dim, :in_dim] = w.float()
    blocks = padded.view(rows, b0, cols, b1)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max  # [rows, cols]
    q = (blocks / scale_inv[:, None, :, None]).view(rows * b0, cols * b1)[:out_dim, :in_dim]
    return q.to(torch.float8_e4m3fn), scale_inv
