"""FP4 routed experts as DeepSeek-V4 ships them: e2m1 values, two a byte, with one
power-of-two (ue8m0) scale per 32 input columns. The layout is HF transformers'
(`FP8Experts` with `expert_dtype="fp4"`, `Fp8Dequantize._unpack_fp4`) and the release's
inference code (`torch.float4_e2m1fn_x2` weights, `float8_e8m0fnu` scales):

    X.weight  int8            [out, in / 2]   byte j of a row: column 2j in bits 0..3,
                                              column 2j + 1 in bits 4..7
    X.scale   float8_e8m0fnu  [out, in / 32]  2 ** (byte - 127)

    W[o, k] = E2M1[code(o, k)] * scale[o, k // 32]

An e2m1 code is sign (bit 3), exponent (bits 2..1), mantissa (bit 0):

    code   0    1    2    3    4    5    6    7      8 .. 15
    value  0   0.5   1   1.5   2    3    4    6      the same, negative (8 is -0)

`in` must be a multiple of 32: the format has no partial block (HF derives the block from
`in / scale columns`). A checkpoint says so with `expert_dtype: "fp4"`, top-level in
DeepSeek-V4's config.json, inside `quantization_config` in V4.1's (HF folds the former into
the latter); the rest of the release is block-FP8 (`quant_method: "fp8"`, e4m3 weights with
ue8m0 `X.scale` blocks of `weight_block_size`), which `dequantize_state_dict` reads too.

Ways to hold them:
  dequantised at load  into the run dtype, tensor by tensor as the loader reads them
                       (weights/loader.py; `dequantize_state_dict` does the same to a whole
                       state dict): the model never sees a code. --weight_dtype auto.
  kept packed          `Fp4Linear` (--weight_dtype fp4): a V4 model built under
                       `fp4_resident(True)` holds each routed expert's matrices as the
                       checkpoint stores them, 0.27 of bfloat16's bytes. With the torch MoE
                       backend each call unpacks the whole matrix in torch; with
                       --moe_backend triton (auto on CUDA) V4's MoE stacks them into
                       `Fp4Weight`s, which ops/fused_moe.py's kernels unpack and scale tile
                       by tile (models/deepseek_v4.py `MoE.use_kernels`).

`quantize_fp4` is the inverse, for tools and tests: per 32 columns the smallest power of two
that lets the block's largest magnitude fit 6.0, then each value rounded to the nearest e2m1
value (ties to the even code, as the hardware conversions do; the sign is kept, so a small
negative value becomes -0).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.weights import fp8
from xllm_py.weights.int4 import unpack_nibbles

BLOCK = 32  # input columns per scale
E2M1_MAX = 6.0
E8M0_BIAS = 127  # scale = 2 ** (byte - 127); byte 255 is NaN
SCALE_SUFFIX = fp8.RELEASE_SCALE  # "X.weight" -> "X.scale"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Magnitudes half-way between neighbouring e2m1 values (codes 0..7), and at each one the
# code a tie goes to: the even one, alternately the lower and the upper neighbour.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# A routed expert's matrices, in the release's names (`mtp.0.` as well as `layers.N.`).
EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def expert_dtype(cfg: dict) -> str | None:
    """The routed experts' format a V4 config.json declares ("fp4", "fp8"), or None (as
    the rest of the checkpoint). Raises ValueError naming a value this module does not read."""
    qc = cfg.get("quantization_config") or {}
    return fp8.checked_expert_dtype(qc.get("expert_dtype", cfg.get("expert_dtype")))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 in [0, 15]) [..., K] -> int8 [..., K / 2], the layout above."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2 or bool((codes > 15).any()):
        raise ValueError("pack_fp4: need uint8 codes in [0, 15] with an even last dimension")
    pairs = codes.unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse: int8 [..., K / 2] -> codes uint8 [..., K]. (The low-nibble-first order
    is INT4's too: int4.unpack_nibbles reads any tensor's bytes that way.)"""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"unpack_fp4: need int8 bytes, got {packed.dtype}")
    return unpack_nibbles(packed)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The code of the e2m1 value nearest each x (float, |x| <= 6 to be exact; beyond
    saturates to +-6), ties to the even code. uint8, the shape of x."""
    mid = torch.tensor(_MIDPOINTS, dtype=x.dtype, device=x.device)
    mag = x.abs()
    low = torch.bucketize(mag, mid)  # a tie counts as the lower code...
    high = torch.bucketize(mag, mid, right=True)  # ...or the upper one
    code = torch.where(low % 2 == 0, low, high)  # they differ only at a tie: keep the even
    return (code | (torch.signbit(x).to(code.dtype) << 3)).to(torch.uint8)


def _check_columns(cols: int, what: str) -> None:
    if cols % BLOCK:
        raise ValueError(
            f"{what}: {cols} input columns is not a multiple of {BLOCK}; the FP4 layout "
            f"has one scale per {BLOCK} columns and no partial block"
        )


def ue8m0_exponents(w: torch.Tensor) -> torch.Tensor:
    """Per 32 columns of w [..., K]: the smallest e with max |w| <= 6 * 2 ** e, clamped
    to e8m0's range [-127, 127] (an all-zero block gets -127). int32 [..., K / 32]"""
    amax = w.float().abs().unflatten(-1, (-1, BLOCK)).amax(dim=-1)
    _, e = torch.frexp(amax / E2M1_MAX)  # amax / 6 is rounded: e may be one off

    def fits(e: torch.Tensor) -> torch.Tensor:  # exact: 6 * 2 ** e is a float32
        return amax <= torch.ldexp(torch.full_like(amax, E2M1_MAX), e.float())

    e = e + (~fits(e)).int()
    e = torch.where(amax > 0, e - fits(e - 1).int(), -E8M0_BIAS)
    return e.clamp(-E8M0_BIAS, E8M0_BIAS).int()


