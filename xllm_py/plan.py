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

DeepSeek-V4 (`--model v4-flash`, `--model v4-pro`, or a V4 checkpoint directory) goes the
same way with its own layers: the release's tensor names (`layers.N.attn.wq_a.weight` with
its `.scale`, `mtp.0.*`) are read under the names of models/deepseek_v4.py, each shape is
checked against that model built on the meta device, and each tensor is sharded by name
(`_v4_local`) as an engine would shard it (heads and output groups over tp; the shared K=V
projection, compressors and indexer whole, as the V3.2 indexer is). Its KV cache is priced
per layer kind (`_v4_cache`): every layer keeps its last `sliding_window` tokens' entries and
its compressors' pending tokens (bytes per request, whatever its length); a CSA layer adds
one entry and one indexer key per 4 tokens, an HCA layer one entry per 128. Entries are
priced in the compute dtype (bf16), as HF transformers' DeepseekV4 cache and this engine's
MLA cache hold them, so the V3.2 comparison is like for like; the release's FP8 entry layout
(448 e4m3 + 8 scale bytes + 64 bf16 = 584 B, indexer key 128 e4m3 + a float32 scale = 132 B,
as DeepSeek's inference code and SGLang store them) is printed beside. `--compare_with` plans
a second checkpoint (a V3.2 replica) on the same flags and prints both at `--context` tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import struct
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from xllm_py.args import EngineArgs
from xllm_py.config import DEEPSEEK_V4, ModelConfig, read_config_dict
from xllm_py.models.deepseek_mtp import DeepseekV3MTP
from xllm_py.models.deepseek_v3 import DeepseekV3ForCausalLM
from xllm_py.models.deepseek_v4 import (
    CSA,
    HCA,
    SLIDING,
    DecoderLayer,
    DeepseekV4ForCausalLM,
    V4Config,
)
from xllm_py.models.layers.mla import MLAttention
from xllm_py.models.layers.norm import RMSNorm
from xllm_py.parallel.context import ParallelContext
from xllm_py.weights import fp4, int4
from xllm_py.weights.fp8 import SCALE_SUFFIX, Fp8Config, scale_aliases
from xllm_py.weights.loader import INDEX_FILE, layer_index, unindexed_weight_files
from xllm_py.weights.mistral import is_mistral_layout
from xllm_py.weights.mistral import name_map as mistral_names

KINDS = ("attention", "dense", "experts", "embedding/head", "MTP", "norms/rope")
GIB = 2**30
FP4 = "F4"  # V4's FP4 experts, as read_headers lists them (their logical shape)
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
                      "their headers are read, so a header-only replica will do); or v4-flash "
                      "or v4-pro: DeepSeek-V4's published config and a header replica of its "
                      "release (FP8 weights, FP4 routed experts) built in memory")
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
    context: int = _opt(131072, "tokens of one request, for the per-request lines: the KV "
                        "bytes it holds, per token, and how many such requests fit")
    compare_with: str = _opt("", "a second --model (e.g. a DeepSeek-V3.2 header replica from "
                             "tools/make_header_checkpoint.py --family deepseek-v3.2) planned "
                             "with the same flags and printed beside this one at --context "
                             "tokens")
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


@dataclass(frozen=True)
class CacheGroup:
    """Cache layers of one kind and what each holds for a request: one entry per `ratio`
    tokens (`entry`: its bytes by part; none for a layer that keeps only a sliding window),
    and `state` bytes whatever the request's length (V4: the window's entries and the
    compressors' pending tokens). A block of block_size tokens holds ceil(block_size /
    ratio) entries of each layer: MLA (ratio 1) one a token, V4's CSA (4) block_size / 4,
    its HCA (128) one per 128 tokens."""

    kind: str
    layers: int
    ratio: int = 1
    entry: dict[str, int] = field(default_factory=dict)
    state: int = 0
    window: int = 0  # V4: the latest tokens whose entries `state` keeps

    def bytes_per_block(self, block_size: int) -> int:
        if not self.entry:
            return 0
        return self.layers * math.ceil(block_size / self.ratio) * sum(self.entry.values())


def _block_bytes(cache: tuple[CacheGroup, ...], block_size: int) -> int:
    return sum(g.bytes_per_block(block_size) for g in cache)


