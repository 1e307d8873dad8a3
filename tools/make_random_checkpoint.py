#!/usr/bin/env python3
"""Write a tiny random DeepSeek-V3 checkpoint with MTP layer(s), optionally FP8 and sharded.

    python tools/make_random_checkpoint.py --output-dir /tmp/rand --fp8-block 32 32 --shards 2

The layout is DeepSeek-V3's: `model.layers.{i}` for the target, MTP layers at
`model.layers.{num_hidden_layers + j}` with enorm / hnorm / eh_proj /
shared_head.{norm,head} / embed_tokens (the last two copies of the target's).
With --fp8-block, every `*proj.weight` matrix (`kv_a_proj_with_mqa` too, as in
DeepSeek-V3's checkpoint) is stored as float8 e4m3 with a `weight_scale_inv` per block
(the default dims are not multiples of 32, so edge blocks are partial); --scale-fmt ue8m0
rounds each scale up to a power of two, as DeepSeek-V3.1 does. Weights are
fan-in-scaled normals, so activations keep trained-model magnitudes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from xllm_py.config import ModelConfig  # noqa: E402
from xllm_py.models.deepseek_mtp import DeepseekV3MTP  # noqa: E402
from xllm_py.models.deepseek_v3 import DeepseekV3ForCausalLM  # noqa: E402
from xllm_py.weights.fp8 import quantize  # noqa: E402
from xllm_py.weights.loader import INDEX_FILE  # noqa: E402

BASE_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=320,
    hidden_size=80,
    intermediate_size=144,
    moe_intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=40,
    kv_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    max_position_embeddings=512,
    rope_scaling=dict(
        type="yarn",
        factor=4.0,
        original_max_position_embeddings=128,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def tensor_shapes(cfg: dict, num_mtp: int) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint layout with its shape (from our model classes)."""
    mcfg = ModelConfig.from_dict(cfg, "<random>")
    with torch.device("meta"):
        target = DeepseekV3ForCausalLM(mcfg)
        shapes = {k: tuple(v.shape) for k, v in target.state_dict().items()}
        if num_mtp:
            draft = DeepseekV3MTP(mcfg, target, num_mtp)
            n = mcfg.num_hidden_layers
            for k, v in draft.state_dict().items():
                _, j, rest = k.split(".", 2)
                shapes[f"model.layers.{n + int(j)}.{rest}"] = tuple(v.shape)
            for j in range(num_mtp):
                shapes[f"model.layers.{n + j}.embed_tokens.weight"] = shapes[
                    "model.embed_tokens.weight"
                ]
                shapes[f"model.layers.{n + j}.shared_head.head.weight"] = shapes["lm_head.weight"]
    return shapes


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("e_score_correction_bias"):
            out[name] = torch.rand(shape, generator=g) * 0.5
        elif len(shape) == 1:
            out[name] = torch.empty(shape).uniform_(0.7, 1.3, generator=g)
        elif name.endswith("embed_tokens.weight") and name != "model.embed_tokens.weight":
            continue  # MTP copies are filled in below
        elif name.endswith("shared_head.head.weight"):
            continue
        else:
            std = 1.0 if "embed_tokens" in name else shape[-1] ** -0.5
            out[name] = torch.randn(shape, generator=g) * std
    for name in shapes:
        if name.endswith("embed_tokens.weight") and name not in out:
            out[name] = out["model.embed_tokens.weight"].clone()
        elif name.endswith("shared_head.head.weight"):
            out[name] = out["lm_head.weight"].clone()
    return out


def make_random_checkpoint(
    out: str | Path,
    overrides: dict | None = None,
    num_mtp: int = 1,
    fp8_block: tuple[int, int] | None = None,
    shards: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    scale_fmt: str | None = None,
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(BASE_CONFIG, **(overrides or {}))
    cfg["num_nextn_predict_layers"] = num_mtp
    tensors = random_tensors(tensor_shapes(cfg, num_mtp), seed)
    stored: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if fp8_block and t.dim() == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight")):
            q, scale_inv = quantize(t, fp8_block, scale_fmt)
            stored[name], stored[name + "_scale_inv"] = q, scale_inv
        else:
            stored[name] = t if name.endswith("e_score_correction_bias") else t.to(dtype)
    if fp8_block:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(fp8_block),
        } | ({"scale_fmt": scale_fmt} if scale_fmt else {})
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    names = sorted(stored)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = (
            "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        )
        save_file(
            {n: stored[n].contiguous() for n in group}, str(out / fname), metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(group, fname))
    if shards > 1:
        (out / INDEX_FILE).write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
        )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--output-dir", type=Path, required=True, help="directory to write")
    ap.add_argument(
        "--fp8-block",
        type=int,
        nargs=2,
        metavar=("ROWS", "COLS"),
        help="store *proj weights as FP8 with this block size (e.g. 128 128)",
    )
    ap.add_argument(
        "--scale-fmt",
        choices=["ue8m0"],
        help="with --fp8-block: scales rounded up to powers of two, as DeepSeek-V3.1 ships them",
    )
    ap.add_argument("--shards", type=int, default=1, help="number of safetensors shards")
    ap.add_argument("--num-mtp", type=int, default=1, help="MTP layers (num_nextn_predict_layers)")
    ap.add_argument("--seed", type=int, default=0, help="random seed")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of the non-FP8 tensors",
    )
    ap.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = ap.parse_args()
    if args.scale_fmt and not args.fp8_block:
        sys.exit("error: --scale-fmt needs --fp8-block")
    if args.output_dir.exists():
        if not args.force:
            sys.exit(f"error: {args.output_dir} exists (use --force to replace it)")
        shutil.rmtree(args.output_dir)
    path = make_random_checkpoint(
        args.output_dir,
        num_mtp=args.num_mtp,
        shards=args.shards,
        seed=args.seed,
        fp8_block=tuple(args.fp8_block) if args.fp8_block else None,
        dtype=getattr(torch, args.dtype),
        scale_fmt=args.scale_fmt,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
