"""RMSNorm, computed in float32 and cast back (as DeepSeek-V3 and HF do).

    y = x * rsqrt(mean(x^2) + eps) * w  =  x * rsqrt(sum(x^2) + eps * d) * (w * sqrt(d))

The right-hand form is what runs: `vector_norm` gives sum(x^2) in one kernel
and sqrt(d) is folded into the weight after loading, so a norm costs five
small kernels instead of seven (at decode sizes the count, not the
arithmetic, is the cost). Results agree to float32 rounding.

`add_and_norm` is the residual add before a norm and the norm together: one
Triton kernel (ops/rms_norm.py) when --attention_backend=triton, the add and
the five kernels above otherwise.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from xllm_py.ops.rms_norm import (
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)

if TYPE_CHECKING:
    from xllm_py.ops.backends import Kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps_d = eps * dim
        self.sqrt_d = math.sqrt(dim)
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.scale: torch.Tensor | None = None  # weight * sqrt(d), float32
        self.triton = False  # the Triton kernels (ops/backends.py; the worker installs them)

    def process_weights_after_loading(self) -> None:
        self.scale = self.weight.float() * self.sqrt_d

    def use_kernels(self, kernels: Kernels) -> None:
        # The Triton attention backend brings its norm (and rotary) kernels with it.
        self.triton = kernels.attention == "triton"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton:
            return rms_norm_triton(x, self.scale, self.eps_d)
        return rms_norm_reference(x, self.scale, self.eps_d)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), the sum in x.dtype."""
        if self.triton:
            return add_rms_norm_triton(x, residual, self.scale, self.eps_d)
        return add_rms_norm_reference(x, residual, self.scale, self.eps_d)
