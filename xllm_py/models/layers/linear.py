"""A bias-free linear layer whose weight is named as in the checkpoint, and its two
tensor-parallel forms.

Weights are allocated uninitialised: every one of them is overwritten by the
loader, which fails loudly on anything missing. A sharded weight carries a
`Shard` (`weight.shard`) telling the loader which slice of the checkpoint
tensor it holds:

    ColumnParallelLinear  W [out, in] -> rank r: rows    [r*out/tp, (r+1)*out/tp)
    RowParallelLinear     W [out, in] -> rank r: columns [r*in/tp, (r+1)*in/tp), y all-reduced

Rows grouped per head (q_b_proj, kv_b_proj) or per intermediate unit split
contiguously, so a block of whole heads lands on each rank.

FP8-resident (weights/fp8.py): a quantisable linear built inside `fp8_resident(block)`
holds `weight` as float8 plus `weight_scale_inv`, the scale blocks its slice touches
(`Shard.blocks` tells the loader which); after loading both become one `Fp8Weight`.
INT4 kept packed (weights/int4.py): a linear built inside `int4.packed_linears(group)`
(a MoE layer's routed experts under --weight_dtype int4) holds `weight_packed` (int32
words) and `weight_scale` (group scales) of its slice instead of `weight`; after loading
both become one `Int4Weight`. Code that multiplies by a weight goes through `linear`,
`cat_weights`, `stack_weights` and `dense`, which take any of the three forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.ops.fp8_gemm import fp8_linear
from xllm_py.parallel.context import SINGLE, ParallelContext
from xllm_py.weights import int4
from xllm_py.weights.fp8 import FP8, Fp8Weight, block_index, resident_block
from xllm_py.weights.int4 import Int4Weight


@dataclass(frozen=True)
class Shard:
    """The slice of a checkpoint tensor a parameter holds: part `rank` of `parts` equal
    contiguous parts along `dim`."""

    dim: int
    rank: int
    parts: int

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(n * self.parts if d == self.dim else n for d, n in enumerate(local))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        n = full.shape[self.dim] // self.parts
        return full.narrow(self.dim, self.rank * n, n)

    def span(self, full_len: int) -> tuple[int, int]:
        """(start, length) of this part along `dim`, in a tensor `full_len` long there."""
        n = full_len // self.parts
        return self.rank * n, n


@dataclass(frozen=True)
class BlockShard:
    """The scale blocks an FP8 weight's `Shard` touches: `weight_shape` is the full
    weight's, `block` the quantisation block."""

    shard: Shard | None
    weight_shape: tuple[int, int]
    block: tuple[int, int]

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(-(-n // b) for n, b in zip(self.weight_shape, self.block))

    def offset(self) -> tuple[int, int]:
        """(row, column) of the slice's first element in the full weight."""
        if self.shard is None:
            return 0, 0
        start, _ = self.shard.span(self.weight_shape[self.shard.dim])
        return (start, 0) if self.shard.dim == 0 else (0, start)

    def local_len(self, dim: int) -> int:
        n = self.weight_shape[dim]
        return n if self.shard is None or self.shard.dim != dim else self.shard.span(n)[1]


class Linear(nn.Module):
    """Built inside `fp8_resident`, the weight starts FP8-resident; inside
    `int4.packed_linears`, packed INT4 (`group`: its group size). The loader turns either
    back to the run dtype (`hold_dense`) if the checkpoint stores it unquantised
    (checkpoints differ on e.g. the MTP layer's eh_proj)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.group = int4.packed_group()
        self.block = None if self.group else resident_block()
        self.dense_dtype = torch.get_default_dtype()
        if self.group:
            self._packed(None)
            return
        dtype = FP8 if self.block else None
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        if self.block:
            self._scales(None)

    def hold_dense(self) -> None:
        """Hold the weight in the run dtype instead of FP8 or packed INT4 (before loading)."""
        if self.group:
            shard, device = self.weight_packed.int4.shard, self.weight_packed.device
            del self.weight_packed, self.weight_scale
        else:
            shard, device = getattr(self.weight, "shard", None), self.weight.device
            del self.weight_scale_inv
        self.weight = nn.Parameter(
            torch.empty(self.out_features, self.in_features, dtype=self.dense_dtype,
                        device=device),
            requires_grad=False,
        )  # fmt: skip
        if shard is not None:
            self.weight.shard = shard
        self.block = self.group = None

    def _packed(self, shard: Shard | None) -> None:
        """(Re)declare the packed words and group scales of this rank's slice `shard`.
        Scales are declared bf16, Kimi-K2-Thinking's; the loader keeps a checkpoint's own."""
        out, cols = self.out_features, self.in_features
        words, groups = -(-cols // int4.PACK), -(-cols // self.group)
        self.register_buffer("weight_packed", torch.empty(out, words, dtype=torch.int32))
        self.register_buffer("weight_scale", torch.empty(out, groups, dtype=torch.bfloat16))
        self.weight_packed.int4 = int4.PackedSlice((out, cols), shard, self.group)

    def _scales(self, shard: Shard | None) -> None:
        """(Re)declare `weight_scale_inv` for this rank's slice `shard` of the weight."""
        full = (self.out_features, self.in_features)
        if shard is not None:
            full = shard.full_shape(full)
        bs = BlockShard(shard, full, self.block)
        rows, cols = (
            -(-(o + n) // b) - o // b
            for o, n, b in zip(bs.offset(), (bs.local_len(0), bs.local_len(1)), self.block)
        )
        self.register_buffer("weight_scale_inv", torch.empty(rows, cols, dtype=torch.float32))
        self.weight_scale_inv.shard = bs

    def shard_weight(self, shard: Shard) -> None:
        if self.group:
            self._packed(shard)
            return
        self.weight.shard = shard
        if self.block:
            self._scales(shard)

    def process_weights_after_loading(self) -> None:
        if isinstance(getattr(self, "weight", None), Fp8Weight | Int4Weight):
            return  # done already (by a parent that needed the weight first)
        if self.group:
            w = Int4Weight(self.weight_packed, self.weight_scale, self.in_features, self.group)
            del self.weight_packed, self.weight_scale
            self.weight = w
            return
        if not self.block:
            self.weight.data = gemm_layout(self.weight.data)
            return
        bs = self.weight_scale_inv.shard
        (r0, c0), (n, m) = bs.offset(), self.weight.shape
        w = Fp8Weight(
            self.weight.data,
            self.weight_scale_inv,
            block_index(n, self.block[0], r0),
            block_index(m, self.block[1], c0),
            self.block,
        )
        del self.weight, self.weight_scale_inv
        self.weight = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)

    def extra_repr(self) -> str:
        fmt = f", fp8 block={self.block}" if self.block else ""
        fmt += f", int4 group={self.group}" if self.group else ""
        return f"in={self.in_features}, out={self.out_features}{fmt}"


class ColumnParallelLinear(Linear):
    """Output features split across the tp ranks: each rank computes its own slice of y,
    no communication. (Callers check divisibility first, naming their config field.)"""

    def __init__(self, in_features: int, out_features: int, parallel: ParallelContext = SINGLE):
        super().__init__(in_features, out_features // parallel.tp_size)
        if out_features % parallel.tp_size:
            raise ValueError(
                f"out_features={out_features} is not divisible by tp_size={parallel.tp_size}"
            )
        self.shard_weight(Shard(0, parallel.tp_rank, parallel.tp_size))


class RowParallelLinear(Linear):
    """Input features split across the tp ranks: each rank multiplies its slice of x and
    the partial sums are all-reduced (unless `reduce=False`: the caller reduces)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelContext = SINGLE,
        reduce: bool = True,
    ) -> None:
        super().__init__(in_features // parallel.tp_size, out_features)
        if in_features % parallel.tp_size:
            raise ValueError(
                f"in_features={in_features} is not divisible by tp_size={parallel.tp_size}"
            )
        self.shard_weight(Shard(1, parallel.tp_rank, parallel.tp_size))
        self.parallel = parallel
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        return self.parallel.all_reduce(y) if self.reduce else y


Weight = torch.Tensor | Fp8Weight | Int4Weight
QUANTIZED = (Fp8Weight, Int4Weight)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x @ w^T for a run-dtype, FP8-resident or packed INT4 weight (unpacked and scaled
    for this call: the torch form; the fused MoE kernels unpack tile by tile)."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w)
    if isinstance(w, Int4Weight):
        return F.linear(x, w.dequant(x.dtype))
    return F.linear(x, w)


def dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype` (dequantised if quantised), for code that reshapes it."""
    return w.dequant(dtype) if isinstance(w, QUANTIZED) else w


def cat_weights(parts: list[Weight]) -> Weight:
    """Matrices fused along their output rows, in the form they are held."""
    for kind in QUANTIZED:
        if all(isinstance(p, kind) for p in parts):
            return kind.cat(parts)
    return gemm_layout(torch.cat(_dense_parts(parts)))


def stack_weights(parts: list[Weight]) -> Weight:
    """Experts' matrices stacked on a new leading dim, in the form they are held."""
    for kind in QUANTIZED:
        if all(isinstance(p, kind) for p in parts):
            return kind.stack(parts)
    return gemm_layout(torch.stack(_dense_parts(parts)))


def _dense_parts(parts: list[Weight]) -> list[torch.Tensor]:
    """Run-dtype parts; a quantised part beside a checkpoint's unquantised one (a fused
    or stacked matrix holds one form) is dequantised to the latter's dtype."""
    plain = [p.dtype for p in parts if not isinstance(p, QUANTIZED)]
    dtype = plain[0] if plain else torch.get_default_dtype()
    return [dense(p, dtype) for p in parts]


def gemm_layout(w: torch.Tensor) -> torch.Tensor:
    """The same weight `[..., out, in]`, stored in the layout the device multiplies fastest.

    On CPU, float32 matrix-vector products (decode at small batch) ran about 2x faster with
    the weight stored column-major, i.e. with `w.T` contiguous (measured with torch 2.13 /
    MKL on these EPYC machines: 27 decode-sized weights, 2.1 ms -> 1.1 ms; no change at
    batch 32; bf16 is fastest row-major). Shapes and values are unchanged, only strides.
    """
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return w
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)
