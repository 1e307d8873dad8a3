"""RMSNorm, computed in float32 and cast back (as DeepSeek-V3 and HF do).

    y = x * rsqrt(mean(x^2) + eps) * w  =  x * rsqrt(sum(x^2) + eps * d) * (w * sqrt(d))

The right-hand form is what runs: `vector_norm` gives sum(x^2) in one kernel
and sqrt(d) is folded into the weight after loading, so a norm costs five
small kernels instead of seven (at decode sizes the count, not the
arithmetic, is the cost). Results agree to float32 rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps_d = eps * dim
        self.sqrt_d = math.sqrt(dim)
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.scale: torch.Tensor | None = None  # weight * sqrt(d), float32

    def process_weights_after_loading(self) -> None:
        self.scale = self.weight.float() * self.sqrt_d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype == torch.float32 else x.float()
        inv = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().add_(self.eps_d).rsqrt_()
        y = xf * inv * self.scale
        return y if x.dtype == torch.float32 else y.to(x.dtype)
