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

With --dp_attention (tp 1, ep = devices) each of the N ranks is a replica for all but the
routed experts: attention with every head over its own requests, their latents only;
dense layers, shared experts, embedding and lm_head whole on every rank; the routed
experts partitioned over all N, reached by all-to-all. A token's latent is then stored on
one rank instead of on each of a TP replica's ranks. The plan prints that layout beside
the TP/EP one on the same devices (tp = ep = N): weights, KV bytes a cached token costs
each rank, token capacity, and the bytes a token sends per decode step (`Traffic`).

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

from xllm_py.args import EngineArgs
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


_ENGINE_ARGS = {f.name: f for f in fields(EngineArgs)}


def _engine_opt(name: str, more: str = ""):
    """An option the engine has too: its default and help are EngineArgs' (one declaration,
    one default), with what the plan adds."""
    f = _ENGINE_ARGS[name]
    return _opt(f.default, f.metadata["help"] + more)


@dataclass(frozen=True)
class Options:
    """The plan's inputs; each is a flag of the same name (`--help` shows the texts)."""

    # fmt: off
    model: str = _opt(None, "checkpoint directory: config.json and safetensors files (only "
                      "their headers are read, so a header-only replica will do)")
    devices: int = _opt(None, "devices in the cluster")
    tp: int = _opt(0, "tensor-parallel ranks per replica (0: --devices, or 1 with "
                   "--dp_attention); must divide --devices; dp = devices / tp replicas")
    ep: int = _opt(0, "expert-parallel size (0: 1, or --devices with --dp_attention): 1 "
                   "(every expert split over tp) or --tp (each rank holds n_routed_experts "
                   "/ ep experts whole); with --dp_attention only --devices")
    dp_attention: bool = _opt(False, "DP attention (SGLang's --enable-dp-attention; vLLM's "
                              "--data-parallel-size N --enable-expert-parallel): each of "
                              "the --devices ranks runs attention with every head for its "
                              "own requests and caches only their tokens; dense layers, "
                              "shared experts, embedding and lm_head whole on every rank; "
                              "routed experts partitioned over all ranks (tp 1, ep = "
                              "devices). Also prints the TP layout (tp = ep = devices) and "
                              "each layout's bytes sent per token per step")
    device_memory_gb: float = _opt(64.0, "memory of one device, in GiB")
    max_memory_utilization: float = _engine_opt("max_memory_utilization", ". The plan: "
                                                "of the device's memory, weights included")
    activation_reserve_gb: float = _opt(2.0, "GiB per rank set aside for activations and the "
                                        "runtime (a guess; the engine measures its peak)")
    block_size: int = _engine_opt("block_size")
    num_speculative_tokens: int = _engine_opt("num_speculative_tokens", "; > 0 loads the MTP "
                                              "layer(s), each with its own KV cache layer")
    weight_dtype: str = _engine_opt("weight_dtype", ". Priced here as: fp8 = 1 byte/element "
                                    "+ float32 block scales, the rest bf16; int4 = 0.5 "
                                    "byte/element + bf16 group scales, the rest bf16; auto = "
                                    "fp8 or int4 as config.json's quantization_config says "
                                    "(what the engine does on CUDA), else bf16. Compute and "
                                    "KV cache dtype: bf16 (float32 with float32)")
    # fmt: on

    @property
    def dp(self) -> int:
        return self.devices // self.tp


@dataclass(frozen=True)
class Traffic:
    """Bytes one token sends between ranks in one decode step, through the target's
    decoder layers in the compute dtype (each MTP draft pass adds one layer's worth; the
    TP layout's embedding all-reduce and logits all-gather are not counted).

    TP/EP (tp > 1): every layer sums the token's hidden state over the replica twice,
    after o_proj and after the MLP or MoE: 2 x layers x hidden x bytes. That is the
    all-reduce's payload; a ring all-reduce moves 2 (tp - 1) / tp of it out of each rank.

    DP attention + EP over N ranks: every MoE layer sends the token's hidden state to the
    ranks of its top_k experts (dispatch) and gets their outputs back (combine), one row
    per (token, expert); with the experts spread evenly, (N - 1) / N of the top_k rows
    leave the rank: 2 x top_k x hidden x bytes x (N - 1) / N per MoE layer. Attention and
    dense layers send nothing."""

    layers: int
    moe_layers: int
    hidden_size: int
    top_k: int
    dtype_bytes: int

    def all_reduce(self, tp: int) -> int:
        return 2 * self.layers * self.hidden_size * self.dtype_bytes if tp > 1 else 0

    def all_to_all(self, ranks: int) -> float:
        row = self.hidden_size * self.dtype_bytes
        return 2 * self.moe_layers * self.top_k * row * (ranks - 1) / ranks


