"""Read safetensors checkpoints into models whose parameter names mirror them.

One tensor at a time, so peak memory is the model plus about one tensor per reading
thread (one thread per shard file, up to `LOAD_THREADS`). Single-file and sharded
(`model.safetensors.index.json`) layouts are both accepted, and so is Mistral's own
(`params.json`, Mistral's tensor names: weights/mistral.py), whose tensors are listed under
the model's names. FP8 block-quantised
weights are either dequantised on the way (`weights.fp8`) or, for a model built
FP8-resident, copied as float8 with their scale blocks. INT4 pack-quantized weights
(`weights.int4`) are either dequantised at load or, where the model keeps them packed
(`X.weight_packed` and `X.weight_scale` in place of `X.weight`), copied as stored: the
words and group scales of this rank's rows and columns. Every mismatch is an error that
names the tensor: unexpected names, missing names, shapes (checkpoint vs model),
unreadable or missing shard files, a packed slice whose columns start inside a group.

Tensor/expert parallel models load the same checkpoint on every rank, and each rank
reads only what it holds: a parameter with a `shard` (models/layers/linear.py `Shard`)
reads its slice from the file (`get_slice`), with the scale blocks that slice touches;
a module listing `remote_weight_prefixes` (MoE under expert parallelism) names the
weights another rank holds, which are not read at all. `load_weights` returns what it
read (`LoadStats`: bytes and seconds).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from xllm_py.config import read_config_dict
from xllm_py.weights import fp4, int4, mistral
from xllm_py.weights.fp8 import (
    FP8,
    SCALE_SUFFIX,
    Fp8Config,
    covering,
    dequantize,
    is_scale,
    scale_aliases,
)

INDEX_FILE = "model.safetensors.index.json"
# A safetensors file that may sit beside the weights without being one: the token map of
# a hot-vocabulary draft head (speculative/hot_vocab.py).
TOKEN_MAP_FILE = "draft_vocab.safetensors"
LOAD_THREADS = 8  # shard files read at once
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def _open(f: Path):
    try:
        return safe_open(f, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{f}: cannot read safetensors file ({e})") from None


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file that holds it."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such checkpoint directory")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e})") from None
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise ValueError(f"{index} names {f.name}, which does not exist")
        return files
    shards = unindexed_weight_files(path)
    if not shards:
        raise ValueError(f"{path}: no *.safetensors files (and no {INDEX_FILE})")
    names: dict[str, Path] = {}
    for f in shards:
        with _open(f) as st:
            names.update(dict.fromkeys(st.keys(), f))
    return names


def _is_packed(name: str) -> bool:
    return name.endswith(".weight" + int4.PACKED)


def _int4_config(path: Path) -> int4.Int4Config:
    qc = read_config_dict(path).get("quantization_config")
    found = int4.Int4Config.from_quantization_config(qc)
    if found is None:
        raise ValueError(
            f"{path}: the checkpoint holds INT4 pack-quantized tensors (*.weight_packed) but "
            "config.json has no compressed-tensors quantization_config"
        )
    return found


def unindexed_weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint without an index: its *.safetensors but the token map."""
    return sorted(f for f in path.glob("*.safetensors") if f.name != TOKEN_MAP_FILE)


