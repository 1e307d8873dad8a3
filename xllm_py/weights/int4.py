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

The loader (weights/loader.py) reads such a weight under its logical name `X.weight`,
dequantised at load to the run dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
        for name, group in (qc.get("config_groups") or {}).items():
            w, where = group.get("weights") or {}, f"quantization_config.config_groups.{name}"
            want = dict(num_bits=4, type="int", symmetric=True, strategy="group")
            for key, value in want.items():
                if w.get(key) != value:
                    raise ValueError(
                        f"{where}.weights.{key}={w.get(key)!r} is not supported; need {value!r}"
                    )
            if group.get("input_activations"):
                raise ValueError(f"{where}.input_activations: only weight-only INT4 is supported")
            sizes.add(int(w.get("group_size") or 0))
        if len(sizes) != 1 or min(sizes) <= 0:
            raise ValueError(f"quantization_config: need one positive group_size, got {sizes}")
        return cls(sizes.pop())


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
