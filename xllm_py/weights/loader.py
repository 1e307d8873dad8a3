"""Read safetensors checkpoints into models whose parameter names mirror them.

One tensor at a time (`safe_open` + `get_tensor`), so peak memory is the model
plus one tensor. Single-file and sharded (`model.safetensors.index.json`)
layouts are both accepted; FP8 block-quantised weights are dequantised on the
way (`weights.fp8`). Every mismatch is an error that names the tensor:
unexpected names, missing names, shapes (checkpoint vs model), unreadable or
missing shard files.

Tensor/expert parallel models load the same checkpoint on every rank: a
parameter with a `shard` (models/layers/linear.py `Shard`) takes its slice of
the full, dequantised tensor; a module listing `remote_weight_prefixes` (MoE
under expert parallelism) names the weights another rank holds, which are
skipped here.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from xllm_py.weights.fp8 import SCALE_SUFFIX, Fp8Config, dequantize, is_scale

INDEX_FILE = "model.safetensors.index.json"
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
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{path}: no *.safetensors files (and no {INDEX_FILE})")
    names: dict[str, Path] = {}
    for f in shards:
        with _open(f) as st:
            names.update(dict.fromkeys(st.keys(), f))
    return names


class Checkpoint:
    """The tensors of one checkpoint directory, dequantised to a requested dtype."""

    def __init__(self, path: str | Path, fp8: Fp8Config | None = None) -> None:
        self.path = Path(path)
        self.files = tensor_files(path)
        self.fp8 = fp8

    @property
    def names(self) -> list[str]:
        """Weight names (FP8 scale tensors are part of their weight, not listed)."""
        return [n for n in self.files if not is_scale(n)]

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
        try:
            t = st.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{self.files[name]}: cannot read tensor {name!r} ({e})") from None
        if t.dtype != torch.float8_e4m3fn:
            return t if dtype is None else t.to(dtype)
        scale_name = name + SCALE_SUFFIX
        if self.fp8 is None:
            raise ValueError(
                f"tensor {name!r} is float8 but config.json has no quantization_config"
            )
        if scale_name not in self.files:
            raise ValueError(f"float8 tensor {name!r} has no {scale_name!r} in the checkpoint")
        if self.files[scale_name] == self.files[name]:
            scale = st.get_tensor(scale_name)
        else:
            with _open(self.files[scale_name]) as other:
                scale = other.get_tensor(scale_name)
        try:
            return dequantize(t, scale, self.fp8.block, dtype or torch.float32)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None


def load_weights(
    model: nn.Module,
    ckpt: Checkpoint,
    select: Callable[[str], str | None] = lambda name: name,
) -> None:
    """Copy checkpoint tensors into the model's parameters and buffers.

    `select(name)` gives the model name a checkpoint tensor loads into, or None to
    leave it (it belongs to another model, e.g. the MTP draft). Tensors held by
    another rank are left too; sharded parameters get their slice. Raises ValueError
    naming the first unexpected, mis-shaped or missing tensor.
    """
    targets = _unique_state(model)
    remote = _remote_prefixes(model)
    wanted = {n: select(n) for n in ckpt.names}
    wanted = {n: t for n, t in wanted.items() if t is not None and not _is_remote(t, remote)}
    unexpected = [n for n, t in wanted.items() if t not in targets]
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise ValueError(f"{ckpt.path}: unexpected tensor(s) in checkpoint: {shown}")
    loaded = set()
    for name, tensor in ckpt.tensors(list(wanted)):  # copy_ casts to each target's dtype
        target = targets[wanted[name]]
        shard = getattr(target, "shard", None)
        expected = tuple(target.shape) if shard is None else shard.full_shape(target.shape)
        if tuple(tensor.shape) != expected:
            split = (
                f" (split {shard.parts} ways on dim {shard.dim})"
                if shard and shard.parts > 1
                else ""
            )
            raise ValueError(
                f"{ckpt.path}: tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint "
                f"but the model expects {expected}{split}"
            )
        if shard is not None:
            tensor = shard.take(tensor)
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(wanted[name])
    missing = [n for n in targets if n not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"{ckpt.path}: tensor(s) missing from checkpoint: {shown}")


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
