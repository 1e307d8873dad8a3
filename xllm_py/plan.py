"""A memory plan read from a checkpoint's headers, before any hardware is bought.

    python -m xllm_py.plan --model DIR --devices 16 --tp 16 --ep 16 --device_memory_gb 64

prints, without loading a weight:
  - parameter totals from the safetensors headers: the main model, the MTP layer(s), the
    parameters one token activates;
  - weight bytes per rank by kind (attention, dense, experts, embedding/head, MTP,
    norms/rope), sharded as the engine shards them: the model is built on the `meta`
    device with `ParallelContext(tp_rank=0, tp_size=tp, ep_size=ep)` and each of its
    tensors is priced by its local shape (every rank of a replica holds the same amount);
  - KV cache bytes per token and per block, and the tokens that fit per replica and in
    the cluster at --max_memory_utilization.

What stays resident after `process_weights_after_loading` is added explicitly: the MLA
absorbed-decode copies `w_uk`/`w_uv` (one copy of kv_b_proj, in the compute dtype) and
each RMSNorm's float32 `scale`; fused matrices (w_in, w13, w2) replace their parts.
Weights are priced by --weight_dtype: fp8 = a tensor the checkpoint stores with a
`weight_scale_inv` costs 1 byte/element plus float32 block scales of its local shape;
int4 = a tensor the checkpoint stores INT4 pack-quantized (Kimi-K2-Thinking's routed
experts) costs its int32 words, 0.5 byte/element, plus bf16 group scales of its local
shape (the dtype Kimi-K2-Thinking stores them in, which the engine keeps); everything
else the bf16 compute dtype (or its own dtype where the model fixes one: the float32
router, the rope tables). Not counted: FP8-resident weights' int64 block index maps
(tens of MB), runtime buffers (in --activation_reserve_gb). Every line of the output
is defined in docs/memory_plan.md.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from xllm_py.config import ModelConfig, read_config_dict
from xllm_py.models.deepseek_mtp import DeepseekV3MTP
from xllm_py.models.deepseek_v3 import DeepseekV3ForCausalLM
from xllm_py.models.layers.mla import MLAttention
from xllm_py.models.layers.norm import RMSNorm
from xllm_py.parallel.context import ParallelContext
from xllm_py.weights import int4
from xllm_py.weights.fp8 import SCALE_SUFFIX, Fp8Config, scale_aliases
from xllm_py.weights.loader import INDEX_FILE, layer_index, unindexed_weight_files
from xllm_py.weights.mistral import is_mistral_layout
from xllm_py.weights.mistral import name_map as mistral_names

KINDS = ("attention", "dense", "experts", "embedding/head", "MTP", "norms/rope")
GIB = 2**30
_COMPUTE = {
    "fp8": torch.bfloat16,
    "int4": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class RankTensor:
    name: str  # checkpoint name (or the name of a post-processing copy)
    kind: str
    shape: tuple[int, ...]  # this rank's shape
    nbytes: int


def _opt(default, text: str):
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class Options:
    """The plan's inputs; each is a flag of the same name (`--help` shows the texts)."""

    # fmt: off
    model: str = _opt(None, "checkpoint directory: config.json and safetensors files (only "
                      "their headers are read, so a header-only replica will do)")
    devices: int = _opt(None, "devices in the cluster")
    tp: int = _opt(0, "tensor-parallel ranks per replica (0: --devices); must divide "
                   "--devices; dp = devices / tp replicas")
    ep: int = _opt(1, "expert-parallel size: 1 (every expert split over tp) or --tp (each "
                   "rank holds n_routed_experts / ep experts whole)")
    device_memory_gb: float = _opt(64.0, "memory of one device, in GiB")
    max_memory_utilization: float = _opt(0.9, "fraction of a device's memory the engine may "
                                         "use, weights included")
    activation_reserve_gb: float = _opt(2.0, "GiB per rank set aside for activations and the "
                                        "runtime (a guess; the engine measures its peak)")
    block_size: int = _opt(128, "tokens per KV cache block")
    num_speculative_tokens: int = _opt(1, "MTP draft tokens; > 0 loads the MTP layer(s), "
                                       "each with its own KV cache layer; 0: no draft")
    weight_dtype: str = _opt("auto", "auto | fp8 | int4 | bf16 | float32. fp8: tensors "
                             "stored FP8 stay FP8 (1 byte/element + float32 block scales), "
                             "the rest bf16; int4: tensors stored INT4 pack-quantized stay "
                             "packed (0.5 byte/element + bf16 group scales), the rest bf16; "
                             "bf16, float32: everything in that dtype; auto: fp8 or int4 as "
                             "config.json's quantization_config says (what the engine does "
                             "on CUDA), else bf16. Compute and KV cache dtype: bf16 "
                             "(float32 with float32)")
    # fmt: on

    @property
    def dp(self) -> int:
        return self.devices // self.tp


