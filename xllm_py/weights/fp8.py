"""FP8 block-quantised weights (DeepSeek-V3's `quant_method: fp8`, and compressed-tensors'
FP8_BLOCK scheme).

A quantised weight `W [out, in]` is stored as float8 e4m3 plus
`weight_scale_inv [ceil(out / B0), ceil(in / B1)]` (float32), where
`(B0, B1) = quantization_config.weight_block_size`:

    W[i, j] = fp8[i, j] * scale_inv[i // B0, j // B1]

compressed-tensors' FP8_BLOCK (`format: float-quantized`, weights `strategy: block`) is the
same layout with the scales named `weight_scale` and the block in `block_structure`;
`Fp8Config.stored_suffix` says which name a checkpoint uses. DeepSeek-V4's release names a
weight's scales `X.scale` (float8_e8m0fnu: powers of two) and says in `expert_dtype` how its
routed experts are held ("fp4": weights/fp4.py). The loader reads all of them under the
one name `weight_scale_inv`.

Edges that are not a multiple of the block size belong to a partial block.

Two ways to hold such a weight (--weight_dtype):
  dequantised at load  per tensor (or per rank's slice), into the run dtype; the model
                       never sees a scale.
  FP8-resident         `Fp8Weight`: the float8 matrix (or a stack of experts' matrices),
                       its block scales, and for each local row and column the scale
                       block it belongs to (`rows`, `cols`). A rank's slice, or a fused
                       matrix whose parts do not end on a block edge, keeps the scales of
                       the blocks it covers and its own index maps, so no alignment is
                       needed. Multiplying goes through `ops.fp8_gemm.fp8_linear`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from xllm_py.weights.int4 import Int4Config, config_groups

logger = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
RELEASE_SCALE = ".scale"  # DeepSeek-V4's release: "X.weight" -> "X.scale"
EXPERT_DTYPES = ("fp4", "fp8")  # DeepSeek-V4's `expert_dtype` values


# `quantization_config.scale_fmt` values: None (any float32 scale) or DeepSeek-V3.1's
# "ue8m0" (every scale a power of two: an 8-bit exponent, no mantissa).
SCALE_FORMATS = (None, "ue8m0")


@dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int]
    scale_fmt: str | None = None
    stored_suffix: str = SCALE_SUFFIX  # the scales' name in the checkpoint, after "X.weight"
    expert_dtype: str | None = None  # DeepSeek-V4's routed experts: "fp4", "fp8" or as the rest

    @classmethod
    def from_quantization_config(cls, qc: dict | None) -> Fp8Config | None:
        if not qc:
            return None
        method = qc.get("quant_method")
        if method == "compressed-tensors":
            if qc.get("format") == "float-quantized":
                return cls._compressed_tensors(qc)
            # INT4 weights (weights/int4.py, read by the loader), or refused naming the field
            Int4Config.from_quantization_config(qc)
            return None
        if method != "fp8":
            raise ValueError(
                f"quantization_config.quant_method={method!r} is not supported; only 'fp8' "
                "(block-quantised e4m3, as DeepSeek-V3 ships) is"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt={fmt!r} is not supported; only 'e4m3'")
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise ValueError(f"quantization_config.weight_block_size={block!r}: need [rows, cols]")
        scale_fmt = qc.get("scale_fmt")
        if scale_fmt not in SCALE_FORMATS:
            raise ValueError(
                f"quantization_config.scale_fmt={scale_fmt!r} is not supported; expected one "
                f"of {list(SCALE_FORMATS)}"
            )
        expert = checked_expert_dtype(qc.get("expert_dtype"))
        return cls((int(block[0]), int(block[1])), scale_fmt, expert_dtype=expert)

    @classmethod
    def _compressed_tensors(cls, qc: dict) -> Fp8Config:
        """compressed-tensors FP8_BLOCK: e4m3 weights with block scales `weight_scale`;
        activations, if listed, quantised on the fly (this engine multiplies in the run
        dtype or with its own dynamic per-token quantisation). Static activation scales
        and other weight strategies are refused, naming the field."""
        blocks = set()
        want = dict(num_bits=8, type="float", symmetric=True, strategy="block")
        for where, group, w in config_groups(qc, want, "FP8_BLOCK"):
            acts = group.get("input_activations")
            if acts and not acts.get("dynamic"):
                raise ValueError(
                    f"{where}.input_activations.dynamic={acts.get('dynamic')!r}: static "
                    "activation scales are not supported; need dynamic"
                )
            block = w.get("block_structure")
            if not block or len(block) != 2:
                raise ValueError(f"{where}.weights.block_structure={block!r}: need [rows, cols]")
            blocks.add((int(block[0]), int(block[1])))
        if len(blocks) != 1:
            raise ValueError(f"quantization_config: need one FP8 block_structure, got {blocks}")
        return cls(blocks.pop(), None, "_scale")

    def check_scales(self, name: str, scale: torch.Tensor) -> None:
        """Under ue8m0 every scale must be a power of two: a checkpoint that says ue8m0 and
        is not was converted wrongly, and a kernel that trusts the format would misread it."""
        if self.scale_fmt == "ue8m0" and not bool((torch.frexp(scale).mantissa == 0.5).all()):
            raise ValueError(
                f"tensor {name + SCALE_SUFFIX!r}: quantization_config.scale_fmt='ue8m0' but "
                "not every scale is a power of two"
            )


def checked_expert_dtype(value: str | None) -> str | None:
    """`value`, a DeepSeek-V4 `expert_dtype` this engine reads (or None); raises naming it."""
    if value is not None and value not in EXPERT_DTYPES:
        raise ValueError(
            f"expert_dtype={value!r} is not supported; expected one of {list(EXPERT_DTYPES)}"
        )
    return value


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def scale_aliases(names, fp8: Fp8Config | None) -> dict[str, str]:
    """For a checkpoint that stores its block scales under another name (compressed-tensors'
    `X.weight_scale`, DeepSeek-V4's `X.scale`): {"X.weight_scale_inv": stored name} for
    every weight that has them; {} for DeepSeek-V3's own layout."""
    if fp8 is None:
        return {}
    names = set(names)
    out = {}
    for n in names:
        if not n.endswith(".weight"):
            continue
        for stored in (n + fp8.stored_suffix, n.removesuffix(".weight") + RELEASE_SCALE):
            if stored in names and stored != n + SCALE_SUFFIX:
                out[n + SCALE_SUFFIX] = stored
    return out


@functools.lru_cache(maxsize=1024)  # shared by the many weights of one layout (read-only)
def block_index(n: int, block: int, offset: int = 0) -> torch.Tensor:
    """For the `n` rows (or columns) starting at `offset` of a full tensor: the index of
    each one's scale block, counted from the first block they touch. [n] int32"""
    idx = (torch.arange(n, dtype=torch.int32) + offset) // block
    return idx - offset // block


def covering(start: int, length: int, block: int) -> slice:
    """The scale blocks that rows (or columns) [start, start + length) of a full tensor touch."""
    return slice(start // block, -(-(start + length) // block))


def dequantize(
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    offset: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """float8 `[out, in]` with its block scales -> `dtype`. `w` may be a slice of a full
    tensor starting at `offset` (row, column), with `scale_inv` the blocks it touches;
    a whole tensor's are `[ceil(out/B0), ceil(in/B1)]`."""
    out_dim, in_dim = w.shape
    rows = slice_blocks(out_dim, block[0], offset[0])
    cols = slice_blocks(in_dim, block[1], offset[1])
    if tuple(scale_inv.shape) != (rows, cols):
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}; "
            f"a {out_dim}x{in_dim} weight with "
            f"blocks of {block[0]}x{block[1]} needs {(rows, cols)}"
        )
    rows = block_index(out_dim, block[0], offset[0])
    cols = block_index(in_dim, block[1], offset[1])
    whole_cols = block[1] if offset[1] % block[1] == 0 else None
    return _expand(w, scale_inv, rows, cols, whole_cols).to(dtype)


def slice_blocks(length: int, block: int, offset: int = 0) -> int:
    s = covering(offset, length, block)
    return s.stop - s.start


def _expand(w, scale, rows, cols, block_cols: int | None = None) -> torch.Tensor:
    """float32 `w * scale` with each element's block scale: [..., out, in]. With
    `block_cols` (columns are whole blocks from the first), the scales broadcast over each
    block's columns instead of being expanded to the full size first."""
    out = w.float()
    s = scale[..., rows, :]  # [..., out, C]: small
    if block_cols and out.shape[-1] == s.shape[-1] * block_cols:
        out.view(*out.shape[:-1], s.shape[-1], block_cols).mul_(s.unsqueeze(-1))
        return out
    return out.mul_(s[..., cols])


def quantize(
    w: torch.Tensor, block: tuple[int, int], scale_fmt: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tools and tests: per-block absmax scaling into e4m3's range; under
    `scale_fmt="ue8m0"` each scale rounded up to a power of two (DeepSeek-V3.1's layout)."""
    out_dim, in_dim = w.shape
    b0, b1 = block
    rows, cols = -(-out_dim // b0), -(-in_dim // b1)
    padded = torch.zeros(rows * b0, cols * b1)
    padded[:out_dim, :in_dim] = w.float()
    blocks = padded.view(rows, b0, cols, b1)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max  # [rows, cols]
    if scale_fmt == "ue8m0":  # up, so that every block still fits e4m3's range
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    q = (blocks / scale_inv[:, None, :, None]).view(rows * b0, cols * b1)[:out_dim, :in_dim]
    return q.to(torch.float8_e4m3fn), scale_inv


# ---- FP8-resident weights --------------------------------------------------------------------

_RESIDENT_BLOCK: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "fp8_resident_block", default=None
)


@contextlib.contextmanager
def fp8_resident(block: tuple[int, int] | None) -> Iterator[None]:
    """While a model is built: its quantisable linears (models/layers/linear.py) hold float8
    weights with `block` scales instead of run-dtype ones (None: no change)."""
    token = _RESIDENT_BLOCK.set(block)
    try:
        yield
    finally:
        _RESIDENT_BLOCK.reset(token)


def resident_block() -> tuple[int, int] | None:
    return _RESIDENT_BLOCK.get()


class Fp8Weight(nn.Module):
    """A float8 matrix `data [..., out, in]` (a stack of experts' when it has a leading
    dim) with `scale [..., R, C]` float32 and the block of each local row / column
    (`rows [out]`, `cols [in]`, the same for every matrix of a stack):

        W[..., i, j] = data[..., i, j] * scale[..., rows[i], cols[j]]

    `aligned`: rows and columns are whole blocks from the first (row i in block i // B0),
    which the device's block-scaled FP8 GEMM needs."""

    def __init__(self, data, scale, rows, cols, block: tuple[int, int], aligned=None) -> None:
        super().__init__()
        self.register_buffer("data", data)
        self.register_buffer("scale", scale.float())
        self.register_buffer("rows", rows.to(data.device))
        self.register_buffer("cols", cols.to(data.device))
        self.block = block
        n, m = data.shape[-2:]
        if aligned is None:  # (an expert taken from a stack inherits the stack's)
            aligned = torch.equal(rows.cpu(), block_index(n, block[0])) and torch.equal(
                cols.cpu(), block_index(m, block[1])
            )
        self.aligned = bool(aligned)
        self.cols_aligned = bool(torch.equal(cols.cpu(), block_index(m, block[1])))

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequant(self, dtype: torch.dtype) -> torch.Tensor:
        whole_cols = self.block[1] if self.cols_aligned else None
        return _expand(self.data, self.scale, self.rows, self.cols, whole_cols).to(dtype)

    def __getitem__(self, index) -> Fp8Weight:
        """Experts of a stack: `index` an int or a tensor of ids."""
        return Fp8Weight(
            self.data[index], self.scale[index], self.rows, self.cols, self.block, self.aligned
        )

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        """Concatenated along the output rows (fused gate|up, q|kv): each part keeps its
        own scale blocks, so the parts need not end on a block edge."""
        if len({p.cols.tolist().__repr__() for p in parts}) != 1:
            raise ValueError("FP8 weights fused along rows must share their column blocks")
        offsets = [0]
        for p in parts[:-1]:
            offsets.append(offsets[-1] + p.scale.shape[-2])
        rows = torch.cat([p.rows + o for p, o in zip(parts, offsets)])
        scale = torch.cat([p.scale for p in parts], dim=-2)
        data = torch.cat([p.data for p in parts], dim=-2)
        return Fp8Weight(data, scale, rows, parts[0].cols, parts[0].block)

    @staticmethod
    def stack(parts: list[Fp8Weight]) -> Fp8Weight:
        """Experts' matrices of one layout stacked on a new leading dim."""
        first = parts[0]
        if any(not torch.equal(p.rows, first.rows) or not torch.equal(p.cols, first.cols)
               for p in parts):  # fmt: skip
            raise ValueError("stacked FP8 weights must share their block layout")
        data = torch.stack([p.data for p in parts])
        scale = torch.stack([p.scale for p in parts])
        return Fp8Weight(data, scale, first.rows, first.cols, first.block)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.data.shape)}, block={self.block}, aligned={self.aligned}"
