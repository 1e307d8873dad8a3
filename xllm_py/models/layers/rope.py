"""Rotary position embedding for the `qk_rope_head_dim` slice, with YaRN.

DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... each by one
frequency. `apply_rope` returns the rotated pairs de-interleaved
([all first elements | all second elements]); since queries and keys get the
same permutation, q.k is unchanged and the cached keys stay consistent.

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


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for every position up to the model's context."""

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]  # [max_positions, dim / 2]
        scale, dtype = rope.cos_sin_scale, torch.get_default_dtype()  # computed in fp32, stored in run dtype
        self.register_buffer("cos", (freqs.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position: two `[T, 1, dim / 2]` tensors (1 broadcasts over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x `[T, heads, dim]`; output de-interleaved, same shape."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
