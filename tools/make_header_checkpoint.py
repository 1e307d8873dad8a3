#!/usr/bin/env python3
"""Write a header-only replica of DeepSeek-V3's checkpoint: its config.json, its
`model.safetensors.index.json` over 163 shard files, and shard files whose safetensors
headers list every tensor (name, dtype, shape, offsets) exactly as the real checkpoint
does, while the data regions are sparse holes: nothing is written but the headers, so
the ~685 GB replica takes a few MB of disk.

    python tools/make_header_checkpoint.py --output-dir /tmp/deepseek-v3-headers
    python -m xllm_py.plan --model /tmp/deepseek-v3-headers --devices 16 --tp 16 --ep 16
    python tools/make_header_checkpoint.py --family kimi-k2 --shards 64 --output-dir /tmp/k2

--family replicates another DeepSeek-V3-family checkpoint from its published config:
deepseek-v3.1 (ue8m0 scales), deepseek-v2, deepseek-v2-lite, moonlight-16b-a3b (bfloat16,
no q-LoRA), kimi-k2 (FP8, 384 experts, no MTP) or kimi-k2-thinking (INT4 routed experts,
the rest bfloat16).

What it is for: tools that read only the headers (`python -m xllm_py.plan`). Reading a
tensor gives zeros. The layout is the one tools/make_random_checkpoint.py writes and the
loader reads (MTP layer at `model.layers.{num_hidden_layers + j}` with enorm, hnorm,
eh_proj, shared_head.{norm,head} and its copy of embed_tokens), with DeepSeek-V3's
dtypes: every projection matrix of the decoder layers is float8 e4m3 with a float32
`weight_scale_inv` per 128x128 block; embedding, head, norms, the router and the MTP
eh_proj are bfloat16; the router's e_score_correction_bias is float32. The shapes are
written out here from the config, not taken from this engine's model classes, so the
plan's check of the model's shapes against these headers is an independent one.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import struct
import sys
from pathlib import Path

from xllm_py.weights.int4 import quantization_config

INDEX_FILE = "model.safetensors.index.json"
DTYPE_BYTES = {"F8_E4M3": 1, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}

# DeepSeek-V3's published config.json (the fields this engine or the plan read, and the
# rest of its architecture fields; auto_map and transformers_version left out).
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


# The other DeepSeek-V3-family checkpoints, as their published config.json files differ from
# DeepSeek-V3's (architecture fields only); each is written with its own dtypes: FP8 blocks
# where it has a quantization_config, bfloat16 matrices where not.
_BF16_ONLY = {"quantization_config": None, "num_nextn_predict_layers": 0}
FAMILIES: dict[str, dict] = {
    "deepseek-v3": {},
    "deepseek-v3.1": {
        "quantization_config": dict(DEEPSEEK_V3_CONFIG["quantization_config"], scale_fmt="ue8m0")
    },
    "deepseek-v2": _BF16_ONLY | {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 5120, "num_hidden_layers": 60, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "n_routed_experts": 160, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "n_group": 8, "topk_group": 3, "first_k_dense_replace": 1,
        "vocab_size": 102400, "routed_scaling_factor": 16.0, "norm_topk_prob": False,
        "scoring_func": "softmax", "topk_method": "group_limited_greedy",
        "rope_scaling": dict(DEEPSEEK_V3_CONFIG["rope_scaling"], mscale=0.707,
                             mscale_all_dim=0.707),
    },
    "deepseek-v2-lite": _BF16_ONLY | {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "vocab_size": 102400, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
        "scoring_func": "softmax", "topk_method": "greedy",
        "rope_scaling": dict(DEEPSEEK_V3_CONFIG["rope_scaling"], mscale=0.707,
                             mscale_all_dim=0.707),
    },
    "moonlight-16b-a3b": _BF16_ONLY | {
        "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "intermediate_size": 11264,
        "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "vocab_size": 163840, "routed_scaling_factor": 2.446, "rope_scaling": None,
        "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
    },
    "kimi-k2-thinking": {
        "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "vocab_size": 163840, "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0,
        "rope_theta": 50000.0, "max_position_embeddings": 262144,
        "rope_scaling": dict(DEEPSEEK_V3_CONFIG["rope_scaling"], factor=64.0, beta_fast=1.0,
                             beta_slow=1.0),
        "quantization_config": quantization_config(32),  # INT4 routed experts, the rest BF16
    },
    "deepseek-v3.2": {  # V3.2-Exp: V3 plus DSA's lightning indexer in every layer
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
    },
    "kimi-k2": {
        "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "vocab_size": 163840, "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0,
        "rope_theta": 50000.0, "max_position_embeddings": 131072,
        "rope_scaling": dict(DEEPSEEK_V3_CONFIG["rope_scaling"], factor=32.0, beta_fast=1.0,
                             beta_slow=1.0),
    },
}  # fmt: skip


def family_config(name: str) -> dict:
    """config.json of `name` (a key of FAMILIES); a None value writes no key, except
    q_lora_rank, which the published configs of models without q-LoRA write as null."""
    if name not in FAMILIES:
        raise ValueError(f"family {name!r}: expected one of {sorted(FAMILIES)}")
    cfg = DEEPSEEK_V3_CONFIG | FAMILIES[name]
    return {k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}


def _fp8(name: str, out_dim: int, in_dim: int, block: tuple[int, int] | None):
    """A float8 matrix and its float32 block scales, as (name, dtype, shape) rows; a bfloat16
    matrix where the checkpoint is not quantised (block None)."""
    if block is None:
        yield name, "BF16", [out_dim, in_dim]
        return
    b0, b1 = block
    yield name, "F8_E4M3", [out_dim, in_dim]
    yield name + "_scale_inv", "F32", [-(-out_dim // b0), -(-in_dim // b1)]


def _int4(name: str, out_dim: int, in_dim: int, group: int):
    """An INT4 pack-quantized matrix (xllm_py/weights/int4.py) as (name, dtype, shape) rows."""
    yield name + "_packed", "I32", [out_dim, -(-in_dim // 8)]
    yield name + "_scale", "BF16", [out_dim, -(-in_dim // group)]
    yield name + "_shape", "I64", [2]


def _mlp(prefix: str, hidden: int, inter: int, block, int4_group: int = 0):
    matrix = functools.partial(_int4, group=int4_group) if int4_group else _fp8
    args = () if int4_group else (block,)
    yield from matrix(f"{prefix}.gate_proj.weight", inter, hidden, *args)
    yield from matrix(f"{prefix}.up_proj.weight", inter, hidden, *args)
    yield from matrix(f"{prefix}.down_proj.weight", hidden, inter, *args)


def _layer(cfg: dict, i: int, block):
    """Tensors of decoder layer i: MLA, then the dense MLP or the MoE, then the two norms."""
    h, p = cfg["hidden_size"], f"model.layers.{i}"
    heads, q_rank, kv_rank = cfg["num_attention_heads"], cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    a = f"{p}.self_attn"
    if q_rank:
        yield from _fp8(f"{a}.q_a_proj.weight", q_rank, h, block)
        yield f"{a}.q_a_layernorm.weight", "BF16", [q_rank]
        yield from _fp8(f"{a}.q_b_proj.weight", heads * qk, q_rank, block)
    else:  # no q-LoRA (V2-Lite, Moonlight)
        yield from _fp8(f"{a}.q_proj.weight", heads * qk, h, block)
    yield from _fp8(f"{a}.kv_a_proj_with_mqa.weight", kv_rank + cfg["qk_rope_head_dim"], h, block)
    yield f"{a}.kv_a_layernorm.weight", "BF16", [kv_rank]
    kv_b_out = heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
    yield from _fp8(f"{a}.kv_b_proj.weight", kv_b_out, kv_rank, block)
    yield from _fp8(f"{a}.o_proj.weight", h, heads * cfg["v_head_dim"], block)
    if cfg.get("index_topk"):  # DeepSeek-V3.2's lightning indexer
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        yield from _fp8(f"{a}.indexer.wq_b.weight", ih * idim, q_rank, block)
        yield from _fp8(f"{a}.indexer.wk.weight", idim, h, block)
        yield f"{a}.indexer.k_norm.weight", "BF16", [idim]
        yield f"{a}.indexer.k_norm.bias", "BF16", [idim]
        yield f"{a}.indexer.weights_proj.weight", "BF16", [ih, h]
    if i < cfg["first_k_dense_replace"] or i % cfg["moe_layer_freq"]:
        yield from _mlp(f"{p}.mlp", h, cfg["intermediate_size"], block)
    else:
        E, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        yield f"{p}.mlp.gate.weight", "BF16", [E, h]
        if cfg.get("topk_method", "noaux_tc") == "noaux_tc":
            yield f"{p}.mlp.gate.e_score_correction_bias", "F32", [E]
        qc = cfg.get("quantization_config") or {}
        groups = qc.get("config_groups", {}).values()
        int4_group = next((g["weights"]["group_size"] for g in groups), 0)
        for e in range(E):
            yield from _mlp(f"{p}.mlp.experts.{e}", h, inter, block, int4_group)
        yield from _mlp(f"{p}.mlp.shared_experts", h, inter * cfg["n_shared_experts"], block)
    yield f"{p}.input_layernorm.weight", "BF16", [h]
    yield f"{p}.post_attention_layernorm.weight", "BF16", [h]


def checkpoint_tensors(cfg: dict) -> list[tuple[str, str, list[int]]]:
    """(name, safetensors dtype, shape) of every tensor, in checkpoint order."""
    qc = cfg.get("quantization_config")
    block = tuple(qc["weight_block_size"]) if qc and "weight_block_size" in qc else None
    h, vocab, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    out = [("model.embed_tokens.weight", "BF16", [vocab, h])]
    for i in range(n):
        out += _layer(cfg, i, block)
    for j in range(cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{n + j}"
        out.append((f"{p}.embed_tokens.weight", "BF16", [vocab, h]))  # copy of the target's
        out.append((f"{p}.enorm.weight", "BF16", [h]))
        out.append((f"{p}.hnorm.weight", "BF16", [h]))
        out.append((f"{p}.eh_proj.weight", "BF16", [h, 2 * h]))
        out += _layer(cfg, n + j, block)
        out.append((f"{p}.shared_head.norm.weight", "BF16", [h]))
        out.append((f"{p}.shared_head.head.weight", "BF16", [vocab, h]))  # copy of lm_head
    out.append(("model.norm.weight", "BF16", [h]))
    out.append(("lm_head.weight", "BF16", [vocab, h]))
    return out


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n


def write_header_file(path: Path, tensors: list[tuple[str, str, list[int]]]) -> int:
    """A safetensors file with these tensors laid out back to back; the data region is a
    hole (the file is extended with truncate, not written). Returns the data bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        size = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)
    return offset