@dataclass
class Plan:
    opts: Options  # tp, ep and weight_dtype resolved (no 0 / auto)
    totals: dict[str, int]  # parameter counts from the headers
    tensors: list[RankTensor] = field(repr=False)  # what rank 0 holds
    cache_layers: int
    kv_bytes_per_token: int
    max_model_len: int
    # what a cached token holds per layer, in elements: the MLA latent, the roped key, and
    # under DSA (DeepSeek-V3.2) the indexer's key beside them
    kv_parts: dict[str, int] = field(default_factory=dict)
    traffic: Traffic | None = None  # (make_plan sets it)
    # with --dp_attention: the TP/EP layout on the same devices, or why it cannot be built
    tp_layout: Plan | str | None = field(default=None, repr=False)

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
        """Whole blocks that fit; a replica's ranks all hold the same tokens' latents (under
        DP attention a replica, for attention, is one rank). One request's tokens are in
        one replica: this is the most one request can hold."""
        return max(0, self.kv_budget // self.kv_bytes_per_block) * self.opts.block_size

    @property
    def cluster_tokens(self) -> int:
        return self.tokens_per_replica * self.opts.dp

    @property
    def kv_copies(self) -> int:
        """Ranks that store each cached token: all tp ranks of its replica, or one rank
        under DP attention."""
        return 1 if self.opts.dp_attention else self.opts.tp

    @property
    def kv_bytes_per_token_per_rank(self) -> float:
        """What a token of the cluster's cache costs each device on average: its bytes x
        the ranks that store it / the devices. TP16: every rank stores every token whole
        (the full bytes); DP attention over 16: one rank stores it (1/16 of them)."""
        return self.kv_bytes_per_token * self.kv_copies / self.opts.devices

    @property
    def all_reduce_bytes_per_token(self) -> int:
        return 0 if self.opts.dp_attention else self.traffic.all_reduce(self.opts.tp)

    @property
    def all_to_all_bytes_per_token(self) -> float:
        return self.traffic.all_to_all(self.opts.devices) if self.opts.dp_attention else 0

    @property
    def bytes_sent_per_token(self) -> float:
        """What all ranks send for one token in one step: the all-to-all's rows, or the
        ring all-reduce's 2 (tp - 1) / tp x the payload from each of the tp ranks."""
        return self.all_to_all_bytes_per_token + self.all_reduce_bytes_per_token * 2 * (
            self.opts.tp - 1
        )


def read_headers(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor, from the shard files' headers
    (8-byte little-endian length, then JSON); no tensor data is read."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        # (each file name once before it becomes a Path: the map names a file per tensor)
        names = set(json.loads(index.read_text())["weight_map"].values())
        files = sorted({path / f for f in names})
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


def build_meta(cfg: ModelConfig, tp: int, ep: int, k: int, dtype: torch.dtype, dp: int = 1):
    """Rank 0's target (and draft when k > 0) on the meta device; errors name the flag.
    dp > 1: DP attention over dp ranks (tp 1, ep = dp), as the engine builds it."""
    if dp == 1 and ep not in (1, tp):
        raise ValueError(f"--ep={ep}: must be 1 or equal to --tp={tp}")
    ctx = ParallelContext(ep_size=ep, dp_size=dp) if dp > 1 else ParallelContext(0, tp, ep)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # what a worker does when it builds its model
    try:
        with torch.device("meta"):
            target = DeepseekV3ForCausalLM(cfg, ctx)
            draft = DeepseekV3MTP(cfg, target, cfg.num_nextn_predict_layers) if k else None
    except ValueError as e:
        flag = (
            f"--devices={dp}" if dp > 1 else f"--ep={ep}" if "ep_size" in str(e) else f"--tp={tp}"
        )
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
    return _make_plan(Options(str(model), devices, **options))


def _make_plan(o: Options, read: tuple[ModelConfig, dict] | None = None) -> Plan:
    """make_plan for `o`; `read`: the checkpoint's config and headers where a plan of the
    same checkpoint has read them already (the TP layout beside a DP-attention plan)."""
    model, devices = o.model, o.devices
    (tp, ep), mu = _layout(o), o.max_memory_utilization
    if not 0 < mu <= 1:
        raise ValueError(f"--max_memory_utilization={mu}: must be in (0, 1]")
    if o.block_size < 1:
        raise ValueError(f"--block_size={o.block_size}: must be >= 1")
    cfg = read[0] if read else ModelConfig.from_pretrained(model)
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
    o = replace(o, tp=tp, ep=ep, weight_dtype=wd)
    headers = read[1] if read else read_headers(model)
    dp = devices if o.dp_attention else 1
    target, draft = build_meta(cfg, tp, ep, o.num_speculative_tokens, _COMPUTE[wd], dp)
    cache_layers = target.num_cache_layers + (len(draft.layers) if draft is not None else 0)
    plan = Plan(
        o,
        totals=header_totals(headers, cfg),
        tensors=rank_tensors(cfg, headers, target, draft, wd),
        cache_layers=cache_layers,
        kv_bytes_per_token=cache_layers * cfg.kv_cache_dim * _COMPUTE[wd].itemsize,
        kv_parts={"latent": cfg.kv_lora_rank, "roped key": cfg.qk_rope_head_dim}
        | ({"indexer key": cfg.index_head_dim} if cfg.index_head_dim else {}),
        max_model_len=cfg.max_position_embeddings,
        traffic=Traffic(
            cfg.num_hidden_layers,
            sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers))),
            cfg.hidden_size,
            cfg.num_experts_per_tok,
            _COMPUTE[wd].itemsize,
        ),
    )
    if o.dp_attention:
        plan.tp_layout = _tp_layout(o, (cfg, headers))
    return plan


