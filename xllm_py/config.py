"""Configuration, layered as frozen dataclasses.

`ModelConfig` is read from a checkpoint's `config.json`; the others are built by
`EngineArgs.engine_config()` (xllm_py/args.py) from the `xllm` flags or `LLM(...)`
keyword arguments, whose defaults, help and front checks live there. Each validates
its own invariants in `__post_init__` and names the offending field in its error;
derived values are properties.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEEPSEEK_V4 = "DeepseekV4ForCausalLM"
SUPPORTED_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV32ForCausalLM",
    DEEPSEEK_V4,
)
# What DeepSeek-V4's config.json must give for the fields the engine reads (the rest of its
# architecture is read by models/deepseek_v4_config.py when the worker builds the model).
_V4_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "max_position_embeddings",
)
# DeepSeek-V3.2's sparse attention (DSA): a lightning indexer picks each query's top
# `index_topk` cached tokens; these config fields describe it (required for V3.2).
DSA_FIELDS = ("index_topk", "index_head_dim", "index_n_heads")
# Router affinity: DeepSeek-V3 (and Kimi-K2, Moonlight) sigmoid; DeepSeek-V2 softmax.
SCORING_FUNCS = ("sigmoid", "softmax")
# Expert choice (models/layers/moe.py): V3's bias-steered grouped top-k, V2's group-limited
# top-k (groups ranked by their best expert) and V2-Lite's plain top-k.
TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")

# dtype names and the torch dtype each means (torch is imported only when one is asked
# for: the daemon's HTTP process reads these configs and never runs a tensor)
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def dtype_name(name: str) -> str:
    """The canonical name of a dtype name ("bf16" -> "bfloat16"); ValueError naming it."""
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(
            f"dtype={name!r} is not supported; use one of {sorted(set(_DTYPES))}"
        ) from None


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch

    return name if isinstance(name, torch.dtype) else getattr(torch, dtype_name(name))


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention-temperature term m(x) = 0.1 * x * ln(factor) + 1 (1 when factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the `qk_rope_head_dim` part; YaRN when `factor > 1`."""

    theta: float = 10000.0
    type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RopeConfig:
        # Older writers use `rope_theta` + `rope_scaling`; newer ones `rope_parameters`.
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; use 'yarn'")
        if rope_type == "default":
            return cls(theta=theta)
        orig = params.get("original_max_position_embeddings")
        if orig is None:
            raise ValueError("rope_scaling.original_max_position_embeddings is required for yarn")
        factor = params.get("factor")
        if factor is None:  # HF's rule: derive it from the context extension
            factor = cfg["max_position_embeddings"] / orig
        return cls(
            theta=theta,
            type="yarn",
            factor=float(factor),
            original_max_position=int(orig),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )

    @property
    def cos_sin_scale(self) -> float:
        """Factor applied to cos/sin: m(mscale) / m(mscale_all_dim)."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor, 1.0)

    @property
    def softmax_mscale(self) -> float:
        """Multiplier of the softmax scale: m(mscale_all_dim)^2."""
        if self.type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "intermediate_size",
    "max_position_embeddings",
)


CONFIG_FILE = "config.json"
# Mistral's own layout (Mistral Large 3): params.json instead of config.json, with Mistral's
# field and tensor names (weights/mistral.py maps the tensors).
MISTRAL_PARAMS_FILE = "params.json"


def config_file(path: str | Path) -> Path:
    """The file a checkpoint's architecture is read from: config.json, else params.json."""
    path = Path(path)
    for name in (CONFIG_FILE, MISTRAL_PARAMS_FILE):
        if (path / name).is_file():
            return path / name
    raise ValueError(
        f"model={str(path)!r}: no config.json (or Mistral params.json) in that directory"
    )


def read_config_dict(path: str | Path) -> dict[str, Any]:
    """config.json as a dict; a Mistral params.json converted to the same fields."""
    f = config_file(path)
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not JSON ({e})") from None
    return raw if f.name == CONFIG_FILE else config_from_mistral_params(raw)


# A DeepSeek-V4 checkpoint's draft module: its tensors are `mtp.N.*`. The first releases
# hold MTP layers there; the 0731 releases a DSpark drafter under the same names (block
# drafts from the target's hidden states at chosen layers, through a low-rank Markov head,
# with a confidence head), told apart by tensors only DSpark has.
V4_DRAFT_PREFIX = "mtp."
V4_DSPARK_PARTS = ("markov_head", "confidence_head", "main_proj", "main_norm")