def _tokens(budget: int, per_block: int, block_size: int) -> int:
    """Tokens in the whole blocks that fit in `budget` bytes."""
    return max(0, budget // per_block) * block_size if per_block else 0


@dataclass
class Plan:
    opts: Options  # tp, ep and weight_dtype resolved (no 0 / auto)
    totals: dict[str, int]  # parameter counts from the headers
    tensors: list[RankTensor] = field(repr=False)  # what rank 0 holds
    cache: tuple[CacheGroup, ...]  # the cache layers, by kind
    max_model_len: int
    family: str = "DeepSeek-V3"  # or "DeepSeek-V4": which notes and KV lines to print
    # V3 family: what a cached token holds per layer, in elements: the MLA latent, the roped
    # key, and under DSA (DeepSeek-V3.2) the indexer's key beside them
    kv_parts: dict[str, int] = field(default_factory=dict)
    # V4: the same layers held other ways, printed beside (label -> cache)
    other_caches: dict[str, tuple[CacheGroup, ...]] = field(default_factory=dict)
    traffic: Traffic | None = None  # (make_plan sets it)
    # with --dp_attention: the TP/EP layout on the same devices, or why it cannot be built
    tp_layout: Plan | str | None = field(default=None, repr=False)
    compared: Plan | None = field(default=None, repr=False)  # --compare_with's plan

    def rank_bytes(self, kind: str = "total") -> int:
        return sum(t.nbytes for t in self.tensors if kind in ("total", t.kind))

    @property
    def cache_layers(self) -> int:
        return sum(g.layers for g in self.cache)

    @property
    def kv_bytes_per_block(self) -> int:
        return _block_bytes(self.cache, self.opts.block_size)

    @property
    def kv_bytes_per_token(self) -> int | float:
        """A block's bytes per token of it (an int where they divide evenly)."""
        whole, rest = divmod(self.kv_bytes_per_block, self.opts.block_size)
        return self.kv_bytes_per_block / self.opts.block_size if rest else whole

    @property
    def kv_state_per_request(self) -> int:
        """Bytes a request holds whatever its length (0 for MLA)."""
        return sum(g.layers * g.state for g in self.cache)

    def request_bytes(self, tokens: int) -> int:
        """KV bytes one request of `tokens` tokens holds: its blocks and its fixed state."""
        blocks = math.ceil(tokens / self.opts.block_size)
        return self.kv_state_per_request + blocks * self.kv_bytes_per_block

    def requests_per_replica(self, tokens: int) -> int:
        return max(0, self.kv_budget // self.request_bytes(tokens))

    @property
    def max_window(self) -> int:
        """V4: the tokens each layer's window keeps (0 without one)."""
        return max((g.window for g in self.cache), default=0)

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
        return _tokens(self.kv_budget, self.kv_bytes_per_block, self.opts.block_size)

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
    raw = read_config_dict(path)
    if is_v4(raw):
        return v4_names(out, raw["num_hidden_layers"])
    fp8 = Fp8Config.from_quantization_config(raw.get("quantization_config"))
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
    """The kind of a tensor by its name: V3's (`self_attn`, `mlp`) or V4's (`attn`, `ffn`)."""
    i = layer_index(name)
    if i is not None and i >= num_hidden_layers:
        return "MTP"
    if "embed_tokens" in name or name.startswith(("lm_head", "head.")):
        return "embedding/head"
    if ".self_attn." in name or ".attn." in name:
        return "attention"
    if _is_routed(name) or ".mlp.gate." in name or ".ffn.gate." in name:
        return "experts"
    return "dense" if ".mlp." in name or ".ffn." in name else "norms/rope"


def _is_routed(name: str) -> bool:
    return ".mlp.experts." in name or ".ffn.experts." in name


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
            t["routed"] += numel if _is_routed(name) else 0
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
    try:
        with _on_meta(dtype):
            target = DeepseekV3ForCausalLM(cfg, ctx)
            draft = DeepseekV3MTP(cfg, target, cfg.num_nextn_predict_layers) if k else None
    except ValueError as e:
        flag = (
            f"--devices={dp}" if dp > 1 else f"--ep={ep}" if "ep_size" in str(e) else f"--tp={tp}"
        )
        raise ValueError(f"{flag}: {e}") from None
    return target, draft


@contextlib.contextmanager
def _on_meta(dtype: torch.dtype):
    """Build modules on the meta device in `dtype`, as a worker builds its model."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.set_default_dtype(old)


def rank_tensors(cfg, headers, target, draft, weight_dtype: str) -> list[RankTensor]:
    """Every tensor rank 0 keeps resident, priced; shapes checked against the headers."""
    n, out = cfg.num_hidden_layers, []
    compute = _COMPUTE[weight_dtype].itemsize
    fp8, i4 = _quantization(cfg.quantization_config)
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


def _quantization(qc: dict | None) -> tuple[Fp8Config | None, int4.Int4Config | None]:
    """A quantization_config's FP8 or INT4 scheme (at most one is not None)."""
    fp8 = Fp8Config.from_quantization_config(qc)
    return fp8, None if fp8 else int4.Int4Config.from_quantization_config(qc)


def _price(
    t: torch.Tensor,
    stored: str,
    fp8: Fp8Config | None,
    i4: int4.Int4Config | None,
    weight_dtype: str,
) -> int:
    """Resident bytes of a tensor of this rank's shape. `stored`: "fp8" for a tensor the
    checkpoint stores with block scales, else its header dtype ("I4": INT4 packed; "F4":
    FP4 e2m1 packed two a byte, V4's routed experts)."""
    if weight_dtype == "fp8" and stored == "fp8":  # 1 byte/element + float32 block scales
        rows, cols = t.shape
        return t.numel() + math.ceil(rows / fp8.block[0]) * math.ceil(cols / fp8.block[1]) * 4
    if weight_dtype == "int4" and stored == "I4":  # int32 words + bf16 group scales
        rows, cols = t.shape
        words, groups = math.ceil(cols / int4.PACK), math.ceil(cols / i4.group_size)
        return rows * words * 4 + rows * groups * 2
    if weight_dtype == "fp8" and stored == FP4:  # V4's experts: e2m1 pairs + ue8m0 scales
        rows, cols = t.shape  # (the scales as stored: the byte an FP4 GEMM reads)
        return rows * math.ceil(cols / 2) + rows * math.ceil(cols / fp4.BLOCK)
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


# ---- DeepSeek-V4 ------------------------------------------------------------------------------


def _v4_ratios(first: list[int], layers: int) -> list[int]:
    """The release's per-layer `compress_ratios`: `first`, then CSA (4) and HCA (128)
    alternating, ending on CSA, then 0 (sliding window only) for the MTP layer."""
    return first + [4 if i % 2 == 0 else 128 for i in range(layers - len(first))] + [0]


# DeepSeek-V4-Flash's config.json as released (the fields the plan and models/deepseek_v4.py
# read, in the release's spellings: compress_ratios, num_hash_layers, qk_rope_head_dim).
V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "sliding_window": 128, "compress_ratios": _v4_ratios([0, 0], 43), "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
}  # fmt: skip
# DeepSeek-V4-Pro: 61 layers, hidden 7168, 128 heads, 384 experts top-6, two HCA layers first
# (HF transformers' V4 config documents o_groups 16 and o_lora_rank 1024 for it). Assumed,
# in V4-Flash's proportions: q_lora_rank 1536 (V3's), moe_intermediate_size 3072; the rest as
# V4-Flash. With them the replica holds 1.57 T parameters and 48.8 B activated (published:
# ~1.6 T and 49 B).
V4_PRO = V4_FLASH | {
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "q_lora_rank": 1536, "o_groups": 16, "n_routed_experts": 384,
    "moe_intermediate_size": 3072, "compress_ratios": _v4_ratios([128, 128], 61),
}  # fmt: skip
V4_REPLICAS = {"v4-flash": V4_FLASH, "v4-pro": V4_PRO}
_FP8_ENTRIES = "the release's FP8 entries"
_ENGINE_ROWS = "this engine's V4 rows today, one a token and layer, kept"


def is_v4(raw: dict) -> bool:
    return DEEPSEEK_V4 in (raw.get("architectures") or [])


def v4_release_headers(c: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor of a V4 release checkpoint with
    config `c`, written out from the config (not from the model class, so the shape check
    against the model is an independent one). Dtypes: linear weights FP8 e4m3 with a ue8m0
    `.scale` per 128x128 block; routed experts FP4 e2m1, two a byte (int8 [out, in / 2], as
    HF's FP8Experts holds `expert_dtype: fp4`) with a ue8m0 `.scale` per 32 inputs; embedding,
    head, norms, router and indexer weights_proj bf16 (as V3.2's); sinks, compressor `ape`,
    router bias and mHC tensors float32; hash tables int32. The MTP layer (`mtp.0.*`) is a
    decoder block with e_proj, h_proj, enorm, hnorm, norm and its own hc_head, sharing the
    main model's embedding and head."""
    h, v, n, m = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["hc_mult"]
    t = {"embed.weight": ("BF16", (v, h)), "head.weight": ("BF16", (v, h))}
    t |= {"norm.weight": ("BF16", (h,))} | _v4_hc_head("", m, h)
    for i in range(n):
        t |= _v4_release_layer(f"layers.{i}.", c, i)
    for j in range(c.get("num_nextn_predict_layers") or 0):
        p = f"mtp.{j}."
        t |= _v4_release_layer(p, c, n + j) | _v4_hc_head(p, m, h)
        t |= _fp8_matrix(f"{p}e_proj", h, h) | _fp8_matrix(f"{p}h_proj", h, h)
        t |= {f"{p}{x}.weight": ("BF16", (h,)) for x in ("enorm", "hnorm", "norm")}
    return t


def _fp8_matrix(name: str, rows: int, cols: int, block: int = 128) -> dict:
    scales = (math.ceil(rows / block), math.ceil(cols / block))
    return {
        f"{name}.weight": ("F8_E4M3", (rows, cols)),
        name + fp4.SCALE_SUFFIX: ("F8_E8M0", scales),
    }


def _fp4_matrix(name: str, rows: int, cols: int) -> dict:
    """weights/fp4.py's layout: int8 [out, in / 2], a ue8m0 scale per BLOCK inputs."""
    return {
        f"{name}.weight": ("I8", (rows, cols // 2)),
        name + fp4.SCALE_SUFFIX: ("F8_E8M0", (rows, cols // fp4.BLOCK)),
    }


def _v4_hc_head(p: str, m: int, h: int) -> dict:
    return {f"{p}hc_head_fn": ("F32", (m, m * h)), f"{p}hc_head_base": ("F32", (m,))} | {
        f"{p}hc_head_scale": ("F32", (1,))
    }


def _v4_compressor(p: str, h: int, width: int, ratio: int) -> dict:
    proj = 2 * width if ratio == 4 else width  # overlapping windows (CSA): two series
    t = {f"{p}ape": ("F32", (ratio, proj)), f"{p}norm.weight": ("BF16", (width,))}
    return t | _fp8_matrix(f"{p}wkv", proj, h) | _fp8_matrix(f"{p}wgate", proj, h)


def _v4_release_layer(p: str, c: dict, i: int) -> dict:
    """Decoder block i (the MTP block: i >= num_hidden_layers) under the prefix p."""
    h, heads, d, q = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    g, r, ratio = c["o_groups"], c["o_lora_rank"], c["compress_ratios"][i]
    a, f = p + "attn.", p + "ffn."
    t = {f"{a}attn_sink": ("F32", (heads,)), f"{a}q_norm.weight": ("BF16", (q,))}
    t |= {f"{a}norm.weight": ("BF16", (d,))} | _fp8_matrix(f"{a}wq_a", q, h)
    t |= _fp8_matrix(f"{a}wq_b", heads * d, q) | _fp8_matrix(f"{a}wkv", d, h)
    t |= _fp8_matrix(f"{a}wo_a", g * r, heads * d // g) | _fp8_matrix(f"{a}wo_b", h, g * r)
    if ratio:
        t |= _v4_compressor(f"{a}compressor.", h, d, ratio)
    if ratio == 4:  # CSA: the lightning indexer
        ih, idim = c["index_n_heads"], c["index_head_dim"]
        t |= _v4_compressor(f"{a}indexer.compressor.", h, idim, ratio)
        t |= _fp8_matrix(f"{a}indexer.wq_b", ih * idim, q)
        t |= {f"{a}indexer.weights_proj.weight": ("BF16", (ih, h))}
    E, inter, k = c["n_routed_experts"], c["moe_intermediate_size"], c["num_experts_per_tok"]
    t[f"{f}gate.weight"] = ("BF16", (E, h))
    if i < c["num_hash_layers"]:
        t[f"{f}gate.tid2eid"] = ("I32", (c["vocab_size"], k))
    else:
        t[f"{f}gate.bias"] = ("F32", (E,))
    mlp = (("w1", inter, h), ("w2", h, inter), ("w3", inter, h))
    for e in range(E):
        for w, rows, cols in mlp:
            t |= _fp4_matrix(f"{f}experts.{e}.{w}", rows, cols)
    for w, rows, cols in mlp:
        t |= _fp8_matrix(f"{f}shared_experts.{w}", rows, cols)
    t |= {f"{p}attn_norm.weight": ("BF16", (h,)), f"{p}ffn_norm.weight": ("BF16", (h,))}
    mix = (2 + c["hc_mult"]) * c["hc_mult"]
    for part in ("attn", "ffn"):
        t[f"{p}hc_{part}_fn"] = ("F32", (mix, c["hc_mult"] * h))
        t |= {f"{p}hc_{part}_base": ("F32", (mix,)), f"{p}hc_{part}_scale": ("F32", (3,))}
    return t


_V4_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def v4_names(headers: dict, num_hidden_layers: int) -> dict:
    """A V4 checkpoint's headers under the names models/deepseek_v4.py gives its tensors
    (`layers.N.x` -> `model.layers.N.x`, `embed.weight` -> `model.embed_tokens.weight`, the
    MTP layer `mtp.J.x` -> `model.layers.{num_hidden_layers + J}.x`, as the V3 loader names
    its MTP layer; names already the model's are kept). A weight's `.scale` becomes its
    `weight_scale_inv`, as the V3 checkpoints name block scales, and an FP4 weight (int8
    holding two values a byte) is listed at its logical shape with the dtype "F4"."""
    out, suffix = {}, fp4.SCALE_SUFFIX
    for name, (dtype, shape) in headers.items():
        base = name.removesuffix(suffix)
        if base != name and base + ".weight" in headers:
            continue  # (moved beside its weight below)
        new, scale = _v4_name(name, num_hidden_layers), name.removesuffix(".weight") + suffix
        if name.endswith(".weight") and scale in headers:
            if dtype == "I8":  # FP4, as weights/fp4.py reads it: two e2m1 values a byte
                dtype, shape = FP4, (shape[0], 2 * shape[1])
            out[new + SCALE_SUFFIX] = headers[scale]
        out[new] = (dtype, tuple(shape))
    return out


def _v4_name(name: str, num_hidden_layers: int) -> str:
    if name in _V4_TOP:
        return _V4_TOP[name]
    first, _, rest = name.partition(".")
    if first == "layers":
        return f"model.layers.{rest}"
    if first == "mtp":
        j, _, rest = rest.partition(".")
        return f"model.layers.{num_hidden_layers + int(j)}.{rest}"
    return name  # head.weight, or already the model's name


def _v4_layers(cfg: V4Config, mtp: int) -> list[tuple[str, str]]:
    """(attention kind, MoE kind) of each layer: the target's, then `mtp` MTP layers (their
    kinds from the release's compress_ratios, past the target's; score-routed MoE)."""
    ratios = (cfg.raw.get("compress_ratios") or [])[cfg.num_hidden_layers :]
    kind = {0: SLIDING, cfg.csa_rate: CSA, cfg.hca_rate: HCA}
    extra = [kind[int(ratios[j])] if j < len(ratios) else SLIDING for j in range(mtp)]
    return [*zip(cfg.layer_types, cfg.mlp_layer_types), *((k, "moe") for k in extra)]


def _v4_meta(cfg: V4Config, layers: list[tuple[str, str]], dtype):
    """(name -> meta tensor of every parameter and buffer the V4 model holds, the cache row
    width of each layer in this engine today): the model without its decoder layers, and
    one DecoderLayer per (attention, MoE) kind standing for every layer of that kind (they
    hold the same tensors; building all 70k of V4-Pro's expert Linears takes half a minute)."""
    kinds, mlps = (tuple(x) for x in zip(*layers))
    cfg = replace(cfg, layer_types=kinds, mlp_layer_types=mlps)
    with _on_meta(dtype):
        top = DeepseekV4ForCausalLM(replace(cfg, num_hidden_layers=0))
        built = {}
        for i, kind in enumerate(layers):
            if kind not in built:
                built[kind] = DecoderLayer(cfg, i, top.model.ropes)
    out = dict([*top.named_parameters(), *top.named_buffers()])
    held = {kind: [*m.named_parameters(), *m.named_buffers()] for kind, m in built.items()}
    for i, kind in enumerate(layers):
        out |= {f"model.layers.{i}.{n}": t for n, t in held[kind]}
    return out, [built[kind].attn.cache_width for kind in layers]


_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.(w\d)\.")
_V4_ROWS = (".attn.wq_b.", ".attn.wo_a.", ".shared_experts.w1.", ".shared_experts.w3.")
_V4_COLS = (".attn.wo_b.", ".shared_experts.w2.")
_VOCAB_ROWS = ("model.embed_tokens.weight", "head.weight")


def _v4_local(name: str, shape: tuple[int, ...], tp: int, ep: int, experts: int):
    """Rank 0's shape of a V4 tensor, or None for a routed expert another rank holds.
    Split over tp: wq_b's and the sinks' heads, wo_a's output groups (rows), wo_b's inputs,
    the shared expert's intermediate dim, the embedding's and head's vocab rows; routed
    experts E / ep whole per rank, or (ep 1) split over tp like the shared one. Whole on
    every rank: wq_a, wkv (the one K=V head every query head reads), the compressors and
    the indexer (as this engine holds V3.2's), norms, router, mHC."""
    m = _EXPERT.search(name)
    if m and ep > 1:
        return shape if int(m.group(1)) < experts // ep else None
    rows = any(s in name for s in _V4_ROWS) or (m and m.group(2) != "w2")
    rows = rows or name.endswith(".attn.attn_sink") or name in _VOCAB_ROWS
    if rows:
        return (math.ceil(shape[0] / tp), *shape[1:])
    if any(s in name for s in _V4_COLS) or m:
        return (shape[0], shape[1] // tp)
    return shape


def _v4_check_layout(cfg: V4Config, tp: int, ep: int, dp_attention: bool) -> None:
    heads, groups = cfg.num_attention_heads, cfg.o_groups
    if heads % tp or groups % tp:
        raise ValueError(
            f"--tp={tp}: must divide num_attention_heads={heads} and o_groups={groups} (the "
            "output projection's groups are split over tp)"
        )
    if not dp_attention and ep not in (1, tp):
        raise ValueError(f"--ep={ep}: must be 1 or equal to --tp={tp}")
    if cfg.n_routed_experts % ep:
        raise ValueError(f"--ep={ep}: must divide n_routed_experts={cfg.n_routed_experts}")
    if ep == 1 and cfg.moe_intermediate_size % (tp * fp4.BLOCK):
        raise ValueError(
            f"--tp={tp}: moe_intermediate_size={cfg.moe_intermediate_size} splits unevenly"
        )


def v4_rank_tensors(cfg: V4Config, headers: dict, o: Options, model: dict) -> list[RankTensor]:
    """Every tensor rank 0 keeps resident, priced (`_price`, as V3's): the checkpoint's
    tensors (the MTP layers' with --num_speculative_tokens > 0), shapes checked against the
    V4 model on the meta device (`model`: `_v4_meta`'s), sharded by `_v4_local`; + each
    RMSNorm's float32 `scale` (process_tree). The MTP layer's e_proj, h_proj and hc_head
    (no module yet) in their header dtypes."""
    wd, n = o.weight_dtype, cfg.num_hidden_layers
    compute, mtp = _COMPUTE[wd], _v4_mtp(cfg) if o.num_speculative_tokens else 0
    for name, t in model.items():
        _check_shape(name, t, headers)
    fp8 = Fp8Config.from_quantization_config(cfg.raw.get("quantization_config"))
    out = []
    for name, (dtype, shape) in headers.items():
        i = layer_index(name)
        if name.endswith(SCALE_SUFFIX) or (i is not None and i >= n + mtp):
            continue
        local = _v4_local(name, shape, o.tp, o.ep, cfg.n_routed_experts)
        if local is None:
            continue
        held = model.get(name)
        dt = held.dtype if held is not None else torch.float32 if dtype == "F32" else compute
        stored = "fp8" if dtype == "F8_E4M3" and name + SCALE_SUFFIX in headers else dtype
        nbytes = _price(torch.empty(local, dtype=dt, device="meta"), stored, fp8, None, wd)
        out.append(RankTensor(name, kind_of(name, n), local, nbytes))
        if name.endswith("norm.weight"):  # process_weights_after_loading's float32 copy
            scale = name.removesuffix("weight") + "scale"
            out.append(RankTensor(scale, out[-1].kind, local, 4 * math.prod(local)))
    return out


def _v4_mtp(cfg: V4Config) -> int:
    return int(cfg.raw.get("num_nextn_predict_layers") or 0)


def _v4_cache(cfg: V4Config, kinds: list[str], el: int, fp8: bool = False) -> tuple:
    """V4's cache layers by kind. An entry is one K=V vector of head_dim (512) numbers,
    the same in the window and among a compressor's entries; a CSA entry has an indexer
    key (index_head_dim, 128) beside it; `el` bytes a number, or with `fp8` the release's
    layout: the 448 unroped numbers e4m3 + 8 B (seven ue8m0 scales, one a 64, and a pad
    byte) + the 64 roped ones bf16 = 584 B; the indexer key e4m3 + a float32 scale per 128.
    Per request, whatever its length: the window's `sliding_window` entries in every layer,
    and each compressor's pending-token state, float32 kv and score for coff x ratio tokens
    of coff x width (coff 2 where windows overlap, CSA), as DeepSeek's inference sizes it."""
    d, rope, idim, w = cfg.head_dim, cfg.rope_dim, cfg.index_head_dim, cfg.sliding_window
    if fp8:
        entry, key = (d - rope) + 8 + 2 * rope, idim + 4 * math.ceil(idim / 128)
    else:
        entry, key = el * d, el * idim

    def state(width: int, ratio: int) -> int:
        coff = 2 if ratio == cfg.csa_rate else 1
        return 2 * (coff * ratio) * (coff * width) * 4

    csa, hca = cfg.csa_rate, cfg.hca_rate
    groups = {
        SLIDING: CacheGroup("sliding window", kinds.count(SLIDING), 1, {}, w * entry, w),
        CSA: CacheGroup("CSA", kinds.count(CSA), csa, {"entry": entry, "indexer key": key},
                        w * entry + state(d, csa) + state(idim, csa), w),
        HCA: CacheGroup("HCA", kinds.count(HCA), hca, {"entry": entry},
                        w * entry + state(d, hca), w),
    }  # fmt: skip
    return tuple(g for g in groups.values() if g.layers)


def make_plan(model: str | Path, devices: int, **options) -> Plan:
    """The plan for `model` on `devices` devices; `options`: the other `Options` fields.
    Raises ValueError naming the bad flag."""
    return _make_plan(Options(str(model), devices, **options))


def _make_plan(o: Options, read: tuple | None = None) -> Plan:
    """make_plan for `o`; `read`: the checkpoint's config and headers where a plan of the
    same checkpoint has read them already (the TP layout beside a DP-attention plan)."""
    (tp, ep), mu = _layout(o), o.max_memory_utilization
    if not 0 < mu <= 1:
        raise ValueError(f"--max_memory_utilization={mu}: must be in (0, 1]")
    if o.block_size < 1:
        raise ValueError(f"--block_size={o.block_size}: must be >= 1")
    if o.context < 1:
        raise ValueError(f"--context={o.context}: must be >= 1")
    cfg, headers = read or _read(o.model)
    v4 = isinstance(cfg, V4Config)
    qc = cfg.raw.get("quantization_config") if v4 else cfg.quantization_config
    mtp = _v4_mtp(cfg) if v4 else cfg.num_nextn_predict_layers
    if o.num_speculative_tokens and not mtp:
        raise ValueError(f"--num_speculative_tokens={o.num_speculative_tokens}: no MTP layer")
    o = replace(o, tp=tp, ep=ep, weight_dtype=_weight_dtype(o.weight_dtype, qc))
    plan = (_v4_plan if v4 else _v3_plan)(o, cfg, headers)
    if o.dp_attention:
        plan.tp_layout = _tp_layout(o, (cfg, headers))
    if o.compare_with:
        try:
            plan.compared = _make_plan(replace(o, model=o.compare_with, compare_with=""))
        except (ValueError, OSError) as e:
            raise ValueError(f"--compare_with={o.compare_with}: {e}") from None
    return plan


def _read(model: str) -> tuple[ModelConfig | V4Config, dict]:
    """The config and headers of a checkpoint directory, or of a named V4 replica."""
    if model in V4_REPLICAS:
        raw = V4_REPLICAS[model]
        return V4Config.from_dict(raw), v4_names(v4_release_headers(raw), raw["num_hidden_layers"])
    raw = read_config_dict(model)
    cfg = V4Config.from_dict(raw) if is_v4(raw) else ModelConfig.from_dict(raw, str(Path(model)))
    return cfg, read_headers(model)


def _weight_dtype(wd: str, qc: dict | None) -> str:
    """--weight_dtype resolved and checked: auto keeps FP8 weights FP8 and INT4 ones packed
    (weights/int4.py), as the engine's auto does on CUDA; V4's FP4 experts stay FP4 with
    its FP8 weights."""
    fp8, i4 = _quantization(qc)
    kept = "fp8" if fp8 else "int4" if i4 else None
    wd = (kept or "bf16") if wd == "auto" else wd
    if wd not in _COMPUTE or (wd in ("fp8", "int4") and wd != kept):
        raise ValueError(
            f"--weight_dtype={wd}: use auto, bf16, float32, fp8 (with an FP8 "
            "quantization_config in config.json) or int4 (with an INT4 compressed-tensors one)"
        )
    return wd


def _v3_plan(o: Options, cfg: ModelConfig, headers: dict) -> Plan:
    """A DeepSeek-V3-family plan: the engine's model on meta, sharded as it shards it."""
    compute = _COMPUTE[o.weight_dtype]
    dp = o.devices if o.dp_attention else 1
    target, draft = build_meta(cfg, o.tp, o.ep, o.num_speculative_tokens, compute, dp)
    layers = target.num_cache_layers + (len(draft.layers) if draft is not None else 0)
    parts = {"latent": cfg.kv_lora_rank, "roped key": cfg.qk_rope_head_dim}
    parts |= {"indexer key": cfg.index_head_dim} if cfg.index_head_dim else {}
    mla = CacheGroup("MLA", layers, 1, {k: n * compute.itemsize for k, n in parts.items()})
    moe = sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers)))
    return Plan(
        o,
        totals=header_totals(headers, cfg),
        tensors=rank_tensors(cfg, headers, target, draft, o.weight_dtype),
        cache=(mla,),
        max_model_len=cfg.max_position_embeddings,
        kv_parts=parts,
        traffic=Traffic(
            cfg.num_hidden_layers, moe, cfg.hidden_size, cfg.num_experts_per_tok, compute.itemsize
        ),
    )


def _v4_plan(o: Options, cfg: V4Config, headers: dict) -> Plan:
    """A DeepSeek-V4 plan: the checkpoint's tensors checked against the V4 model on meta,
    sharded by name (`_v4_local`); the cache by layer kind (`_v4_cache`)."""
    _v4_check_layout(cfg, o.tp, o.ep, o.dp_attention)
    compute = _COMPUTE[o.weight_dtype]
    layers = _v4_layers(cfg, _v4_mtp(cfg) if o.num_speculative_tokens else 0)
    model, widths = _v4_meta(cfg, layers, compute)
    kinds, el = [k for k, _ in layers], compute.itemsize
    rows = tuple(
        CacheGroup(f"{kind} rows", kinds.count(kind), 1, {"row": w * el})
        for kind, w in dict(zip(kinds, widths)).items()
    )
    return Plan(
        o,
        totals=header_totals(headers, cfg),
        tensors=v4_rank_tensors(cfg, headers, o, model),
        cache=_v4_cache(cfg, kinds, el),
        max_model_len=cfg.max_position_embeddings,
        family="DeepSeek-V4",
        other_caches={_FP8_ENTRIES: _v4_cache(cfg, kinds, el, fp8=True), _ENGINE_ROWS: rows},
        traffic=Traffic(
            cfg.num_hidden_layers,
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_experts_per_tok,
            el,
        ),  # fmt: skip
    )


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
        tp = replace(o, tp=o.devices, ep=o.devices, dp_attention=False, compare_with="")
        return _make_plan(tp, read)
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


_V4_NOTES = _KIND_NOTES | {
    "attention": "attn.*: wq_b, wo_a (by group), wo_b, sinks split over tp; wq_a, wkv, "
    "compressors, indexer whole",
    "dense": "shared experts: split over tp",
    "experts": "routed experts (E/ep whole per rank, or split over tp) + router, hash tables",
    "embedding/head": "embed_tokens and head: vocab rows split over tp",
    "MTP": "the MTP layer: its block sharded as the target's; e_proj, h_proj, hc head whole",
    "norms/rope": "decoder and final norms (+ float32 scales), mHC mixing (hc_*)",
}
_V4_DP_NOTES = _V4_NOTES | {
    "attention": "attn.*: every head, whole on every rank",
    "dense": "shared experts: whole on every rank",
    "embedding/head": "embed_tokens and head: whole on every rank",
}


def format_plan(p: Plan) -> str:
    o, t, v4 = (
        p.opts,
        {k: f"{v / 1e9:8.2f} B" for k, v in p.totals.items()},
        p.family != "DeepSeek-V3",
    )
    kv_dtype = str(_COMPUTE[o.weight_dtype]).removeprefix("torch.")
    split = f"tp {o.tp}, ep {o.ep}, dp {o.dp}"
    if o.dp_attention:
        split = f"DP attention: dp {o.dp} ranks of tp 1, ep {o.ep}"
    source = "from the safetensors headers"
    if o.model in V4_REPLICAS:
        source = f"{p.family}: a header replica of its release, built in memory"
    scales = "ue8m0 FP8 / FP4 scales" if v4 else "float32 FP8 scales"
    lines = [
        f"memory plan: {o.model}  ({source}; nothing loaded)",
        f"layout: {o.devices} devices x {o.device_memory_gb:g} GiB; {split}; weights "
        f"{o.weight_dtype}; KV cache {kv_dtype}; MTP k = {o.num_speculative_tokens}",
        "",
        f"parameters (elements of the checkpoint's tensors; {scales} not counted)",
        f"  main model: embedding, decoder layers, norm, head   {t['main']}",
        "  activated per token: main model with top_k of the",
        f"    routed experts, head counted, embedding not       {t['activated']}",
        f"  MTP layer(s), own tensors                           {t['mtp_unique']}",
        f"  MTP layer(s) with their embedding/head copies       {t['mtp']}",
        f"  checkpoint: main model + MTP layer(s)               {t['stored']}"
        f"  (+ {p.totals['scales'] / 1e9:.3f} B {scales})",
        "",
        f"weights per rank (every rank of {'the cluster' if o.dp_attention else 'a replica'}"
        " holds the same)",
    ]
    notes = [[_KIND_NOTES, _DP_NOTES], [_V4_NOTES, _V4_DP_NOTES]][v4][o.dp_attention]
    for kind in KINDS + ("total",):
        note = notes.get(kind, "")
        lines.append(f"  {kind:15s} {p.rank_bytes(kind) / GIB:8.2f} GiB   {note}".rstrip())
    lines += ["", *(_v4_kv_lines if v4 else _kv_lines)(p, kv_dtype), "", *_context_lines(p)]
    return "\n".join(lines + (["", *_comparison(p)] if o.dp_attention else []))


def _where(o: Options) -> str:
    return "each rank holds its own requests' tokens" if o.dp_attention else "full on every tp rank"


def _kv_lines(p: Plan, kv_dtype: str) -> list[str]:
    """The V3 family's KV cache: every token's MLA latent (+ V3.2's indexer key)."""
    o, per_token, per_block = p.opts, p.kv_bytes_per_token, p.kv_bytes_per_block
    kv_el = _COMPUTE[o.weight_dtype].itemsize
    parts = " + ".join(f"{n} {k}" for k, n in p.kv_parts.items())
    lines = [
        f"KV cache ({' + '.join(p.kv_parts)}, {kv_dtype}; {_where(o)})",
        f"  per token  {p.cache_layers} cache layers x ({parts}) x "
        f"{kv_el} B = {per_token:,} B ({per_token / 1024:.1f} KiB)",
        *(
            f"    {k:12s} {p.cache_layers * n * kv_el:,} B a token"
            for k, n in p.kv_parts.items()
            if len(p.kv_parts) > 2
        ),
        f"  per block  {o.block_size} tokens = {per_block:,} B ({per_block / 2**20:.2f} MiB)",
    ]
    return lines + _capacity_lines(p)


def _v4_kv_lines(p: Plan, kv_dtype: str) -> list[str]:
    """V4's KV cache by layer kind: bytes a token (the compressed entries, ratio-scaled) and
    bytes a request whatever its length (window, compressor state); other layouts beside."""
    o, bs, per_block = p.opts, p.opts.block_size, p.kv_bytes_per_block
    compressed = [g for g in p.cache if g.entry]
    lines = [
        f"KV cache by layer kind ({kv_dtype}, as HF's DeepseekV4 cache holds it; {_where(o)})",
        f"  a {' / '.join(g.kind for g in compressed)} layer adds an entry per "
        f"{' / '.join(str(g.ratio) for g in compressed)} tokens ({_entry_text(p.cache)}); every "
        "layer",
        f"  keeps its last {p.max_window} tokens' entries and (float32) its compressors' "
        "pending tokens, a fixed cost a request",
        f"  {'kind':16s}{'layers':>7s}{'tokens/entry':>14s}{'B a token':>12s}   "
        "B a request, any length",
    ]
    for g in p.cache:
        ratio = f"{g.ratio:,}" if g.entry else "-"
        lines.append(
            f"  {g.kind:16s}{g.layers:7d}{ratio:>14s}{g.bytes_per_block(bs) / bs:12,.0f}   "
            f"{g.layers} x {g.state / 1024:,.0f} KiB = {g.layers * g.state / 2**20:,.2f} MiB"
        )
    lines += [
        f"  {'all':16s}{p.cache_layers:7d}{'':14s}{per_block / bs:12,.0f}   "
        f"{p.kv_state_per_request / 2**20:,.2f} MiB",
        f"  per block  {bs} tokens = {per_block:,} B ({per_block / 2**20:.2f} MiB)",
        "  the same layers held other ways:",
    ]
    unit = "rank" if o.dp_attention else "replica"
    for label, cache in p.other_caches.items():
        per_block = _block_bytes(cache, bs)
        tokens = _tokens(p.kv_budget, per_block, bs)
        lines += [
            f"    {label} ({_entry_text(cache)})",
            f"      {per_block / bs:,.0f} B a token; {tokens:,} tokens a {unit}",
        ]
    return lines + _capacity_lines(p)


def _entry_text(cache: tuple[CacheGroup, ...]) -> str:
    """The bytes of a cache's entries by part: "entry 1,024 B, indexer key 256 B"."""
    parts: dict[str, list[int]] = {}
    for g in cache:
        for k, n in g.entry.items():
            parts.setdefault(k, []).append(n)
    return ", ".join(
        f"{k} {' / '.join(f'{n:,}' for n in dict.fromkeys(v))} B" for k, v in parts.items()
    )


def _capacity_lines(p: Plan) -> list[str]:
    o, per_block = p.opts, p.kv_bytes_per_block
    lines = [
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


def _context_lines(p: Plan) -> list[str]:
    """One request of --context tokens: its KV bytes and how many fit; beside
    --compare_with's plan when there is one."""
    n, plans = p.opts.context, [p] + ([p.compared] if p.compared else [])
    names = [Path(q.opts.model).name or q.opts.model for q in plans]
    unit = "rank" if p.opts.dp_attention else "replica"
    rows = (
        ("KV bytes it holds", lambda q: f"{q.request_bytes(n) / GIB:,.2f} GiB"),
        ("KV bytes per token of it", lambda q: f"{q.request_bytes(n) / n:,.0f} B"),
        (f"requests of it one {unit} holds", lambda q: _count(q.requests_per_replica(n))),
        (
            "requests of it the cluster holds",
            lambda q: _count(q.requests_per_replica(n) * q.opts.dp),
        ),
    )
    lines = [
        f"one request of {n:,} tokens (--context)"
        + (" beside --compare_with, same flags" if p.compared else ""),
        f"  {'':34s}" + "".join(f"{name:>20s}" for name in names),
        *(f"  {label:34s}" + "".join(f"{value(q):>20s}" for q in plans) for label, value in rows),
    ]
    if p.compared:
        share = p.request_bytes(n) / p.compared.request_bytes(n)
        lines.append(f"  {names[0]} holds {share:.1%} of {names[1]}'s KV bytes at this context")
    return lines


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
