"""Load safetensors checkpoints into a model whose parameter names mirror them.

Reads one tensor at a time (`safe_open` + `get_tensor`), so peak memory is the
model plus one tensor. Single-file and sharded (`model.safetensors.index.json`)
layouts are both accepted. Every mismatch is an error that names the tensor:
unexpected names, missing names, and shapes (checkpoint vs model).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

INDEX_FILE = "model.safetensors.index.json"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file that holds it."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={str(path)!r}: no *.safetensors files (and no {INDEX_FILE})")
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            names.update(dict.fromkeys(st.keys(), f))
    return names


def iter_tensors(
    files: dict[str, Path], names: list[str], desc: str = "loading weights"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for `names`, opening each shard once, with a progress bar."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in names:
        by_file[files[name]].append(name)
    with tqdm(total=len(names), desc=desc, unit="tensor", disable=None) as bar:
        for f, shard_names in by_file.items():
            with safe_open(f, framework="pt") as st:
                for name in shard_names:
                    yield name, st.get_tensor(name)
                    bar.update(1)


def layer_index(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def load_weights(
    model: nn.Module,
    path: str | Path,
    skip: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy every checkpoint tensor into the parameter or buffer of the same name.

    `skip(name)` drops tensors that belong to another model (e.g. MTP layers).
    Raises ValueError naming the first unexpected, mis-shaped or missing tensor.
    """
    targets = _unique_state(model)
    files = tensor_files(path)
    names = [n for n in files if not skip(n)]
    unexpected = [n for n in names if n not in targets]
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise ValueError(f"{path}: unexpected tensor(s) in checkpoint: {shown}")
    loaded = set()
    for name, tensor in iter_tensors(files, names):
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint "
                f"but the model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name)
    missing = [n for n in targets if n not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"{path}: tensor(s) missing from checkpoint: {shown}")


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent parameters and buffers by name; a tied tensor counts once (first name)."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out