@dataclass
class Plan:
    opts: Options  # tp and weight_dtype resolved (no 0 / auto)
    totals: dict[str, int]  # parameter counts from the headers
    tensors: list[RankTensor] = field(repr=False)  # what rank 0 holds
    cache_layers: int
    kv_bytes_per_token: int
    max_model_len: int
    # what a cached token holds per layer, in elements: the MLA latent, the roped key, and
    # under DSA (DeepSeek-V3.2) the indexer's key beside them
    kv_parts: dict[str, int] = field(default_factory=dict)

    def rank_bytes(self, kind: str = "total") -> int:
        return sum(t.nbytes for t in self.tensors if kind in ("total", t.kind))

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.opts.block_size

    @property
    def kv_budget(self) -> int:
        """Bytes left for the KV cache on each rank (negative: the weights do not fit)."""
        o = self.opts
        allowed = int(o.device_memory_gb * GIB * o.max_memory_utilization)
        return allowed - self.rank_bytes() - int(o.activation_reserve_gb * GIB)

    @property
    def tokens_per_replica(self) -> int:
        """Whole blocks that fit; a replica's ranks all hold the same tokens' latents."""
        return max(0, self.kv_budget // self.kv_bytes_per_block) * self.opts.block_size


def read_headers(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor, from the shard files' headers
    (8-byte little-endian length, then JSON); no tensor data is read."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = unindexed_weight_files(path)
    if not files:
        raise ValueError(f"--model={str(path)!r}: no *.safetensors files (and no {INDEX_FILE})")
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        header.pop("__metadata__", None)
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()})
    if is_mistral_layout(path):  # under the model's names, as the loader lists them
        out = {hf: out[stored] for hf, stored in mistral_names(list(out)).items()}
    fp8 = Fp8Config.from_quantization_config(read_config_dict(path).get("quantization_config"))
    for name, stored in scale_aliases(out, fp8).items():
        out[name] = out.pop(stored)
    return _fold_int4(out)


def _fold_int4(headers: dict) -> dict:
    """An INT4 pack-quantized weight (weights/int4.py: `X.weight_packed` int32 [out, in / 8]
    with its `_scale` and `_shape`) as the one logical `X.weight` [out, 8 x words] the model
    holds (its true width is in `_shape`'s data, which a plan does not read; checkpoints'
    widths are multiples of 8)."""
    for name in [n for n in headers if n.endswith(".weight" + int4.PACKED)]:
        base = name.removesuffix(int4.PACKED)
        rows, words = headers.pop(name)[1]
        headers.pop(base + int4.SCALE, None), headers.pop(base + int4.SHAPE, None)
        headers[base] = ("I4", (rows, words * int4.PACK))
    return headers


def kind_of(name: str, num_hidden_layers: int) -> str:
    i = layer_index(name)
    if i is not None and i >= num_hidden_layers:
        return "MTP"
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embedding/head"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name or ".mlp.gate." in name:
        return "experts"
    return "dense" if ".mlp." in name else "norms/rope"