def make_header_checkpoint(out: str | Path, shards: int = 163, config: dict | None = None) -> Path:
    """Write the replica into `out` (created if needed); returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(DEEPSEEK_V3_CONFIG if config is None else config)
    tensors = checkpoint_tensors(cfg)
    total = sum(_nbytes(d, s) for _, d, s in tensors)
    groups: list[list] = [[] for _ in range(shards)]
    done = 0
    for t in tensors:  # shard k gets the tensors that start in the k-th equal slice of bytes
        groups[min(shards - 1, done * shards // total)].append(t)
        done += _nbytes(t[1], t[2])
    if any(not g for g in groups):
        raise ValueError(f"shards={shards}: too many for {len(tensors)} tensors of these sizes")
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{shards:06d}.safetensors"
        write_header_file(out / fname, group)
        weight_map.update({name: fname for name, _, _ in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--output-dir", type=Path, required=True, help="directory to write")
    ap.add_argument("--shards", type=int, default=163, help="shard files (DeepSeek-V3: 163)")
    ap.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        default="deepseek-v3",
        help="whose published config and dtypes to replicate",
    )
    ap.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = ap.parse_args()
    if args.output_dir.exists():
        if not args.force:
            sys.exit(f"error: {args.output_dir} exists (use --force to replace it)")
        shutil.rmtree(args.output_dir)
    path = make_header_checkpoint(args.output_dir, args.shards, family_config(args.family))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
