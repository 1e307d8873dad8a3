"""INT4 weights in compressed-tensors' `pack-quantized` format (Kimi-K2-Thinking's routed
experts: W4A16, symmetric, one scale per group of `group_size` input columns).

A quantised weight `X.weight [out, in]` is stored as three tensors:

    X.weight_packed  int32 [out, ceil(in / 8)]   eight 4-bit values per word
    X.weight_scale   bf16/fp16/fp32 [out, ceil(in / group_size)]
    X.weight_shape   int [2]                     (out, in)

Packing, as the format documents it: each signed value q in [-8, 7] is shifted to
q + 8 in [0, 15]; word j of a row holds columns 8j .. 8j+7, column 8j+i in bits 4i..4i+3
(the first column in the lowest bits); a last partial word is padded with zeros. Then

    W[o, k] = q[o, k] * scale[o, k // group_size]

The loader (weights/loader.py) lists such a weight once, under its logical name
`X.weight`. Two ways to hold it (--weight_dtype):
  dequantised at load  into the run dtype (`dequantize_int4`); the model never sees a word.
  kept packed          `Int4Weight` (--weight_dtype int4; auto on CUDA): the routed experts
                       of a model built inside `int4_resident(group)` hold the checkpoint's
                       int32 words and group scales (in the checkpoint's dtype, bf16 for
                       Kimi-K2-Thinking): about 0.28 of their bf16 bytes at group 32. A
                       rank's slice may cut rows anywhere; a cut of the input columns must
                       fall on a group and a word (the loader refuses others, naming the
                       tensor). Each matmul unpacks and scales (`Int4Weight.dequant`, torch;
                       on the fused-MoE path ops/fused_moe.py's kernels do it tile by tile).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PACKED, SCALE, SHAPE = "_packed", "_scale", "_shape"  # suffixes after "X.weight"
SUFFIXES = (PACKED, SCALE, SHAPE)
PACK = 8  # 4-bit values per int32 word


@dataclass(frozen=True)
class Int4Config:
    group_size: int

    @classmethod
    def from_quantization_config(cls, qc: dict | None) -> Int4Config | None:
        """The INT4 scheme of a compressed-tensors `pack-quantized` config; None for any
        other quant_method. Raises ValueError naming what this engine does not read."""
        if not qc or qc.get("quant_method") != "compressed-tensors":
            return None
        fmt = qc.get("format")
        if fmt != "pack-quantized":
            raise ValueError(
                f"quantization_config.format={fmt!r} (compressed-tensors) is not supported; "
                "only 'pack-quantized' INT4 weights (Kimi-K2-Thinking's experts) are"
            )
        sizes = set()
        want = dict(num_bits=4, type="int", symmetric=True, strategy="group")
        for where, group, w in config_groups(qc, want, "INT4 weights"):
            if group.get("input_activations"):
                raise ValueError(f"{where}.input_activations: only weight-only INT4 is supported")
            sizes.add(int(w.get("group_size") or 0))
        if len(sizes) != 1 or min(sizes) <= 0:
            raise ValueError(f"quantization_config: need one positive group_size, got {sizes}")
        return cls(sizes.pop())


def config_groups(qc: dict, want: dict, scheme: str):
    """(where, group, its weights) of each compressed-tensors config group, after checking
    that each `weights.<key>` is the wanted value (a ValueError naming it and `scheme`)."""
    for name, group in (qc.get("config_groups") or {}).items():
        w, where = group.get("weights") or {}, f"quantization_config.config_groups.{name}"
        for key, value in want.items():
            if w.get(key) != value:
                raise ValueError(
                    f"{where}.weights.{key}={w.get(key)!r} is not supported; need {value!r} "
                    f"({scheme})"
                )
        yield where, group, w


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [out, in] -> int32 words [out, ceil(in / 8)] (layout above)."""
    if q.dtype != torch.int8 or q.dim() != 2 or q.min() < -8 or q.max() > 7:
        raise ValueError("pack_int4: need a 2-D int8 tensor with values in [-8, 7]")
    out, cols = q.shape
    u = torch.zeros(out, -(-cols // PACK) * PACK, dtype=torch.int64)
    u[:, :cols] = q.to(torch.int64) + 8
    words = (u.view(out, -1, PACK) << (4 * torch.arange(PACK))).sum(dim=-1)
    return words.to(torch.uint32).view(torch.int32)  # the same 32 bits, read as signed


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The inverse: int32 words [out, W] -> int8 [out, cols]."""
    words = packed.view(torch.uint32).to(torch.int64)  # the bits, as unsigned
    nibbles = (words.unsqueeze(-1) >> (4 * torch.arange(PACK))) & 0xF
    return (nibbles.view(packed.shape[0], -1)[:, :cols] - 8).to(torch.int8)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group INT4 of W [out, in], for tools and tests: (packed, scale float32),
    scale = absmax / 7 per group (so that -7..7 is used; -8 stays free)."""
    out, cols = w.shape
    groups = -(-cols // group_size)
    padded = torch.zeros(out, groups * group_size)
    padded[:, :cols] = w.float()
    amax = padded.view(out, groups, group_size).abs().amax(dim=-1).clamp(min=1e-12)
    scale = amax / 7
    q = torch.round(padded.view(out, groups, group_size) / scale.unsqueeze(-1))
    q = q.clamp(-8, 7).view(out, -1)[:, :cols].to(torch.int8)
    return pack_int4(q), scale


def dequantize_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int],
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """W [out, in] in `dtype` from its packed words and group scales."""
    out, cols = shape
    want_scale = (out, -(-cols // group_size))
    if tuple(packed.shape) != (out, -(-cols // PACK)) or tuple(scale.shape) != want_scale:
        raise ValueError(
            f"packed {tuple(packed.shape)} and scale {tuple(scale.shape)} do not fit the "
            f"weight shape {shape} with group_size {group_size}"
        )
    q = unpack_int4(packed, cols).float()
    per_col = scale.float().repeat_interleave(group_size, dim=-1)[:, :cols]
    return (q * per_col).to(dtype)


def quantization_config(group_size: int) -> dict:
    """The config.json entry of this layout (compressed-tensors' field names)."""
    weights = dict(num_bits=4, type="int", symmetric=True, strategy="group",
                   group_size=group_size, dynamic=False, observer="minmax")  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
        },
        "ignore": [
            "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|down)_proj.*",
        ],
    }  # fmt: skip


# ---- INT4 kept packed on the device ------------------------------------------------------------

# The model being built keeps its routed experts packed with this group size (None: no).
_RESIDENT_GROUP: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "int4_resident_group", default=None
)
# Linears built now hold packed words (set by a MoE layer around its routed experts).
_PACKED_GROUP: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "int4_packed_group", default=None
)


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def int4_resident(group_size: int | None):
    """While a model is built: its MoE layers keep their routed experts packed INT4 with
    `group_size` scales (None: no change). Only the routed experts: Kimi-K2-Thinking
    quantises nothing else."""
    return _scoped(_RESIDENT_GROUP, group_size)


def resident_group() -> int | None:
    return _RESIDENT_GROUP.get()


def packed_linears(group_size: int | None):
    """While linears are built (models/layers/linear.py): they hold packed words and
    `group_size` scales instead of a run-dtype weight (None: no change)."""
    return _scoped(_PACKED_GROUP, group_size)


def packed_group() -> int | None:
    return _PACKED_GROUP.get()


@dataclass(frozen=True)
class PackedSlice:
    """What the loader needs to fill an INT4-resident linear's `weight_packed` and
    `weight_scale` (attached to the former as `.int4`): the logical shape this rank holds
    (out, in), its `Shard` of the whole weight (models/layers/linear.py; None: whole), the
    group size."""

    local: tuple[int, int]
    shard: Any
    group_size: int


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] -> their 4-bit fields, uint8 in [0, 15], [..., 8 * W] (column
    order). Byte b of a word (little-endian memory) holds its columns 2b (low nibble) and
    2b + 1 (high), so a uint8 view unpacks with no int32 temporaries."""
    b = packed.contiguous().view(torch.uint8)  # [..., 4 * W]
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


if sys.byteorder != "little":  # unpack_nibbles reads the words' bytes in memory order
    raise ImportError("xllm_py.weights.int4 assumes a little-endian host")


def dequant_packed(
    packed: torch.Tensor, scale: torch.Tensor, cols: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """W [..., out, cols] in `dtype` from packed words [..., out, ceil(cols / 8)] and group
    scales [..., out, ceil(cols / group_size)]. The product q * scale is exact in float32;
    a bf16 multiply rounds that exact product once, so float32 and bf16 give the values
    `dequantize_int4` gives (float32 product, then cast). fp16, whose range is narrower than
    a bf16 scale's, goes through float32."""
    work = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    q = unpack_nibbles(packed)[..., :cols].to(work) - 8
    s = scale.to(work)
    groups = s.shape[-1]
    if cols == groups * group_size:  # whole groups: broadcast, no expanded scale copy
        w = (q.unflatten(-1, (groups, group_size)) * s.unsqueeze(-1)).flatten(-2)
    else:
        w = q * s.repeat_interleave(group_size, dim=-1)[..., :cols]
    return w.to(dtype)


class Int4Weight(nn.Module):
    """A packed INT4 matrix (a stack of experts' when it has leading dims):

        packed  [..., out, ceil(cols / 8)]           int32, the checkpoint's words
        scale   [..., out, ceil(cols / group_size)]  the checkpoint's dtype (bf16)
        W[..., o, k] = (nibble k of row o - 8) * scale[..., o, k // group_size]

    `shape` is the logical [..., out, cols]."""

    def __init__(
        self, packed: torch.Tensor, scale: torch.Tensor, cols: int, group_size: int
    ) -> None:
        super().__init__()
        words, groups = -(-cols // PACK), -(-cols // group_size)
        if packed.dtype != torch.int32 or packed.shape[-1] != words:
            raise ValueError(
                f"Int4Weight: packed {tuple(packed.shape)} {packed.dtype} does not hold "
                f"{cols} columns ({words} int32 words a row)"
            )
        if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] != groups:
            raise ValueError(
                f"Int4Weight: scale {tuple(scale.shape)} does not fit packed "
                f"{tuple(packed.shape)}, {cols} columns, group {group_size}"
            )
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.cols = cols
        self.group_size = group_size

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.cols))

    def dequant(self, dtype: torch.dtype) -> torch.Tensor:
        return dequant_packed(self.packed, self.scale, self.cols, self.group_size, dtype)

    def __getitem__(self, index) -> Int4Weight:
        """Experts of a stack: `index` an int or a tensor of ids."""
        return Int4Weight(self.packed[index], self.scale[index], self.cols, self.group_size)

    @staticmethod
    def _check_alike(parts: list[Int4Weight], what: str) -> None:
        layouts = {(p.cols, p.group_size, p.scale.dtype) for p in parts}
        if len(layouts) != 1:
            raise ValueError(
                f"INT4 weights {what} must share columns, group size and scale dtype; got "
                f"{sorted(map(str, layouts))}"
            )

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Concatenated along the output rows (fused gate|up): rows carry their own scales,
        so any row counts fuse."""
        Int4Weight._check_alike(parts, "fused along rows")
        packed = torch.cat([p.packed for p in parts], dim=-2)
        scale = torch.cat([p.scale for p in parts], dim=-2)
        return Int4Weight(packed, scale, parts[0].cols, parts[0].group_size)

    @staticmethod
    def stack(parts: list[Int4Weight]) -> Int4Weight:
        """Experts' matrices of one layout stacked on a new leading dim."""
        Int4Weight._check_alike(parts, "stacked")
        packed = torch.stack([p.packed for p in parts])
        scale = torch.stack([p.scale for p in parts])
        return Int4Weight(packed, scale, parts[0].cols, parts[0].group_size)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, group_size={self.group_size}, scale={self.scale.dtype}"
