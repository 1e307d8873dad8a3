"""Rotary position embedding for the `qk_rope_head_dim` slice, with YaRN.

DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... each by one
frequency: viewed as complex numbers x0 + i x1, the rotation is one complex
multiply by cis(position * freq), which is how `apply_rope` does it (one
kernel instead of seven).

YaRN (when `factor > 1`): inverse frequencies blend interpolation (divided by
`factor`) and extrapolation with a linear ramp between the dimensions given by
`beta_fast` and `beta_slow`; cos/sin are multiplied by
m(mscale) / m(mscale_all_dim) (see `RopeConfig.cos_sin_scale`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xllm_py.config import RopeConfig


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.type != "yarn":
        return extrapolation
    interpolation = 1.0 / (rope.factor * pos_freqs)
    low = _yarn_correction_dim(rope.beta_fast, dim, rope.theta, rope.original_max_position)
    high = _yarn_correction_dim(rope.beta_slow, dim, rope.theta, rope.original_max_position)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1 - ramp
    return interpolation * (1 - keep_extrapolated) + extrapolation * keep_extrapolated


def llama_4_query_scale(positions: torch.Tensor, beta: float, original: int) -> torch.Tensor:
    """Llama-4's position-dependent query scale, which Mistral Large 3 applies on top of
    YaRN: 1 + beta * ln(1 + floor(p / original)), float32 [T] (1 for p < original)."""
    return 1 + beta * torch.log1p(torch.floor(positions.float() / original))


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for every position up to the model's context."""

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]  # [max_positions, dim / 2]
        scale = rope.cos_sin_scale
        cis = torch.polar(torch.full_like(freqs, scale), freqs)  # scale * (cos + i sin)
        self.register_buffer("cis", cis, persistent=False)  # complex64 [max_positions, dim / 2]
        # The same table as real pairs (cos, sin), for compiled graphs (Inductor generates no
        # code for complex ops and would fall back to eager kernels for them) and for Ascend
        # NPUs (complex64 is off their fast path). On CPU the real form gives bit-identical
        # results but costs 3x-8x the time of the one complex multiply in eager code.
        self.register_buffer("cos_sin", torch.view_as_real(cis).clone(), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """cis for each position: `[T, 1, dim / 2]` complex (1 broadcasts over heads); under
        torch.compile and on NPU `[T, 1, dim / 2, 2]` real (cos, sin)."""
        if torch.compiler.is_compiling() or positions.device.type == "npu":
            return self.cos_sin[positions].unsqueeze(1)
        return self.cis[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x `[T, heads, dim]` (any float dtype); same shape and layout.

    The product is taken in float32 (complex64) whatever the run dtype. `cis` may also be the
    real `[T, 1, dim / 2, 2]` (cos, sin) table (graph mode): the same rotation written out."""
    T, H, D = x.shape
    xf = x if x.dtype == torch.float32 else x.float()
    if not cis.is_complex():
        pairs = xf.reshape(T, H, D // 2, 2)
        x0, x1, cos, sin = pairs[..., 0], pairs[..., 1], cis[..., 0], cis[..., 1]
        out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).view(T, H, D)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    out = torch.view_as_real(torch.view_as_complex(xf.reshape(T, H, D // 2, 2)) * cis).view(T, H, D)
    return out if x.dtype == torch.float32 else out.to(x.dtype)
