"""SwiGLU MLP: dense layers and shared experts.

Loaded as `gate_proj`, `up_proj`, `down_proj` (checkpoint names); after
loading, gate and up are fused into one `[2 * inter, hidden]` matrix so a
token costs two matmuls, not three.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.models.layers.linear import Linear, gemm_layout


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.w13: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        self.w13 = gemm_layout(torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w13, self.down_proj.weight)