def _layout(o: Options) -> tuple[int, int]:
    """--tp and --ep resolved (0: their defaults) and checked against --devices."""
    n, dpa = o.devices, o.dp_attention
    tp, ep = o.tp or (1 if dpa else n), o.ep or (n if dpa else 1)
    if n < 1:
        raise ValueError(f"--devices={n}: must be >= 1")
    if dpa and tp != 1:
        raise ValueError(
            f"--tp={tp}: with --dp_attention every rank runs attention with all heads "
            "(tp 1); leave --tp out"
        )
    if dpa and ep != n:
        raise ValueError(
            f"--ep={ep}: with --dp_attention the routed experts are partitioned over all "
            f"--devices={n} ranks; leave --ep out"
        )
    if tp < 1 or n % tp:
        raise ValueError(f"--tp={tp}: must divide --devices={n} (dp = devices / tp)")
    return tp, ep


def _tp_layout(o: Options, read: tuple[ModelConfig, dict]) -> Plan | str:
    """The TP/EP plan (tp = ep = devices) for the same options, or why it cannot be built;
    `read`: the checkpoint's config and headers, read once for both layouts."""
    try:
        return _make_plan(replace(o, tp=o.devices, ep=o.devices, dp_attention=False), read)
    except ValueError as e:
        return str(e)


_KIND_NOTES = {
    "attention": "self_attn.*: heads split over tp; + the w_uk/w_uv copies",
    "dense": "dense-layer MLPs and shared experts: split over tp",
    "experts": "routed experts (E/ep whole per rank, or split over tp) + router",
    "embedding/head": "embed_tokens and lm_head, as the model holds them",
    "MTP": "the MTP layer(s)' own tensors (embedding/head shared)",
    "norms/rope": "decoder and final norms (+ float32 scales), rope tables",
}

_DP_NOTES = _KIND_NOTES | {
    "attention": "self_attn.*: every head, whole on every rank; + the w_uk/w_uv copies",
    "dense": "dense-layer MLPs and shared experts: whole on every rank",
    "experts": "routed experts (E/ep whole per rank) + router",
    "embedding/head": "embed_tokens and lm_head: whole on every rank",
}


def format_plan(p: Plan) -> str:
    o, t = p.opts, {k: f"{v / 1e9:8.2f} B" for k, v in p.totals.items()}
    kv_dtype = str(_COMPUTE[o.weight_dtype]).removeprefix("torch.")
    split = f"tp {o.tp}, ep {o.ep}, dp {o.dp}"
    if o.dp_attention:
        split = f"DP attention: dp {o.dp} ranks of tp 1, ep {o.ep}"
    lines = [
        f"memory plan: {o.model}  (from the safetensors headers; nothing loaded)",
        f"layout: {o.devices} devices x {o.device_memory_gb:g} GiB; {split}; weights "
        f"{o.weight_dtype}; KV cache {kv_dtype}; MTP k = {o.num_speculative_tokens}",
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
        f"weights per rank (every rank of {'the cluster' if o.dp_attention else 'a replica'}"
        " holds the same)",
    ]
    notes = _DP_NOTES if o.dp_attention else _KIND_NOTES
    for kind in KINDS + ("total",):
        note = notes.get(kind, "")
        lines.append(f"  {kind:15s} {p.rank_bytes(kind) / GIB:8.2f} GiB   {note}".rstrip())
    lines += ["", *_kv_lines(p, kv_dtype)]
    return "\n".join(lines + (["", *_comparison(p)] if o.dp_attention else []))