def checkpoint_tensor_names(path: str | Path) -> list[str]:
    """Every tensor name of a checkpoint directory, from its safetensors index or else the
    files' headers (nothing else is read); none where `path` is not a directory."""
    if not path or not Path(path).is_dir():
        return []
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    names: list[str] = []
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        names += [n for n in header if n != "__metadata__"]
    return names


def v4_draft_module(names: list[str]) -> tuple[str, str] | None:
    """What a V4 checkpoint's `mtp.*` tensors are, with a tensor that shows it: ("DSpark",
    name) or ("MTP", name); None when it has none."""
    drafts = [n for n in names if n.startswith(V4_DRAFT_PREFIX)]
    for name in drafts:
        if name.split(".")[2:3] and name.split(".")[2] in V4_DSPARK_PARTS:
            return "DSpark", name
    return ("MTP", drafts[0]) if drafts else None


# params.json field -> config.json field, and the same for its "moe" section
_MISTRAL_FIELDS = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "hidden_dim": "intermediate_size",
    "n_heads": "num_attention_heads", "vocab_size": "vocab_size", "norm_eps": "rms_norm_eps",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
    "qk_rope_head_dim": "qk_rope_head_dim", "qk_nope_head_dim": "qk_nope_head_dim",
    "v_head_dim": "v_head_dim", "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta", "tied_embeddings": "tie_word_embeddings",
}  # fmt: skip
_MISTRAL_MOE_FIELDS = {
    "num_experts": "n_routed_experts", "num_experts_per_tok": "num_experts_per_tok",
    "expert_hidden_dim": "moe_intermediate_size", "first_k_dense_replace": "first_k_dense_replace",
    "num_shared_experts": "n_shared_experts", "routed_scale": "routed_scaling_factor",
    "num_expert_groups": "n_group", "num_expert_groups_per_tok": "topk_group",
    "route_every_n": "moe_layer_freq",
}  # fmt: skip
# params.json keys that describe parts this engine does not serve (Mistral Large 3 is also
# a vision model: its vision tower's tensors are skipped by the loader, text is served)
_MISTRAL_IGNORED = ("vision_encoder", "multimodal", "head_dim", "n_kv_heads", "model_type")


def config_from_mistral_params(params: dict[str, Any]) -> dict[str, Any]:
    """A Mistral MLA + MoE params.json (Mistral Large 3) as DeepSeek-V3 config.json fields:
    softmax routing over plain top-k with the top-k weights renormalised, YaRN from `yarn`
    (`apply_scale: false` = no YaRN attention scaling: the cos/sin tables and the softmax
    scale stay unscaled), and `llama_4_scaling` (position-dependent query scaling) as is.
    ValueError names a field this engine does not read."""
    p = dict(params)
    if p.get("kv_lora_rank") is None:
        raise ValueError("params.json has no kv_lora_rank: only Mistral's MLA models are supported")
    cfg: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    for key, hf in _MISTRAL_FIELDS.items():
        if key in p:
            cfg[hf] = p.pop(key)
    moe = dict(p.pop("moe", None) or {})
    for key, hf in _MISTRAL_MOE_FIELDS.items():
        if key in moe:
            cfg[hf] = moe.pop(key)
    if moe:
        raise ValueError(f"params.json moe.{sorted(moe)[0]} is not read by this engine")
    cfg.update(scoring_func="softmax", topk_method="greedy", norm_topk_prob=True)
    if int(cfg.get("n_group") or 1) > 1:
        raise ValueError(
            f"params.json moe.num_expert_groups={cfg['n_group']}: only 1 group is supported "
            "for Mistral's softmax routing"
        )
    yarn = p.pop("yarn", None)
    if yarn:
        cfg["rope_scaling"] = _mistral_yarn(dict(yarn))
    if p.get("llama_4_scaling"):
        l4 = p.pop("llama_4_scaling")
        if not {"beta", "original_max_position_embeddings"} <= set(l4):
            raise ValueError(
                "params.json llama_4_scaling needs beta and original_max_position_embeddings"
            )
        cfg["llama_4_scaling"] = l4
    quant = p.pop("quantization_config", None) or p.pop("quantization", None)
    if quant:
        if quant.get("quant_method") != "compressed-tensors":
            raise ValueError(
                f"params.json quantization {quant!r} is not supported; Mistral's FP8 release "
                "in compressed-tensors' FP8_BLOCK layout is"
            )
        cfg["quantization_config"] = quant
    cfg.setdefault("max_position_embeddings", p.pop("max_seq_len", None))
    cfg.update(bos_token_id=p.pop("bos_token_id", 1), eos_token_id=p.pop("eos_token_id", 2))
    cfg["torch_dtype"] = p.pop("torch_dtype", "bfloat16")
    unread = [k for k in p if k not in _MISTRAL_IGNORED and p[k] is not None]
    if unread:
        raise ValueError(f"params.json field {unread[0]!r} is not read by this engine")
    return cfg


