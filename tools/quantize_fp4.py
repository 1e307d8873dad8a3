#!/usr/bin/env python3
"""Quantise a DeepSeek-V4 checkpoint's routed experts to FP4 as the release ships them:
e2m1 values two a byte with one ue8m0 (power-of-two) scale per 32 input columns. The
attention, shared experts, router, hyper-connections and head stay as they are, unless
--fp8-dense: then the attention's projections (wq_a, wq_b, wkv, wo_b, the indexer's wq_b;
not the grouped wo_a) and the shared experts become block-FP8 e4m3 with a ue8m0 scale per
128 x 128 block, `X.weight` float8_e4m3fn and `X.scale` float8_e8m0fnu, as the release
stores them.

    python tools/quantize_fp4.py --input-dir V4-bf16 --output-dir V4-fp4 [--fp8-dense]

Each `...ffn.experts.E.w{1,2,3}.weight` (also under `mtp.`) becomes an int8
`...w1.weight` [out, in / 2] and a float8_e8m0fnu `...w1.scale` [out, in / 32]; the layout,
and the rounding (the smallest power of two that lets each block's largest magnitude fit
6.0, then nearest e2m1 value), are xllm_py/weights/fp4.py's docstring. Every expert's input
width must be a multiple of 32. config.json says `expert_dtype: "fp4"` where the release
does (top-level, and inside quantization_config as V4.1 and HF transformers read it), with
the release's quantization_config fields; `modules_to_not_convert` names everything but the
experts, since this tool leaves the rest unquantised. Other files (tokenizer, generation
config) are copied.
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

from xllm_py.weights import fp4, fp8
from xllm_py.weights.loader import INDEX_FILE, tensor_files

# HF transformers' module names that stay unquantised: all but the routed experts (its
# `should_convert_module` matches this as a regex from the start of a module's name), and
# with --fp8-dense all but those and the DENSE modules.
NOT_EXPERTS = r"(?!.*\.experts$).*"
NOT_QUANTISED = (
    r"(?!.*\.(experts|self_attn\.(q_a_proj|q_b_proj|kv_proj|o_b_proj|compressor\.indexer\."
    r"q_b_proj)|shared_experts\.(gate_proj|up_proj|down_proj))$).*"
)  # HF's module names for the DENSE tensors
DENSE = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$"
)
FP8_BLOCK = (128, 128)


def fp8_ue8m0(t: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 e4m3 with power-of-two scales, the scales as float8_e8m0fnu bytes."""
    q, scale = fp8.quantize(t, FP8_BLOCK, "ue8m0")
    exponent = torch.log2(scale).round().int() + fp4.E8M0_BIAS
    if bool(((exponent < 0) | (exponent > 254)).any()):
        raise ValueError(f"{what}: a block scale outside ue8m0's range")
    return q, exponent.to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_file(f: Path, dst: Path, dense: bool = False) -> list[str]:
    """Write f into dst with its routed experts FP4 (and with `dense` the DENSE weights
    block-FP8); the names written."""
    out = {}
    for name, t in load_file(str(f)).items():
        expert, fp8_dense = fp4.EXPERT.search(name), dense and DENSE.search(name)
        if expert or fp8_dense:
            if not t.is_floating_point():
                raise ValueError(f"tensor {name!r} is {t.dtype}; need bfloat16/float32 weights")
            base, what = name.removesuffix(".weight"), f"tensor {name!r}"
            quantize = fp4.quantize_fp4 if expert else fp8_ue8m0
            out[name], out[base + fp4.SCALE_SUFFIX] = quantize(t, what)
        else:
            out[name] = t
    save_file(out, str(dst / f.name), metadata={"format": "pt"})
    return list(out)


def quantized_config(cfg: dict, src: Path, dense: bool = False) -> dict:
    """config.json of the output: the release's fields for FP4 experts."""
    if cfg.get("quantization_config") or fp4.expert_dtype(cfg):
        raise ValueError(f"{src}: already quantised; start from a bfloat16/float32 checkpoint")
    keep = NOT_QUANTISED if dense else NOT_EXPERTS
    qc = fp4.quantization_config({"modules_to_not_convert": [keep]})
    return {**cfg, "expert_dtype": "fp4", "quantization_config": qc}


def quantize_checkpoint(src: Path, dst: Path, dense: bool = False) -> Path:
    """Write src with its routed experts FP4 (`dense`: and the DENSE weights block-FP8)
    into dst (one file per source file)."""
    src, dst = Path(src), Path(dst)
    cfg = quantized_config(json.loads((src / "config.json").read_text()), src, dense)
    files = sorted(set(tensor_files(src).values()))
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f not in files and f.name not in (INDEX_FILE, "config.json"):
            shutil.copy(f, dst / f.name)
    weight_map = {}
    for f in tqdm(files, desc="quantising experts to FP4", unit="file", disable=None):
        weight_map.update(dict.fromkeys(quantize_file(f, dst, dense), f.name))
    if not any(n.endswith(fp4.SCALE_SUFFIX) for n in weight_map):
        raise ValueError(f"{src}: no routed expert tensors (...ffn.experts.N.w1.weight) found")
    if len(files) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--input-dir", type=Path, required=True,
        help="DeepSeek-V4 checkpoint in bfloat16/float32 (safetensors, as HF save_pretrained "
        "writes it, one file or sharded with model.safetensors.index.json)",
    )  # fmt: skip
    ap.add_argument("--output-dir", type=Path, required=True, help="directory to write")
    ap.add_argument("--force", action="store_true", help="replace an existing output directory")
    ap.add_argument(
        "--fp8-dense", action="store_true",
        help="also write the attention projections and shared experts in block-FP8 (e4m3, "
        "ue8m0 scales per 128 x 128), as the release does; default: left as they are",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if not (args.input_dir / "config.json").is_file():
        sys.exit(f"error: --input-dir={args.input_dir}: no config.json there")
    if args.output_dir.resolve() == args.input_dir.resolve():
        sys.exit(f"error: --output-dir={args.output_dir} is the input directory")
    if args.output_dir.exists():
        if not args.force:
            sys.exit(f"error: --output-dir={args.output_dir} exists (use --force to replace it)")
        shutil.rmtree(args.output_dir)
    try:
        path = quantize_checkpoint(args.input_dir, args.output_dir, args.fp8_dense)
    except ValueError as e:
        shutil.rmtree(args.output_dir, ignore_errors=True)
        sys.exit(f"error: {e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