def header_totals(headers, cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts (elements; FP8 scale tensors counted apart, as `scales`)."""
    n = cfg.num_hidden_layers
    t = dict.fromkeys(("main", "mtp", "mtp_copies", "routed", "embedding", "scales"), 0)
    for name, (_, shape) in headers.items():
        numel, i = math.prod(shape), layer_index(name)
        if name.endswith(SCALE_SUFFIX):
            t["scales"] += numel
        elif i is not None and i >= n:
            t["mtp"] += numel
            if "embed_tokens" in name or "shared_head.head" in name:
                t["mtp_copies"] += numel
        else:
            t["main"] += numel
            t["routed"] += numel if ".mlp.experts." in name else 0
            t["embedding"] += numel if name == "model.embed_tokens.weight" else 0
    t["mtp_unique"], t["stored"] = t["mtp"] - t["mtp_copies"], t["main"] + t["mtp"]
    inactive = t["routed"] * (cfg.n_routed_experts - cfg.num_experts_per_tok)
    t["activated"] = t["main"] - t["embedding"] - inactive // max(cfg.n_routed_experts, 1)
    return t


def build_meta(cfg: ModelConfig, tp: int, ep: int, k: int, dtype: torch.dtype):
    """Rank 0's target (and draft when k > 0) on the meta device; errors name the flag."""
    if ep not in (1, tp):
        raise ValueError(f"--ep={ep}: must be 1 or equal to --tp={tp}")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # what a worker does when it builds its model
    try:
        with torch.device("meta"):
            target = DeepseekV3ForCausalLM(cfg, ParallelContext(0, tp, ep))
            draft = DeepseekV3MTP(cfg, target, cfg.num_nextn_predict_layers) if k else None
    except ValueError as e:
        flag = f"--ep={ep}" if "ep_size" in str(e) else f"--tp={tp}"
        raise ValueError(f"{flag}: {e}") from None
    finally:
        torch.set_default_dtype(old)
    return target, draft


def rank_tensors(cfg, headers, target, draft, weight_dtype: str) -> list[RankTensor]:
    """Every tensor rank 0 keeps resident, priced; shapes checked against the headers."""
    n, out = cfg.num_hidden_layers, []
    compute = _COMPUTE[weight_dtype].itemsize
    fp8, i4 = _quantization(cfg)
    for module, first in [(target, None)] + ([(draft.layers, n)] if draft is not None else []):

        def add(local: str, shape, nbytes: int, first=first) -> None:
            name = _checkpoint_name(local, first)
            out.append(RankTensor(name, kind_of(name, n), tuple(shape), nbytes))

        for local, t in [*module.named_parameters(), *module.named_buffers()]:
            name = _checkpoint_name(local, first)
            if not name.endswith(SCALE_SUFFIX):  # (scales are priced with their weight)
                _check_shape(name, t, headers)
                stored = "fp8" if name + SCALE_SUFFIX in headers else headers.get(name, ("",))[0]
                add(local, t.shape, _price(t, stored, fp8, i4, weight_dtype))
        for local, m in module.named_modules():  # what process_weights_after_loading adds
            if isinstance(m, RMSNorm):  # its float32 `scale`
                add(f"{local}.scale", m.weight.shape, m.weight.numel() * 4)
            elif isinstance(m, MLAttention):  # w_uk and w_uv: one more copy of kv_b_proj
                w = m.kv_b_proj.weight
                add(f"{local}.w_uk+w_uv", w.shape, w.numel() * compute)
    return out


def _checkpoint_name(local: str, first_layer: int | None) -> str:
    """A target name as it is; a draft layer's "j.rest" -> "model.layers.{first + j}.rest"."""
    if first_layer is None:
        return local
    j, rest = local.split(".", 1)
    return f"model.layers.{first_layer + int(j)}.{rest}"


def _quantization(cfg: ModelConfig) -> tuple[Fp8Config | None, int4.Int4Config | None]:
    """The checkpoint's FP8 or INT4 scheme (at most one is not None)."""
    fp8 = Fp8Config.from_quantization_config(cfg.quantization_config)
    return fp8, None if fp8 else int4.Int4Config.from_quantization_config(cfg.quantization_config)


def _price(
    t: torch.Tensor,
    stored: str,
    fp8: Fp8Config | None,
    i4: int4.Int4Config | None,
    weight_dtype: str,
) -> int:
    """Resident bytes of a tensor of this rank's shape. `stored`: "fp8" for a tensor the
    checkpoint stores with block scales, else its header dtype ("I4": INT4 packed)."""
    if weight_dtype == "fp8" and stored == "fp8":  # 1 byte/element + float32 block scales
        rows, cols = t.shape
        return t.numel() + math.ceil(rows / fp8.block[0]) * math.ceil(cols / fp8.block[1]) * 4
    if weight_dtype == "int4" and stored == "I4":  # int32 words + bf16 group scales
        rows, cols = t.shape
        words, groups = math.ceil(cols / int4.PACK), math.ceil(cols / i4.group_size)
        return rows * words * 4 + rows * groups * 2
    if t.dtype in (torch.bfloat16, torch.float16) or t.dtype.itemsize == 1:
        return t.numel() * _COMPUTE[weight_dtype].itemsize  # built in the compute dtype
    return t.numel() * t.element_size()  # a dtype the model fixes (float32 router, rope)


def _check_shape(name: str, t: torch.Tensor, headers) -> None:
    if name not in headers:
        if name.startswith("rotary."):  # the rope tables: computed, not loaded
            return
        raise ValueError(f"tensor {name!r} of the model is missing from the checkpoint headers")
    shard = getattr(t, "shard", None)
    expected = tuple(t.shape) if shard is None else shard.full_shape(tuple(t.shape))
    if headers[name][1] != expected:
        raise ValueError(
            f"tensor {name!r} has shape {headers[name][1]} in the checkpoint but the model "
            f"expects {expected}"
        )


def make_plan(model: str | Path, devices: int, **options) -> Plan:
    """The plan for `model` on `devices` devices; `options`: the other `Options` fields.
    Raises ValueError naming the bad flag."""
    o = Options(str(model), devices, **options)
    tp, mu = o.tp or devices, o.max_memory_utilization
    if devices < 1:
        raise ValueError(f"--devices={devices}: must be >= 1")
    if tp < 1 or devices % tp:
        raise ValueError(f"--tp={tp}: must divide --devices={devices} (dp = devices / tp)")
    if not 0 < mu <= 1:
        raise ValueError(f"--max_memory_utilization={mu}: must be in (0, 1]")
    if o.block_size < 1:
        raise ValueError(f"--block_size={o.block_size}: must be >= 1")
    cfg = ModelConfig.from_pretrained(model)
    # FP8 weights can stay FP8 and INT4 ones packed (weights/int4.py), as the engine's
    # auto does on CUDA.
    fp8, i4 = _quantization(cfg)
    kept = "fp8" if fp8 else "int4" if i4 else None
    wd = o.weight_dtype
    wd = (kept or "bf16") if wd == "auto" else wd
    if wd not in _COMPUTE or (wd in ("fp8", "int4") and wd != kept):
        raise ValueError(
            f"--weight_dtype={wd}: use auto, bf16, float32, fp8 (with an FP8 "
            "quantization_config in config.json) or int4 (with an INT4 compressed-tensors one)"
        )
    if o.num_speculative_tokens and not cfg.num_nextn_predict_layers:
        raise ValueError(f"--num_speculative_tokens={o.num_speculative_tokens}: no MTP layer")
    o = replace(o, tp=tp, weight_dtype=wd)
    headers = read_headers(model)
    target, draft = build_meta(cfg, tp, o.ep, o.num_speculative_tokens, _COMPUTE[wd])
    cache_layers = target.num_cache_layers + (len(draft.layers) if draft is not None else 0)
    return Plan(
        o,
        totals=header_totals(headers, cfg),
        tensors=rank_tensors(cfg, headers, target, draft, wd),
        cache_layers=cache_layers,
        kv_bytes_per_token=cache_layers * cfg.kv_cache_dim * _COMPUTE[wd].itemsize,
        kv_parts={"latent": cfg.kv_lora_rank, "roped key": cfg.qk_rope_head_dim}
        | ({"indexer key": cfg.index_head_dim} if cfg.index_head_dim else {}),
        max_model_len=cfg.max_position_embeddings,
    )


_KIND_NOTES = {
    "attention": "self_attn.*: heads split over tp; + the w_uk/w_uv copies",
    "dense": "dense-layer MLPs and shared experts: split over tp",
    "experts": "routed experts (E/ep whole per rank, or split over tp) + router",
    "embedding/head": "embed_tokens and lm_head, as the model holds them",
    "MTP": "the MTP layer(s)' own tensors (embedding/head shared)",
    "norms/rope": "decoder and final norms (+ float32 scales), rope tables",
}


def format_plan(p: Plan) -> str:
    o, t = p.opts, {k: f"{v / 1e9:8.2f} B" for k, v in p.totals.items()}
    kv_dtype = str(_COMPUTE[o.weight_dtype]).removeprefix("torch.")
    lines = [
        f"memory plan: {o.model}  (from the safetensors headers; nothing loaded)",
        f"layout: {o.devices} devices x {o.device_memory_gb:g} GiB; tp {o.tp}, ep {o.ep}, "
        f"dp {o.dp}; weights {o.weight_dtype}; KV cache {kv_dtype}; MTP k = "
        f"{o.num_speculative_tokens}",
        "",
        "parameters (elements of the checkpoint's tensors; FP8 block scales not counted)",
        f"  main model: embedding, decoder layers, norm, head   {t['main']}",
        "  activated per token: main model with top_k of the",
        f"    routed experts, head counted, embedding not       {t['activated']}",
        f"  MTP layer(s), own tensors                           {t['mtp_unique']}",
        f"  MTP layer(s) with their embedding/head copies       {t['mtp']}",
        f"  checkpoint: main model + MTP layer(s)               {t['stored']}"
        f"  (+ {p.totals['scales'] / 1e9:.3f} B float32 FP8 scales)",
        "",
        "weights per rank (every rank of a replica holds the same)",
    ]
    for kind in KINDS + ("total",):
        note = _KIND_NOTES.get(kind, "")
        lines.append(f"  {kind:15s} {p.rank_bytes(kind) / GIB:8.2f} GiB   {note}".rstrip())
    return "\n".join(lines + ["", *_kv_lines(p, kv_dtype)])


def _kv_lines(p: Plan, kv_dtype: str) -> list[str]:
    o, per_token, per_block = p.opts, p.kv_bytes_per_token, p.kv_bytes_per_block
    kv_el = _COMPUTE[o.weight_dtype].itemsize
    parts = " + ".join(f"{n} {k}" for k, n in p.kv_parts.items())
    lines = [
        f"KV cache ({' + '.join(p.kv_parts)}, {kv_dtype}; full on every tp rank)",
        f"  per token  {p.cache_layers} cache layers x ({parts}) x "
        f"{kv_el} B = {per_token:,} B ({per_token / 1024:.1f} KiB)",
        *(
            f"    {k:12s} {p.cache_layers * n * kv_el:,} B a token"
            for k, n in p.kv_parts.items()
            if len(p.kv_parts) > 2
        ),
        f"  per block  {o.block_size} tokens = {per_block:,} B ({per_block / 2**20:.2f} MiB)",
        "",
        f"capacity at --max_memory_utilization {o.max_memory_utilization:g}",
        f"  per rank   {o.max_memory_utilization:g} x {o.device_memory_gb:g} GiB - weights "
        f"{p.rank_bytes() / GIB:.2f} GiB - activation reserve {o.activation_reserve_gb:g} GiB"
        f" = {p.kv_budget / GIB:.2f} GiB for the KV cache",
    ]
    if p.kv_budget < per_block:
        return lines + ["  does not fit: no room for one KV block (more devices, or raise --tp)"]
    tokens = p.tokens_per_replica
    return lines + [
        f"  replica    {tokens // o.block_size:,} blocks = {tokens:,} tokens "
        f"({tokens / p.max_model_len:.2f} x the {p.max_model_len:,}-token context)",
        f"  cluster    x dp {o.dp} = {tokens * o.dp:,} tokens",
    ]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m xllm_py.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for f in fields(Options):
        required, typ = f.default is None, {"int": int, "float": float}.get(f.type, str)
        shown = "" if required or not f.default else f" (default {f.default})"
        ap.add_argument(
            f"--{f.name}", type=typ, default=f.default, required=required,
            help=f.metadata["help"] + shown,
        )  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    opts = vars(ap.parse_args(argv))
    try:
        plan = make_plan(opts.pop("model"), opts.pop("devices"), **opts)
    except ValueError as e:
        ap.exit(2, f"error: {e}\n")
    print(format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