def _mistral_yarn(yarn: dict[str, Any]) -> dict[str, Any]:
    out = {
        "type": "yarn",
        "factor": yarn.pop("factor"),
        "original_max_position_embeddings": yarn.pop("original_max_position_embeddings"),
        "beta_fast": yarn.pop("beta", 32),
        "beta_slow": yarn.pop("alpha", 1),
    }
    if yarn.pop("apply_scale", True):  # m(factor)^2 on the softmax scale, cos/sin as they are
        out.update(mscale=1.0, mscale_all_dim=1.0)
    else:
        out.update(attention_factor=1.0)
    if yarn:
        raise ValueError(f"params.json yarn.{sorted(yarn)[0]} is not read by this engine")
    return out


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a DeepSeek-V3-family checkpoint, from its `config.json`.

    `architecture` names the model class. DeepSeek-V2, V3 and V3.2 are one model whose
    differences are the fields below; DeepSeek-V4 (`DEEPSEEK_V4`) is its own model, which
    reads its architecture from `raw` (models/deepseek_v4_config.py). For V4 this class
    holds what the engine reads (vocabulary, sizes, context, end tokens); V3's MLA, dense
    MLP and routing fields do not apply to it and are 0 (its layers' cache widths are the
    model's `cache_dims`, not `kv_cache_dim`)."""

    path: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring_func: str
    topk_method: str
    first_k_dense_replace: int
    moe_layer_freq: int
    num_nextn_predict_layers: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    checkpoint_dtype: str
    tie_word_embeddings: bool
    quantization_config: dict | None = None
    # Llama-4's position-dependent query scaling (Mistral Large 3): (beta, original max
    # position); queries at position p are multiplied by 1 + beta * ln(1 + floor(p / orig)).
    llama_4_scaling: tuple[float, int] | None = None
    # DSA (DeepSeek-V3.2): 0 = dense attention
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    architecture: str = "DeepseekV3ForCausalLM"
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(read_config_dict(path), str(Path(path)))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], path: str = "") -> ModelConfig:
        archs = cfg.get("architectures") or []
        if DEEPSEEK_V4 in archs:
            return cls._from_v4(cfg, path)
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(
                f"config.json architectures={archs!r} is not supported; "
                f"expected one of {list(SUPPORTED_ARCHITECTURES)}"
            )
        for name in _REQUIRED:
            if cfg.get(name) is None:
                raise ValueError(f"config.json is missing the field {name!r}")
        n_routed = int(cfg.get("n_routed_experts") or 0)
        v2 = "DeepseekV2ForCausalLM" in archs
        dsa = "DeepseekV32ForCausalLM" in archs
        for name in DSA_FIELDS if dsa else ():
            if cfg.get(name) is None:
                raise ValueError(f"config.json is missing the field {name!r} (DeepSeek-V3.2)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            path=path,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            intermediate_size=int(cfg["intermediate_size"]),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            n_routed_experts=n_routed,
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            # DeepSeek-V2 configs route by softmax and plain top-k unless they say otherwise.
            scoring_func=cfg.get("scoring_func") or ("softmax" if v2 else "sigmoid"),
            topk_method=cfg.get("topk_method") or ("greedy" if v2 else "noaux_tc"),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0)),
            moe_layer_freq=int(cfg.get("moe_layer_freq", 1)),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            quantization_config=cfg.get("quantization_config"),
            llama_4_scaling=_llama_4_scaling(cfg),
            **{name: int(cfg[name]) for name in DSA_FIELDS if dsa},
            architecture=next(a for a in archs if a in SUPPORTED_ARCHITECTURES),
            raw=cfg,
        )

    @classmethod
    def _from_v4(cls, cfg: dict[str, Any], path: str) -> ModelConfig:
        """DeepSeek-V4: the fields the engine reads; V3's MLA, MLP and routing ones are 0.
        The release's quantisation (block-FP8 e4m3, `expert_dtype` for the routed experts:
        top-level in V4's config.json, inside quantization_config in V4.1's) is read as one
        quantization_config, V4.1's form."""
        for name in _V4_REQUIRED:
            if cfg.get(name) is None:
                raise ValueError(f"config.json is missing the field {name!r} ({DEEPSEEK_V4})")
        quant = dict(cfg.get("quantization_config") or {})
        if cfg.get("expert_dtype") is not None:
            quant.setdefault("expert_dtype", cfg["expert_dtype"])
        if quant and quant.get("quant_method") != "fp8":
            raise ValueError(
                f"config.json quantization_config.quant_method={quant.get('quant_method')!r} "
                f"with {DEEPSEEK_V4}: only the release's 'fp8' (block-FP8 e4m3 weights, "
                "expert_dtype for the routed experts) is read"
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        zero = dict.fromkeys(
            ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
             "intermediate_size", "n_shared_experts", "first_k_dense_replace"), 0
        )  # fmt: skip
        return cls(
            path=path,
            architecture=DEEPSEEK_V4,
            **{name: int(cfg[name]) for name in _V4_REQUIRED if name != "head_dim"},
            **zero,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=True,
            scoring_func=str(cfg.get("scoring_func", "sqrtsoftplus")),
            topk_method="noaux_tc",
            moe_layer_freq=1,
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig(),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            quantization_config=quant or None,
            raw=cfg,
        )

    @property
    def is_v4(self) -> bool:
        return self.architecture == DEEPSEEK_V4

    @property
    def graphable(self) -> bool:
        """Whether graph mode can run this model: not V3.2's sparse attention (DSA) nor
        DeepSeek-V4 (both eager only)."""
        return not self.index_topk and not self.is_v4

    def __post_init__(self) -> None:
        if self.is_v4:  # its own checks: models/deepseek_v4_config.py
            return
        if self.index_topk:
            self._check_dsa()
        if self.llama_4_scaling is not None and self.llama_4_scaling[1] <= 0:
            raise ValueError(
                f"config.json llama_4_scaling.original_max_position_embeddings="
                f"{self.llama_4_scaling[1]} must be > 0"
            )
        if self.first_k_dense_replace < 0:
            raise ValueError(f"config.json first_k_dense_replace={self.first_k_dense_replace} < 0")
        if self.q_lora_rank is not None and int(self.q_lora_rank) <= 0:
            raise ValueError(f"config.json q_lora_rank={self.q_lora_rank} must be null or > 0")
        if self.num_moe_layers:
            self._check_moe()

    def _check_dsa(self) -> None:
        if self.q_lora_rank is None:
            raise ValueError("config.json q_lora_rank=null: DSA's indexer reads the q-LoRA latent")
        if self.index_head_dim < self.qk_rope_head_dim or self.index_n_heads < 1:
            raise ValueError(
                f"config.json index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim="
                f"{self.qk_rope_head_dim} and index_n_heads={self.index_n_heads} >= 1"
            )
        if self.index_topk < 1:
            raise ValueError(f"config.json index_topk={self.index_topk} must be >= 1")

    def _check_moe(self) -> None:
        for name in ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"config.json is missing the field {name!r} (needed for MoE layers)"
                )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"config.json scoring_func={self.scoring_func!r}; expected one of {SCORING_FUNCS}"
            )
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"config.json topk_method={self.topk_method!r}; expected one of {TOPK_METHODS}"
            )
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"config.json n_routed_experts={self.n_routed_experts} is not divisible by "
                f"n_group={self.n_group}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"config.json topk_group={self.topk_group} not in [1, n_group]")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"config.json num_experts_per_tok={self.num_experts_per_tok} > "
                f"n_routed_experts={self.n_routed_experts}"
            )

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.n_routed_experts > 0
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Numbers cached per token per layer: the MLA latent plus the roped key, and under
        DSA the indexer's key beside them (same block, same slot: prefix caching,
        preemption and every rank's copy follow the latent's)."""
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale


def _llama_4_scaling(cfg: dict[str, Any]) -> tuple[float, int] | None:
    """`llama_4_scaling: {beta, original_max_position_embeddings}` (vLLM's reading of
    Mistral's params.json), or HF's `llama_4_scaling_beta` in the rope parameters, whose
    original_max_position_embeddings it shares."""
    l4 = cfg.get("llama_4_scaling")
    if l4:
        return float(l4["beta"]), int(l4["original_max_position_embeddings"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("llama_4_scaling_beta") is None:
        return None
    return float(rope["llama_4_scaling_beta"]), int(rope["original_max_position_embeddings"])


@dataclass(frozen=True)
class CacheConfig:
    """Paged MLA KV cache: `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` per layer."""

    block_size: int = 128
    max_memory_utilization: float = 0.9
    max_cache_size: int = 0  # bytes; 0 = derive from max_memory_utilization
    enable_prefix_cache: bool = True
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two")
        if not 0 < self.max_memory_utilization <= 1:
            raise ValueError(
                f"max_memory_utilization={self.max_memory_utilization} must be in (0, 1]"
            )
        if self.max_cache_size < 0:
            raise ValueError(f"max_cache_size={self.max_cache_size} must be >= 0 (bytes)")
        if self.num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens={self.num_lookahead_tokens} must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching budgets."""

    max_tokens_per_batch: int = 8192
    max_seqs_per_batch: int = 256
    enable_chunked_prefill: bool = True
    max_model_len: int = 0  # 0 = the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_tokens_per_batch < 1:
            raise ValueError(f"max_tokens_per_batch={self.max_tokens_per_batch} must be >= 1")
        if self.max_seqs_per_batch < 1:
            raise ValueError(f"max_seqs_per_batch={self.max_seqs_per_batch} must be >= 1")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 0")


@dataclass(frozen=True)
class SpecConfig:
    """MTP speculative decoding: k draft tokens per step from the model's MTP layer(s)."""

    num_speculative_tokens: int = 0  # 0 = off
    draft_model: str | None = None  # exported MTP directory; None = read from the target
    # Above this many running requests, steps verify no drafts (plain decoding): at high
    # concurrency verifying k + 1 tokens per request can cost more than it saves. 0 = never.
    speculative_disable_batch_size: int = 0
    # Choose the drafts per step, 0..num_speculative_tokens, for the most tokens per second
    # (speculative/adaptive.py); replaces speculative_disable_batch_size.
    adaptive: bool = False
    # The draft shares the target's embedding, head and KV blocks, so it must live on the
    # target's device (xLLM's --draft_devices); None = the target's.
    draft_device: str | None = None
    # Drafts from the N most frequent target tokens only (speculative/hot_vocab.py); 0 = the whole
    # vocabulary; None = "auto": sized from the token map when there is one, else the whole
    # vocabulary. The token map: speculative_token_map, else draft_vocab.safetensors in the
    # draft's (or the model's) directory.
    draft_vocab_size: int | None = None
    token_map: str | None = None
    # How sampled requests draft (worker/draft_sampler.py): "sampled" from the draft's
    # processed distribution, or "greedy" (its argmax). Greedy requests always take the argmax.
    draft_sampling: str = "sampled"
    # Confidence-scheduled draft length (speculative/confidence.py): "auto" (the threshold
    # follows load), a fixed threshold in (0, 1), or None (always num_speculative_tokens).
    confidence: str | float | None = "auto"

    @property
    def confidence_scheduled(self) -> bool:
        """Whether the confidence policy picks each request's drafts (and "auto"'s gate
        whether a step drafts): MTP on, a policy set, and adaptive speculation (which picks
        one k per step from its own cost table) off."""
        return (
            bool(self.num_speculative_tokens) and self.confidence is not None and not self.adaptive
        )

    def __post_init__(self) -> None:
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} must be in [0, 16]"
            )
        if self.speculative_disable_batch_size < 0:
            raise ValueError(
                f"speculative_disable_batch_size={self.speculative_disable_batch_size} must be >= 0"
            )
        if self.adaptive and not self.num_speculative_tokens:
            raise ValueError(
                "speculative_adaptive=true needs num_speculative_tokens >= 1 (the most drafts "
                "a step may carry)"
            )
        if self.adaptive and self.speculative_disable_batch_size:
            raise ValueError(
                f"speculative_disable_batch_size={self.speculative_disable_batch_size} and "
                "speculative_adaptive=true: adaptive speculation decides when drafting does not "
                "pay; set one of them"
            )
        if self.draft_model and not self.num_speculative_tokens:
            raise ValueError("draft_model is set but num_speculative_tokens=0 (drafting is off)")
        if self.draft_sampling not in ("sampled", "greedy"):
            raise ValueError(
                f"speculative_draft_sampling={self.draft_sampling!r}: expected 'sampled' or "
                "'greedy'"
            )
        if self.confidence is not None and self.confidence != "auto":
            if not 0 < float(self.confidence) < 1:
                raise ValueError(
                    f"speculative_confidence={self.confidence!r}: expected 'auto', 'off' or a "
                    "number in (0, 1)"
                )
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ValueError(
                f"speculative_draft_vocab_size={self.draft_vocab_size} must be >= 0 (0: whole)"
            )


ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer", "flashmla")
MOE_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    # Graph mode (worker/graph_runner.py): uniform decode/verify steps run compiled, padded
    # to the smallest of these batch sizes that holds them; larger steps run eager.
    enable_graph: bool = False
    # "startup": every graph compiles before the first step; "background": on a thread of
    # the worker while steps run eager, each bucket used once compiled (one-rank replicas)
    graph_warm_up: str = "startup"
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    # How a quantised checkpoint's weights are held: "fp8" FP8-resident with their block
    # scales (weights/fp8.py); "int4" INT4 routed experts kept packed with their group
    # scales (weights/int4.py: Kimi-K2-Thinking); or dequantised at load into the run dtype
    # ("bfloat16" / "float32", which must then be the run dtype). "auto": fp8 where the
    # device has a block-scaled FP8 GEMM, int4 on CUDA (both with graph mode off), else
    # dequantised. fp8 / int4 on a checkpoint without such weights: refused by the worker.
    weight_dtype: str = "auto"
    # Kernels (ops/backends.py): auto, torch, triton (attention also flashinfer, flashmla);
    # resolved against what this device has when the worker starts.
    attention_backend: str = "auto"
    moe_backend: str = "auto"

    def __post_init__(self) -> None:
        for flag, allowed in (
            ("attention_backend", ATTENTION_BACKENDS),
            ("moe_backend", MOE_BACKENDS),
        ):
            if getattr(self, flag) not in allowed:
                raise ValueError(
                    f"{flag}={getattr(self, flag)!r} must be one of {', '.join(allowed)}"
                )
        kind, _, index = self.device.partition(":")
        if kind not in ("cpu", "cuda", "npu") or (index and not index.isdigit()):
            raise ValueError(f"device={self.device!r} must be cpu, cuda[:N] or npu[:N]")
        if kind != "cpu" and not index:  # "cuda": the first visible device, named explicitly
            object.__setattr__(self, "device", f"{kind}:0")  # (set_device needs an index)
        sizes = tuple(self.graph_batch_sizes)
        if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
            raise ValueError(
                f"graph_batch_sizes={list(sizes)} must be one or more positive integers"
            )
        object.__setattr__(self, "graph_batch_sizes", tuple(sorted(set(sizes))))
        if self.graph_warm_up not in ("startup", "background"):
            raise ValueError(
                f"graph_warm_up={self.graph_warm_up!r} must be 'startup' or 'background'"
            )
        if self.enable_graph and kind == "npu":
            raise ValueError("enable_graph=True is not supported on NPU yet (runs eager only)")
        if self.dtype != "auto":
            dtype_name(self.dtype)
        self._check_weight_dtype()

    def _check_weight_dtype(self) -> None:
        wd = {"bf16": "bfloat16", "fp32": "float32"}.get(self.weight_dtype, self.weight_dtype)
        object.__setattr__(self, "weight_dtype", wd)
        if wd not in ("auto", "fp8", "int4", "fp4", "bfloat16", "float32"):
            raise ValueError(
                f"weight_dtype={wd!r} must be auto, fp8, int4, fp4, bf16 (bfloat16) or float32"
            )
        if wd in ("fp8", "int4", "fp4") and self.enable_graph:
            held = {"fp8": "FP8-resident weights", "int4": "packed INT4 experts",
                    "fp4": "packed FP4 experts"}[wd]  # fmt: skip
            raise ValueError(
                f"weight_dtype={wd} with enable_graph=True is not implemented ({held} run "
                "eager); use weight_dtype=bf16 for graph mode"
            )
        if wd not in ("auto", "fp8", "int4", "fp4") and wd != self.dtype_name:
            raise ValueError(
                f"weight_dtype={wd}: dequantised weights take the run dtype, which is "
                f"{self.dtype_name} (set dtype={wd} too)"
            )

    def torch_dtype(self) -> torch.dtype:
        """auto: bfloat16 on accelerators; float32 on CPU, where this engine's small decode
        matmuls ran faster in float32 than in bfloat16 even with AVX512-BF16 (3.3 vs 4.3 ms
        per token on the bundled model, 2 cores)."""
        return parse_dtype(self.dtype_name)

    @property
    def dtype_name(self) -> str:
        """The run dtype's name (torch_dtype without importing torch)."""
        if self.dtype != "auto":
            return dtype_name(self.dtype)
        return "float32" if self.device.startswith("cpu") else "bfloat16"