class Checkpoint:
    """The tensors of one checkpoint directory, dequantised to a requested dtype."""

    def __init__(self, path: str | Path, fp8: Fp8Config | None = None) -> None:
        self.path = Path(path)
        stored = tensor_files(path)
        # Tensors are listed under the names the model uses: a Mistral-layout checkpoint's
        # (weights/mistral.py) and compressed-tensors' `weight_scale` scales are renamed;
        # `stored` maps such a name back to the one in the file.
        logical = mistral.name_map(list(stored)) if mistral.is_mistral_layout(path) else None
        logical = logical or {n: n for n in stored}
        for name, alias_of in scale_aliases(logical, fp8).items():
            logical[name] = logical.pop(alias_of)
        self.stored = {n: s for n, s in logical.items() if n != s}
        self.files = {n: stored[s] for n, s in logical.items()}
        self.fp8 = fp8
        self.bytes_read = 0  # by `read`, over this object's life
        self._lock = threading.Lock()
        # INT4 pack-quantized weights (weights/int4.py), listed under their logical name
        # `X.weight`, which maps to the file of `X.weight_packed`.
        self.int4: set[str] = {n[: -len(int4.PACKED)] for n in self.files if _is_packed(n)}
        # DeepSeek-V4's FP4 routed experts (weights/fp4.py): int8 `X.weight` [out, in / 2]
        # with `X.scale`, listed (and shaped) as the [out, in] weight they hold.
        fp4_experts = fp8 is not None and fp8.expert_dtype == "fp4"
        self.fp4: set[str] = {n for n in self.files if fp4_experts and fp4.EXPERT.search(n)}
        self.int4_group = 0
        if self.int4:
            self.int4_group = _int4_config(self.path).group_size
            self.files.update({n: self.files[n + int4.PACKED] for n in self.int4})

    @property
    def names(self) -> list[str]:
        """Weight names (FP8 scale tensors are part of their weight, not listed; an INT4
        weight is listed once, as `X.weight`)."""
        return [n for n in self.files if not is_scale(n) and not self._int4_part(n)]

    def describe(self, name: str) -> str:
        """`name` for an error message: with its name in the file when that differs."""
        if mistral.is_mistral_layout(self.path):
            try:
                return f"{name} ({mistral.mistral_name(name)} in Mistral's names)"
            except ValueError:
                return name
        return name if name not in self.stored else f"{name} (stored as {self.stored[name]})"

    def _int4_part(self, name: str) -> bool:
        base, _, suffix = name.rpartition("_")
        return f"_{suffix}" in int4.SUFFIXES and base in self.int4

    def tensors(
        self, names: list[str], dtype: torch.dtype | None = None, desc: str = "loading weights"
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for `names`, opening each shard once. Tensors come in `dtype`;
        with None, as stored, except FP8 weights, which come dequantised to float32."""
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.files[name]].append(name)
        with tqdm(total=len(names), desc=desc, unit="tensor", disable=None) as bar:
            for f, shard_names in by_file.items():
                with _open(f) as st:
                    for name in shard_names:
                        yield name, self._read(st, name, dtype)
                        bar.update(1)

    def _read(self, st, name: str, dtype: torch.dtype) -> torch.Tensor:
        t = self.read(st, name)
        if t.dtype != FP8:
            return t if dtype is None else t.to(dtype)
        scale = self.read_scale(st, name)
        return self._dequantize(name, t, scale, dtype or torch.float32, (0, 0))

    def read(self, st, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name` as stored, or the part `index` selects (read from the file as a
        slice: nothing else of the tensor is read). Counted in `bytes_read`. An INT4 or FP4
        weight comes dequantised to float32, whole, then sliced."""
        if name in self.int4:
            return self._read_int4(name, index)
        if name in self.fp4:
            w = self.stored_tensor(st, name)
            try:
                w = fp4.dequantize_fp4(w, self.read_scale(st, name), torch.float32)
            except ValueError as e:
                raise ValueError(f"{self.path}: FP4 tensor {name!r}: {e}") from None
            return w if index is None else w[index]
        return self.stored_tensor(st, name, index)

    def stored_tensor(self, st, name: str, index: tuple[slice, ...] | None = None):
        """`read` without dequantising INT4 or FP4: the bytes in the file."""
        key = self.stored.get(name, name)
        try:
            t = st.get_tensor(key) if index is None else st.get_slice(key)[index]
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{self.files[name]}: cannot read tensor {name!r} ({e})") from None
        with self._lock:
            self.bytes_read += t.numel() * t.element_size()
        return t

    def shape(self, st, name: str) -> tuple[int, ...]:
        if name in self.int4:
            with _open(self.files[name + int4.SHAPE]) as f:
                return tuple(int(d) for d in self.read(f, name + int4.SHAPE).tolist())
        shape = tuple(st.get_slice(self.stored.get(name, name)).get_shape())
        return (*shape[:-1], shape[-1] * 2) if name in self.fp4 else shape

    def _read_int4(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        parts = {}
        for suffix in int4.SUFFIXES:
            with _open(self.files[name + suffix]) as f:
                parts[suffix] = self.read(f, name + suffix)
        shape = tuple(int(d) for d in parts[int4.SHAPE].tolist())
        try:
            w = int4.dequantize_int4(
                parts[int4.PACKED], parts[int4.SCALE], shape, self.int4_group, torch.float32
            )
        except ValueError as e:
            raise ValueError(f"{self.path}: INT4 tensor {name!r}: {e}") from None
        return w if index is None else w[index]

    def read_scale(
        self, st, name: str, index: tuple[slice, ...] | None = None, stored: bool = False
    ) -> torch.Tensor:
        """The block scales of float8 (or FP4) weight `name` (the blocks `index` selects),
        in float32 (`stored`: as in the file; the release's are float8_e8m0fnu)."""
        scale_name = name + SCALE_SUFFIX
        if self.fp8 is None:
            raise ValueError(
                f"tensor {name!r} is float8 but config.json has no quantization_config"
            )
        if scale_name not in self.files:
            raise ValueError(f"float8 tensor {name!r} has no {scale_name!r} in the checkpoint")
        if self.files[scale_name] == self.files[name]:
            scale = self.read(st, scale_name, index)
        else:
            with _open(self.files[scale_name]) as other:
                scale = self.read(other, scale_name, index)
        if stored:
            return scale
        scale = scale.float()
        self.fp8.check_scales(name, scale)
        return scale

    def _dequantize(self, name, t, scale, dtype, offset) -> torch.Tensor:
        try:
            return dequantize(t, scale, self.fp8.block, dtype, offset)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None


@dataclass
class LoadStats:
    tensors: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        gb = self.bytes_read / 1e9
        rate = gb / self.seconds if self.seconds else 0.0
        return f"{self.tensors} tensors, {gb:.3f} GB read in {self.seconds:.1f} s ({rate:.2f} GB/s)"


def load_weights(
    model: nn.Module,
    ckpt: Checkpoint,
    select: Callable[[str], str | None] = lambda name: name,
    desc: str = "loading weights",
) -> LoadStats:
    """Copy checkpoint tensors into the model's parameters and buffers.

    `select(name)` gives the model name a checkpoint tensor loads into, or None to
    leave it (it belongs to another model, e.g. the MTP draft). Tensors held by
    another rank are not read; sharded parameters read their slice; FP8-resident
    parameters take the float8 data and their `weight_scale_inv` blocks; packed INT4
    ones their words and group scales. Shard files are read in parallel threads. Raises
    ValueError naming the first unexpected, mis-shaped or missing tensor.
    """
    remote = _remote_prefixes(model)
    wanted = {n: select(n) for n in ckpt.names}
    wanted = {n: t for n, t in wanted.items() if t is not None and not _is_remote(t, remote)}
    _dense_where_stored_dense(model, ckpt, wanted)
    targets = _unique_state(model)
    wanted = {n: _packed_target(t, targets) for n, t in wanted.items()}
    unexpected = [n for n, t in wanted.items() if t not in targets]
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise ValueError(f"{ckpt.path}: unexpected tensor(s) in checkpoint: {shown}")
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in wanted:
        by_file[ckpt.files[name]].append(name)
    start, before = time.monotonic(), ckpt.bytes_read
    loaded: set[str] = set()
    with tqdm(total=len(wanted), desc=desc, unit="tensor", disable=None) as bar:

        def read_file(f: Path) -> None:
            with _open(f) as st:
                for name in by_file[f]:
                    loaded.update(_load_one(ckpt, st, name, wanted[name], targets))
                    bar.update(1)

        with ThreadPoolExecutor(min(LOAD_THREADS, len(by_file) or 1)) as pool:
            for done in [pool.submit(read_file, f) for f in by_file]:
                done.result()
    missing = [ckpt.describe(n) for n in targets if n not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"{ckpt.path}: tensor(s) missing from checkpoint: {shown}")
    return LoadStats(len(wanted), ckpt.bytes_read - before, time.monotonic() - start)


def _load_one(ckpt: Checkpoint, st, name: str, target_name: str, targets) -> list[str]:
    """Read checkpoint tensor `name` (this rank's part of it) into `targets[target_name]`;
    the model names it filled."""
    target = targets[target_name]
    if hasattr(target, "int4"):  # `X.weight_packed` of a linear that keeps INT4 packed
        return _load_packed(ckpt, st, name, target_name, targets)
    if target.dtype == torch.int8:  # a V4 routed expert kept FP4 (weights/fp4.py Fp4Linear)
        return _load_fp4_packed(ckpt, st, name, target_name, targets)
    shard = getattr(target, "shard", None)
    expected = tuple(target.shape) if shard is None else shard.full_shape(target.shape)
    full = _checked_shape(ckpt, st, name, expected, shard)
    index = None if shard is None else _index(full, shard)
    t = ckpt.read(st, name, index)
    filled = [target_name]
    if target.dtype == FP8:  # FP8-resident: the float8 slice and its scale blocks
        if t.dtype != FP8:
            raise ValueError(
                f"{ckpt.path}: tensor {name!r} is stored as {t.dtype}, not float8, but the "
                "model keeps it FP8-resident; load with --weight_dtype bf16 (or float32)"
            )
        scale_target = targets[target_name + SCALE_SUFFIX]
        blocks = scale_target.shard
        scale = ckpt.read_scale(st, name, _block_index(blocks))
        if tuple(scale.shape) != tuple(scale_target.shape):
            raise ValueError(
                f"{ckpt.path}: {name + SCALE_SUFFIX!r} covers {tuple(scale.shape)} blocks of "
                f"this rank's slice; the model expects {tuple(scale_target.shape)}"
            )
        with torch.no_grad():
            scale_target.copy_(scale)
        filled.append(target_name + SCALE_SUFFIX)
    elif t.dtype == FP8:  # dequantised on the way, slice by slice
        offset = (0, 0) if shard is None else _offset(full, shard)
        blocks = tuple(covering(o, n, b) for o, n, b in zip(offset, t.shape, ckpt.fp8.block))
        t = ckpt._dequantize(name, t, ckpt.read_scale(st, name, blocks), torch.float32, offset)
    with torch.no_grad():
        target.copy_(t)  # copy_ casts to the target's dtype
    return filled


def _load_fp4_packed(ckpt: Checkpoint, st, name: str, target_name: str, targets) -> list[str]:
    """An FP4 expert's bytes and ue8m0 scales, copied as stored."""
    if name not in ckpt.fp4:
        raise ValueError(
            f"{ckpt.path}: tensor {name!r} is not an FP4 expert (config.json expert_dtype: "
            f"{ckpt.fp8.expert_dtype if ckpt.fp8 else None!r}), but the model keeps it packed; "
            "load with --weight_dtype auto"
        )
    filled = [target_name, target_name + SCALE_SUFFIX]
    for model_name, t in zip(
        filled, (ckpt.stored_tensor(st, name), ckpt.read_scale(st, name, stored=True))
    ):
        target = targets[model_name]
        if (t.dtype, t.shape) != (target.dtype, target.shape):
            raise ValueError(
                f"{ckpt.path}: FP4 tensor {name!r}: {model_name.rsplit('.', 1)[-1]} is "
                f"{t.dtype} {tuple(t.shape)}; the model expects {target.dtype} "
                f"{tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(t)
    return filled


def _checked_shape(ckpt: Checkpoint, st, name: str, expected: tuple, shard) -> tuple:
    """The checkpoint shape of `name`, which must be `expected` (the model's, whole)."""
    full = ckpt.shape(st, name)
    if full != expected:
        split = ""
        if shard is not None and shard.parts > 1:
            split = f" (split {shard.parts} ways on dim {shard.dim})"
        raise ValueError(
            f"{ckpt.path}: tensor {name!r} has shape {full} in the checkpoint "
            f"but the model expects {expected}{split}"
        )
    return full


def _dense_where_stored_dense(model: nn.Module, ckpt: Checkpoint, wanted: dict[str, str]) -> None:
    """An FP8-resident linear whose checkpoint tensor has no block scales (stored in a
    plain dtype), or a packed INT4 one whose tensor is not INT4, holds its weight in the
    run dtype instead."""
    for name, target in wanted.items():
        module_name, _, leaf = target.rpartition(".")
        if leaf != "weight":
            continue
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue  # not the model's: reported as unexpected below
        if not hasattr(module, "hold_dense"):
            continue
        fp8_dense = getattr(module, "block", None) and name + SCALE_SUFFIX not in ckpt.files
        int4_dense = getattr(module, "group", None) and name not in ckpt.int4
        if fp8_dense or int4_dense:
            module.hold_dense()


def _packed_target(target: str, targets: dict[str, torch.Tensor]) -> str:
    """`X.weight` of a linear that keeps INT4 packed loads into its `X.weight_packed`."""
    packed = target + int4.PACKED
    return packed if target not in targets and packed in targets else target


def _load_packed(ckpt: Checkpoint, st, name: str, target_name: str, targets) -> list[str]:
    """INT4 tensor `name` kept packed: this rank's rows and columns of its words and group
    scales, as stored (scales keep the checkpoint's dtype). A slice of the input columns
    must start on a group and on a word. Every rank's does when the slice width is a
    multiple of both; that is what is checked, on every rank alike, so all refuse together."""
    packed_t = targets[target_name]
    scale_name = target_name.removesuffix(int4.PACKED) + int4.SCALE
    scale_t, spec = targets[scale_name], packed_t.int4
    shard, group = spec.shard, spec.group_size
    expected = spec.local if shard is None else shard.full_shape(spec.local)
    full = _checked_shape(ckpt, st, name, expected, shard)
    if name not in ckpt.int4 or ckpt.int4_group != group:
        raise ValueError(
            f"{ckpt.path}: tensor {name!r} is not INT4 with group_size {group} in the "
            "checkpoint, but the model keeps it packed so (--weight_dtype int4)"
        )
    (r0, rows), (c0, cols) = _spans(full, shard)
    if cols != full[1] and cols % math.lcm(group, int4.PACK):
        raise ValueError(
            f"{ckpt.path}: INT4 tensor {name!r} {list(full)} split {shard.parts} ways on its "
            f"input dim gives each rank {cols} columns, not a multiple of its group size "
            f"{group} and of the {int4.PACK} values a packed word holds; kept packed "
            "(--weight_dtype int4), a split must fall on both. Use --weight_dtype bf16 "
            "(dequantised at load), or expert parallelism (--ep_size = --tp: experts whole)"
        )
    r, words = slice(r0, r0 + rows), slice(c0 // int4.PACK, -(-(c0 + cols) // int4.PACK))
    groups = slice(c0 // group, -(-(c0 + cols) // group))
    packed = ckpt.read(st, name + int4.PACKED, (r, words))
    with _open(ckpt.files[name + int4.SCALE]) as sf:
        scale = ckpt.read(sf, name + int4.SCALE, (r, groups))
    for got, t, part in ((packed, packed_t, int4.PACKED), (scale, scale_t, int4.SCALE)):
        if tuple(got.shape) != tuple(t.shape) or (part == int4.PACKED and got.dtype != t.dtype):
            raise ValueError(
                f"{ckpt.path}: {name + part!r}: this rank's part is {tuple(got.shape)} "
                f"{got.dtype}; the model expects {tuple(t.shape)} {t.dtype}"
            )
    with torch.no_grad():
        packed_t.copy_(packed)
        if scale.dtype == scale_t.dtype:
            scale_t.copy_(scale)
        else:  # declared bf16 (Kimi-K2-Thinking's); held in the checkpoint's own dtype
            scale_t.data = scale.to(scale_t.device)
    return [target_name, scale_name]


def _spans(full: tuple[int, int], shard) -> tuple[tuple[int, int], tuple[int, int]]:
    """((first row, rows), (first column, columns)) of this rank's part of [out, in]."""
    spans = [(0, full[0]), (0, full[1])]
    if shard is not None:
        spans[shard.dim] = shard.span(full[shard.dim])
    return spans[0], spans[1]


def _index(full: tuple[int, ...], shard) -> tuple[slice, ...]:
    start, n = shard.span(full[shard.dim])
    return tuple(
        slice(start, start + n) if d == shard.dim else slice(None) for d in range(len(full))
    )


def _offset(full: tuple[int, ...], shard) -> tuple[int, int]:
    start, _ = shard.span(full[shard.dim])
    return (start, 0) if shard.dim == 0 else (0, start)


def _block_index(blocks) -> tuple[slice, ...]:
    """The scale blocks an FP8-resident weight's slice touches (`BlockShard`)."""
    offset = blocks.offset()
    lens = (blocks.local_len(0), blocks.local_len(1))
    return tuple(covering(o, n, b) for o, n, b in zip(offset, lens, blocks.block))


def _remote_prefixes(model: nn.Module) -> set[str]:
    """Full-name prefixes (ending in '.') of weights that other ranks hold."""
    out = set()
    for mod_name, module in model.named_modules():
        for p in getattr(module, "remote_weight_prefixes", ()):
            out.add(f"{mod_name}.{p}" if mod_name else p)
    return out


def _is_remote(name: str, remote: set[str]) -> bool:
    if not remote:
        return False
    i = name.find(".")
    while i >= 0:
        if name[: i + 1] in remote:
            return True
        i = name.find(".", i + 1)
    return False


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent parameters and buffers by name; a tied tensor counts once (first name)."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out