def quantize_fp4(w: torch.Tensor, what: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., out, in] (float) -> (int8 [..., out, in / 2], float8_e8m0fnu [..., out,
    in / 32]), for tools and tests (rounding as in the module docstring). `what` names
    the tensor in errors."""
    _check_columns(w.shape[-1], what)
    e = ue8m0_exponents(w)
    blocks = w.float().unflatten(-1, (-1, BLOCK))
    q = torch.ldexp(blocks, -e.unsqueeze(-1).float())  # exact: a power-of-two scaling
    codes = e2m1_codes(q.flatten(-2))
    scale = (e + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)
    return pack_fp4(codes), scale


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [..., out, in] in `dtype` from its packed codes and ue8m0 scales. The product is
    taken in float32 (exact: a power of two times an e2m1 value) and then cast, as HF's
    `Fp8Dequantize` does, so the two agree bit for bit."""
    cols = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * BLOCK != cols:
        raise ValueError(
            f"FP4 weight {tuple(packed.shape)} (two values a byte) and scale "
            f"{tuple(scale.shape)} do not fit: need one scale per {BLOCK} columns"
        )
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    q = lut[unpack_fp4(packed).long()].unflatten(-1, (-1, BLOCK))
    return (q * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)


def dequantize_state_dict(
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    fp8_block: tuple[int, int] = (128, 128),
) -> dict[str, torch.Tensor]:
    """A V4 state dict in the release's layout (names and storage) -> the same names with
    every quantised weight dequantised into `dtype` and its `X.scale` dropped: int8
    `X.weight` with a scale is FP4 (the routed experts), float8 e4m3 is block-FP8 with
    `fp8_block` (quantization_config.weight_block_size; the attention and shared experts
    of the release). Everything else is returned as it is. Raises ValueError naming a
    scale without a weight, or a quantised weight without its scale."""
    out = {}
    for name, t in tensors.items():
        if t.dtype == torch.float8_e8m0fnu and name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) + ".weight" not in tensors:
                raise ValueError(f"tensor {name!r} scales a weight that is not in the checkpoint")
            continue  # read with its weight
        base = name.removesuffix(".weight")
        scale = tensors.get(base + SCALE_SUFFIX) if name.endswith(".weight") else None
        quantised = t.dtype in (torch.int8, fp8.FP8)
        if quantised and scale is None:
            raise ValueError(f"tensor {name!r} is {t.dtype} but {base + SCALE_SUFFIX!r} is missing")
        if scale is None:
            out[name] = t
        elif t.dtype == torch.int8:
            out[name] = dequantize_fp4(t, scale, dtype)
        elif t.dtype == fp8.FP8:
            out[name] = fp8.dequantize(t, scale.float(), fp8_block, dtype)
        else:
            raise ValueError(f"tensor {base + SCALE_SUFFIX!r} scales {name!r}, which is {t.dtype}")
    return out


