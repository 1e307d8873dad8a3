"""SwiGLU MLP: dense layers, shared experts and (as weights) routed experts.

Loaded as `gate_proj`, `up_proj`, `down_proj` (checkpoint names); after
loading, gate and up are fused into one `[2 * inter, hidden]` matrix so a
token costs two matmuls, not three.

Tensor parallel: gate/up split on the intermediate dim (rows), down_proj on its
input dim, so each rank's output is a partial sum. A dense MLP all-reduces it;
inside a MoE layer (`reduce=False`) the MoE adds routed and shared partial sums
and reduces once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.models.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    Weight,
    cat_weights,
    linear,
)
from xllm_py.parallel.context import SINGLE, ParallelContext


def swiglu(x: torch.Tensor, w13: Weight, w2: Weight) -> torch.Tensor:
    gate, up = linear(x, w13).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2)


class MLP(nn.Module):
    """`parallel`: how to split the intermediate dim (SINGLE: whole, e.g. an expert owned
    by this rank under expert parallelism). `name`: the config field of
    `intermediate_size`, named in the divisibility error."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelContext = SINGLE,
        reduce: bool = True,
        name: str = "intermediate_size",
    ) -> None:
        super().__init__()
        parallel.split(intermediate_size, name)
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel)
        # The fused forward below multiplies by down_proj.weight and reduces itself.
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel, reduce=False)
        self.parallel = parallel
        self.reduce = reduce
        self.w13: Weight | None = None

    def process_weights_after_loading(self) -> None:
        # (the model visits parents first: the two linears' weights are still as loaded)
        self.gate_proj.process_weights_after_loading()
        self.up_proj.process_weights_after_loading()
        self.w13 = cat_weights([self.gate_proj.weight, self.up_proj.weight])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = swiglu(x, self.w13, self.down_proj.weight)
        return self.parallel.all_reduce(y) if self.reduce else y