def _kv_lines(p: Plan, kv_dtype: str) -> list[str]:
    o, per_token, per_block = p.opts, p.kv_bytes_per_token, p.kv_bytes_per_block
    kv_el = _COMPUTE[o.weight_dtype].itemsize
    parts = " + ".join(f"{n} {k}" for k, n in p.kv_parts.items())
    where = (
        "each rank holds its own requests' tokens" if o.dp_attention else "full on every tp rank"
    )
    lines = [
        f"KV cache ({' + '.join(p.kv_parts)}, {kv_dtype}; {where})",
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
        hint = "more devices, or raise --tp"
        if o.dp_attention:
            hint = "larger devices: more devices shrink only the experts"
        return lines + [f"  does not fit: no room for one KV block ({hint})"]
    tokens = p.tokens_per_replica
    return lines + [
        f"  {'rank' if o.dp_attention else 'replica':11s}{tokens // o.block_size:,} blocks = "
        f"{tokens:,} tokens ({tokens / p.max_model_len:.2f} x the {p.max_model_len:,}-token "
        "context)",
        f"  cluster    x dp {o.dp} = {p.cluster_tokens:,} tokens",
    ]


def _gib(v: float) -> str:
    return f"{v / GIB:.2f} GiB" if v >= 0 else "does not fit"


def _count(v: float) -> str:
    return f"{v:,.0f}"


# (label, format, value): the rows of the two layouts' comparison
_ROWS = (
    ("weights per rank", _gib, Plan.rank_bytes),
    ("KV cache per rank", _gib, lambda q: q.kv_budget),
    ("KV bytes per token per rank", lambda v: f"{v:,.0f} B",
     lambda q: q.kv_bytes_per_token_per_rank),
    ("tokens in the cluster", _count, lambda q: q.cluster_tokens),
    ("tokens one request can hold", _count, lambda q: q.tokens_per_replica),
    ("all-reduce bytes per token per step", _count, lambda q: q.all_reduce_bytes_per_token),
    ("all-to-all bytes per token per step", _count, lambda q: q.all_to_all_bytes_per_token),
    ("sent by all ranks, per token per step", _count, lambda q: q.bytes_sent_per_token),
)  # fmt: skip


def _comparison(p: Plan) -> list[str]:
    """The DP-attention plan beside the TP/EP one on the same devices, and the formulas."""
    tr, n = p.traffic, p.opts.devices
    title = f"DP attention beside TP/EP on the same {n} devices (tp {n}, ep {n}, dp 1)"
    plans, head = [p.tp_layout, p], f"{'TP/EP':>16s}{'DP attention':>16s}"
    if isinstance(p.tp_layout, str):
        title = f"DP attention on {n} devices (TP/EP there cannot be built: {p.tp_layout})"
        plans, head = [p], f"{'DP attention':>16s}"
    lines = [
        title,
        f"  {'':38s}{head}",
        *(f"  {label:38s}" + "".join(f"{fmt(value(q)):>16s}" for q in plans)
          for label, fmt, value in _ROWS),
    ]  # fmt: skip
    el = tr.dtype_bytes
    return lines + [
        f"  KV bytes per token per rank: {p.kv_bytes_per_token:,} B x the ranks storing a token "
        f"(TP: its replica's {n}; DP attention: 1) / {n} devices",
        f"  all-reduce: 2 a layer (after o_proj, after the MLP or MoE) x {tr.layers} layers x "
        f"hidden {tr.hidden_size} x {el} B (the payload)",
        f"  all-to-all: 2 (dispatch, combine) x top_k {tr.top_k} x hidden {tr.hidden_size} x "
        f"{el} B x ({n} - 1) / {n} leaving the rank x {tr.moe_layers} MoE layers",
        f"  sent by all ranks: the all-to-all's bytes, or, for a ring all-reduce, {n} ranks x "
        f"2 ({n} - 1) / {n} x its payload",
        "  (a token through the target's layers; each MTP draft pass adds one layer's worth)",
    ]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m xllm_py.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for f in fields(Options):
        if f.type == "bool":
            ap.add_argument(f"--{f.name}", action="store_true", help=f.metadata["help"])
            continue
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
