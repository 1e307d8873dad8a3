#!/usr/bin/env python3
"""Quantise a checkpoint's routed experts to INT4 in compressed-tensors' `pack-quantized`
layout, as Kimi-K2-Thinking ships them (weights only, symmetric, one scale per group of
--group-size input columns; attention, shared experts, dense MLPs and the head stay as
they are).

    python tools/quantize_int4.py --input-dir K2 --output-dir K2-INT4 --group-size 32

Each `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` becomes `weight_packed`
(int32, eight values a word), `weight_scale` (bfloat16) and `weight_shape`; the layout is
xllm_py/weights/int4.py's docstring. config.json gets the quantization_config that
describes it. Other files (tokenizer, generation config) are copied.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from xllm_py.weights.int4 import PACKED, SCALE, SHAPE, quantization_config, quantize_int4
from xllm_py.weights.loader import tensor_files

EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def quantize_checkpoint(src: Path, dst: Path, group_size: int = 32) -> Path:
    """Write src with its routed experts INT4 into dst (one file per source file)."""
    dst.mkdir(parents=True)
    files = sorted(set(tensor_files(src).values()))
    for f in src.iterdir():
        if f.is_file() and f not in files and not f.name.endswith("index.json"):
            shutil.copy(f, dst / f.name)
    weight_map = {}
    for f in tqdm(files, desc="quantising", unit="file", disable=None):
        out = {}
        for name, t in load_file(str(f)).items():
            if EXPERT.search(name):
                packed, scale = quantize_int4(t, group_size)
                out[name + PACKED], out[name + SCALE] = packed, scale.to(torch.bfloat16)
                out[name + SHAPE] = torch.tensor(list(t.shape), dtype=torch.int64)
            else:
                out[name] = t
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, f.name))
    if len(files) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise ValueError(f"{src}: already quantised; start from a bfloat16/float32 checkpoint")
    cfg["quantization_config"] = quantization_config(group_size)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--input-dir", type=Path, required=True, help="bf16/float32 checkpoint")
    ap.add_argument("--output-dir", type=Path, required=True, help="directory to write")
    ap.add_argument("--group-size", type=int, default=32, help="input columns per scale")
    ap.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = ap.parse_args()
    if args.group_size <= 0:
        sys.exit(f"error: --group-size={args.group_size} must be > 0")
    if args.output_dir.exists():
        if not args.force:
            sys.exit(f"error: {args.output_dir} exists (use --force to replace it)")
        shutil.rmtree(args.output_dir)
    try:
        path = quantize_checkpoint(args.input_dir, args.output_dir, args.group_size)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
