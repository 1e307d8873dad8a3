#!/usr/bin/env python3
"""Split the MTP layer(s) of a DeepSeek-V3 (or V4) checkpoint into a draft-model directory.

    python tools/export_deepseek_mtp.py --input-dir /path/to/DeepSeek-V3 \\
        --output-dir /path/to/DeepSeek-V3-mtp [--dtype bfloat16] [--force]

What it writes (N = num_hidden_layers of the input, j < num_nextn_predict_layers):
  model.layers.{N+j}.{attention, MoE, norms}  ->  model.layers.{j}.*
  model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.*, embed_tokens}
                                              ->  model.*   (one MTP layer, DeepSeek-V3's case)
  with several MTP layers, layer j's enorm / hnorm / eh_proj / shared_head.* stay under
  model.layers.{j}.* and one model.embed_tokens is kept.
FP8 weights are dequantised to --dtype (bfloat16 by default); the output has no
quantization_config. config.json gets num_hidden_layers = num_nextn_predict_layers,
architectures = ["DeepseekV3MtpForCausalLM"], model_type = "deepseek_v3_mtp",
first_k_dense_replace = 0; tokenizer and other non-weight files are copied.

DeepSeek-V4 keeps its MTP layers as `mtp.{j}.*` beside the target: they are written under
those names, dequantised likewise (block-FP8, and FP4 routed experts), with the target's
config.json but for architectures = ["DeepseekV4MtpForCausalLM"], model_type =
"deepseek_v4_mtp" and no quantisation fields. A V4 checkpoint whose `mtp.*` tensors are a
DSpark drafter (the 0731 releases) is refused, naming a tensor that shows it.

Only the shards that hold MTP tensors are opened. The output is written to a
temporary directory beside OUT and renamed into place at the end, so a failure
leaves nothing half-written. Errors print one line and exit 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from xllm_py.config import DEEPSEEK_V4, V4_DRAFT_PREFIX, ModelConfig, v4_draft_module  # noqa: E402
from xllm_py.models.deepseek_mtp import DRAFT_ARCHITECTURE, V4_DRAFT_ARCHITECTURE  # noqa: E402
from xllm_py.weights.fp8 import Fp8Config  # noqa: E402
from xllm_py.weights.loader import INDEX_FILE, Checkpoint, layer_index  # noqa: E402

TOP_LEVEL = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
SHARD_BYTES = 4 << 30


def export_name(name: str, n_layers: int, n_mtp: int, v4: bool = False) -> str | None:
    """Output name of an input tensor, or None if it is not part of the MTP draft."""
    if v4:
        return name if name.startswith(V4_DRAFT_PREFIX) else None
    i = layer_index(name)
    if i is None or not n_layers <= i < n_layers + n_mtp:
        return None
    j = i - n_layers
    rest = name.split(".", 3)[3]
    if rest.startswith(TOP_LEVEL):
        if n_mtp == 1 or rest.startswith("embed_tokens."):
            return None if (j and rest.startswith("embed_tokens.")) else f"model.{rest}"
    return f"model.layers.{j}.{rest}"


def export(input_dir: Path, output_dir: Path, dtype: torch.dtype, force: bool) -> dict:
    if not input_dir.is_dir():
        raise ValueError(f"--input-dir {input_dir}: no such directory")
    cfg_file = input_dir / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"--input-dir {input_dir}: no config.json")
    cfg = json.loads(cfg_file.read_text())
    n_layers = int(cfg.get("num_hidden_layers", 0))
    n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    if n_mtp < 1:
        raise ValueError(
            f"{input_dir}: num_nextn_predict_layers={n_mtp}: the checkpoint has no MTP layer"
        )
    src, dst = input_dir.resolve(), output_dir.resolve()
    if dst == src or src in dst.parents:
        raise ValueError(
            f"--output-dir {output_dir} is inside the input checkpoint; choose another"
        )
    if output_dir.exists() and not force:
        raise ValueError(f"--output-dir {output_dir} exists; pass --force to replace it")
    v4 = DEEPSEEK_V4 in (cfg.get("architectures") or [])
    ckpt = Checkpoint(input_dir, Fp8Config.from_quantization_config(_quantization(cfg, v4)))
    plan = {n: export_name(n, n_layers, n_mtp, v4) for n in ckpt.names}
    plan = {n: o for n, o in plan.items() if o is not None}
    if not plan:
        where = "mtp.*" if v4 else f"model.layers.{n_layers}"
        raise ValueError(
            f"{input_dir}: config says {n_mtp} MTP layer(s) at {where} but the "
            "checkpoint holds no such tensors"
        )
    found = v4_draft_module(list(plan)) if v4 else None
    if found is not None and found[0] == "DSpark":
        raise ValueError(
            f"{input_dir}: its mtp.* tensors are a DSpark drafter ({found[1]}), not MTP layers; "
            "there is nothing to export as an MTP draft"
        )
    shards_read = sorted({ckpt.files[n].name for n in plan})
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        summary = _write(ckpt, plan, cfg, n_mtp, tmp, dtype, input_dir)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        tmp.rename(output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary | {"shards_read": shards_read, "output_dir": str(output_dir)}


def _quantization(cfg: dict, v4: bool) -> dict | None:
    """config.json's quantization_config (V4's with its top-level expert_dtype folded in)."""
    return ModelConfig.from_dict(cfg).quantization_config if v4 else cfg.get("quantization_config")


def _write(ckpt, plan, cfg, n_mtp, out: Path, dtype, input_dir: Path) -> dict:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, tensor in ckpt.tensors(sorted(plan), desc="exporting MTP tensors"):
        if not name.endswith("e_score_correction_bias"):  # routing bias stays float32
            tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][plan[name]] = tensor.contiguous()
        size += nbytes
        total += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    draft_cfg = dict(cfg)
    draft_cfg.pop("quantization_config", None)
    draft_cfg.pop("expert_dtype", None)
    if DEEPSEEK_V4 in (cfg.get("architectures") or []):  # the target's layers, for the rows
        draft_cfg.update(architectures=[V4_DRAFT_ARCHITECTURE], model_type="deepseek_v4_mtp")
    else:
        draft_cfg.update(
            num_hidden_layers=n_mtp,
            architectures=[DRAFT_ARCHITECTURE],
            model_type="deepseek_v3_mtp",
            first_k_dense_replace=0,
        )
    draft_cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(draft_cfg, indent=2))
    copied = []
    for f in sorted(input_dir.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_FILE):
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    return {
        "tensors": len(weight_map),
        "bytes": total,
        "shards_written": len(shards),
        "mtp_layers": n_mtp,
        "copied": copied,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--input-dir",
        type=Path,
        required=True,
        help="DeepSeek-V3 or V4 checkpoint with MTP layer(s)",
    )
    ap.add_argument("--output-dir", type=Path, required=True, help="where to write the draft model")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of the written weights (FP8 inputs are dequantised to it)",
    )
    ap.add_argument("--force", action="store_true", help="replace an existing --output-dir")
    args = ap.parse_args(argv)
    try:
        s = export(args.input_dir, args.output_dir, getattr(torch, args.dtype), args.force)
    except (ValueError, OSError) as e:
        print(f"export_deepseek_mtp: error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {s['tensors']} tensors ({s['bytes'] / 2**20:.1f} MiB, {s['mtp_layers']} MTP "
        f"layer(s)) in {s['shards_written']} shard(s) to {s['output_dir']}; read "
        f"{len(s['shards_read'])} input shard(s): {', '.join(s['shards_read'])}; copied "
        f"{', '.join(s['copied']) or 'no other files'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