PD_ROLES = ("both", "prefill", "decode", "router")


@dataclass(frozen=True)
class PDConfig:
    """Prefill/decode disaggregation (xllm_py/pd, docs/pd.md): "both" prefills and decodes
    (no PD); "prefill" computes prompts for decode instances and writes their KV blocks
    into them; "decode" has its prompts' full blocks prefilled by `prefill_urls`; "router"
    serves no model: it forwards each API request to the least loaded live instance of
    `decode_urls` and watches every instance's /health each `health_interval` seconds."""

    role: str = "both"
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    transfer_host: str = "127.0.0.1"  # where this instance's transfer engine listens
    transfer_timeout: float = 30.0  # seconds a decode instance waits for one prompt's blocks
    health_interval: float = 2.0  # seconds between the router's health checks
    on_transfer_failure: str = "recompute"  # a decode instance's: or "error"
    token: str | None = None  # the cluster token the PD control plane carries
    # PEM files of --cluster_tls_cert/_key/_ca: the control plane over HTTPS (mutual with ca)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        if self.role not in PD_ROLES:
            raise ValueError(f"pd_role={self.role!r} must be one of {PD_ROLES}")
        for name in ("prefill_urls", "decode_urls"):  # one spelling: no trailing slash
            object.__setattr__(self, name, tuple(u.rstrip("/") for u in getattr(self, name)))
        if self.role == "decode" and not self.prefill_urls:
            raise ValueError("pd_role='decode' needs --pd_prefill: the prefill instances' URLs")
        if self.role == "router" and not self.decode_urls:
            raise ValueError("pd_role='router' needs --pd_decode: the decode instances' URLs")
        if self.decode_urls and self.role != "router":
            raise ValueError(f"--pd_decode is the router's (pd_role={self.role!r})")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--cluster_tls_cert and --cluster_tls_key go together: give both")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("--cluster_tls_ca (mutual TLS) needs --cluster_tls_cert and _key")
        for url in self.prefill_urls + self.decode_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"PD instance URL {url!r} must start with http:// or https://")
            if self.tls_cert and not url.startswith("https://"):
                raise ValueError(f"PD instance URL {url!r} must start with https://: with "
                                 "--cluster_tls_cert every instance serves HTTPS")  # fmt: skip
        if self.on_transfer_failure not in ("recompute", "error"):
            raise ValueError(
                f"pd_on_transfer_failure={self.on_transfer_failure!r} must be 'recompute' or "
                "'error'"
            )
        if self.transfer_timeout <= 0:
            raise ValueError(f"pd_transfer_timeout={self.transfer_timeout} must be > 0")
        if self.health_interval <= 0:
            raise ValueError(f"pd_health_interval={self.health_interval} must be > 0")

    def __repr__(self) -> str:  # the token is a secret
        return (
            f"PDConfig(role={self.role!r}, prefill_urls={self.prefill_urls!r}, "
            f"decode_urls={self.decode_urls!r})"
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    spec: SpecConfig = field(default_factory=SpecConfig)
    pd: PDConfig = field(default_factory=PDConfig)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len or self.model.max_position_embeddings

    @property
    def max_blocks_per_seq(self) -> int:
        """Blocks one full-length request can hold (its look-ahead slots included)."""
        return -(-(self.max_model_len + self.cache.num_lookahead_tokens) // self.cache.block_size)

    def __post_init__(self) -> None:
        k = self.spec.num_speculative_tokens
        draft_device = self.spec.draft_device
        if draft_device is not None and draft_device != self.device.device:
            raise ValueError(
                f"draft_devices={draft_device!r} must equal devices={self.device.device!r} "
                "(--draft_devices, --devices): the MTP draft shares the target's embedding, "
                "head and KV cache blocks"
            )
        if self.model.index_topk and self.device.enable_graph:
            raise ValueError(
                "enable_graph=True with DeepSeek-V3.2's sparse attention (DSA, index_topk="
                f"{self.model.index_topk}) is not implemented: its top-k attention runs eager "
                "(--enable_graph=false)"
            )
        if self.model.is_v4:
            self._check_v4()
        elif self.device.weight_dtype == "fp4":
            raise ValueError(
                f"weight_dtype=fp4 with {self.model.architecture}: packed FP4 experts are "
                f"DeepSeek-V4's ({DEEPSEEK_V4} with expert_dtype fp4)"
            )
        if self.pd.role != "both" and not self.cache.enable_prefix_cache:
            raise ValueError(
                f"pd_role={self.pd.role!r} needs the prefix cache (--enable_prefix_cache): "
                "moved blocks are found by their prefix hashes"
            )
        if self.cache.num_lookahead_tokens != k:  # k draft slots reserved ahead of each request
            object.__setattr__(self, "cache", replace(self.cache, num_lookahead_tokens=k))
        if self.scheduler.max_model_len > self.model.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.scheduler.max_model_len} exceeds the model's "
                f"max_position_embeddings={self.model.max_position_embeddings}"
            )

    def _check_v4(self) -> None:
        """What DeepSeek-V4 does not run with yet, refused by the flag's name."""
        k = self.spec.num_speculative_tokens
        drafts = self.spec.draft_model or self.model.path  # an exported draft, or the target
        found = v4_draft_module(checkpoint_tensor_names(drafts)) if k else None
        if found is not None and found[0] == "DSpark":
            raise ValueError(
                f"num_speculative_tokens={k} with {DEEPSEEK_V4}: this checkpoint's mtp.* module "
                f"is a DSpark drafter ({found[1]}), not MTP layers. DSpark drafts a block of "
                "tokens from the target's hidden states with Markov and confidence heads; it "
                "is not implemented, and read as MTP layers it would draft wrong tokens (use "
                "num_speculative_tokens=0)"
            )
        layers = self.model.num_nextn_predict_layers or self.spec.draft_model
        if k and (found is None or not layers):
            raise ValueError(
                f"num_speculative_tokens={k} with {DEEPSEEK_V4}: {drafts} has no MTP "
                f"layer (num_nextn_predict_layers={self.model.num_nextn_predict_layers}, "
                f"mtp.* tensors: {'none' if found is None else found[1] + ', ...'}); use "
                "num_speculative_tokens=0"
            )
        if k and self.spec.draft_vocab_size:
            raise ValueError(
                f"speculative_draft_vocab_size={self.spec.draft_vocab_size} with {DEEPSEEK_V4}:"
                " a hot-vocabulary draft head for V4 is not implemented (use 0)"
            )
        if self.device.enable_graph:
            raise ValueError(
                f"enable_graph=True with {DEEPSEEK_V4}: V4's attention runs eager only "
                "(--enable_graph=false)"
            )
        wd, experts = self.device.weight_dtype, (self.model.quantization_config or {})
        if wd in ("fp8", "int4"):
            raise ValueError(
                f"weight_dtype={wd} with {DEEPSEEK_V4}: its FP8 weights are dequantised at "
                "load, and only FP4 routed experts can be kept packed (weight_dtype=fp4)"
            )
        if wd == "fp4" and experts.get("expert_dtype") != "fp4":
            raise ValueError(
                "weight_dtype=fp4: this checkpoint's routed experts are not FP4 (config.json "
                f"expert_dtype: {experts.get('expert_dtype')!r}); use weight_dtype=auto"
            )