def quantization_config(qc: dict | None = None) -> dict:
    """config.json's quantization_config for a checkpoint whose routed experts are FP4:
    the release's fields (block-FP8 e4m3 with ue8m0 scales for what is quantised besides
    the experts) with V4.1's `expert_dtype` inside; `qc` (an existing entry) is kept
    where it does not conflict."""
    release = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    return {**release, **(qc or {}), "expert_dtype": "fp4"}


# ---- FP4 kept packed on the device -----------------------------------------------------------


class Fp4Weight(nn.Module):
    """A packed FP4 matrix (a stack of experts' when it has leading dims), as stored:

        packed  [..., out, in / 2]   int8, two e2m1 codes a byte
        scale   [..., out, in / 32]  float8_e8m0fnu
        W[..., o, k] = E2M1[code k of row o] * scale[..., o, k // 32]

    4.25 bits a weight: 0.27 of bfloat16's bytes. Each matmul unpacks and scales
    (`dequant`, torch; on the fused-MoE path ops/fused_moe.py's kernels do it tile by tile).
    Rows carry their own scales, so matrices fuse along rows (`cat`) and stack (`stack`) as
    `int4.Int4Weight`'s do."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if packed.dtype != torch.int8 or scale.dtype != torch.float8_e8m0fnu:
            raise ValueError(
                f"Fp4Weight: need int8 codes and float8_e8m0fnu scales, got {packed.dtype} "
                f"and {scale.dtype}"
            )
        if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * BLOCK != packed.shape[-1] * 2:
            raise ValueError(
                f"Fp4Weight: scale {tuple(scale.shape)} does not fit packed "
                f"{tuple(packed.shape)} (one scale per {BLOCK} columns, two columns a byte)"
            )
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Fp4Weight:
        return cls(*quantize_fp4(w))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * 2))

    def dequant(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp4(self.packed, self.scale, dtype)

    def __getitem__(self, index) -> Fp4Weight:
        """Experts of a stack: `index` an int or a tensor of ids."""
        return Fp4Weight(self.packed[index], self.scale[index])

    @staticmethod
    def cat(parts: list[Fp4Weight]) -> Fp4Weight:
        """Concatenated along the output rows (fused w1 | w3): any row counts fuse."""
        packed = torch.cat([p.packed for p in parts], dim=-2)
        return Fp4Weight(packed, torch.cat([p.scale for p in parts], dim=-2))

    @staticmethod
    def stack(parts: list[Fp4Weight]) -> Fp4Weight:
        """Experts' matrices of one shape stacked on a new leading dim."""
        packed = torch.stack([p.packed for p in parts])
        return Fp4Weight(packed, torch.stack([p.scale for p in parts]))

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, scale=ue8m0 per {BLOCK}"


# ---- FP4 experts kept packed in a V4 model -----------------------------------------------------

_RESIDENT: contextvars.ContextVar[bool] = contextvars.ContextVar("fp4_resident", default=False)


@contextlib.contextmanager
def fp4_resident(on: bool) -> Iterator[None]:
    """While a V4 model is built: its routed experts' matrices are `Fp4Linear`s (on) or
    plain linears in the run dtype (off: the loader dequantises into them)."""
    token = _RESIDENT.set(on)
    try:
        yield
    finally:
        _RESIDENT.reset(token)


def expert_linear(dim_in: int, dim_out: int) -> nn.Module:
    """A routed expert's matrix, as `fp4_resident` says."""
    if _RESIDENT.get():
        return Fp4Linear(dim_in, dim_out)
    return nn.Linear(dim_in, dim_out, bias=False)


class Fp4Linear(nn.Module):
    """y = x W^T for a packed FP4 W held under the checkpoint's layout: `weight` int8
    [out, in / 2] and `weight_scale_inv` float8_e8m0fnu [out, in / 32] (the loader's name
    for the release's `X.scale`). Each call dequantises W into x's dtype."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        _check_columns(dim_in, "a packed FP4 expert")
        self.register_buffer("weight", torch.zeros(dim_out, dim_in // 2, dtype=torch.int8))
        ones = torch.full((dim_out, dim_in // BLOCK), E8M0_BIAS, dtype=torch.uint8)
        self.register_buffer("weight" + fp8.SCALE_SUFFIX, ones.view(torch.float8_e8m0fnu))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_fp4(self.weight, self.weight_scale_inv, x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1] * 2}, out={self.weight.shape[0]}, FP4 packed"
