"""DeepSeek-V4's architecture, read from its `config.json` (HF transformers' field names or
the release's older ones): which attention kind each layer has, the compression rates,
the indexer, mHC and MoE sizes, and the two RoPEs. Plain data: models/deepseek_v4.py builds
the model from it, the worker sizes the cache rows from the model it builds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xllm_py.config import RopeConfig

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
_RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}  # the release's per-layer `compress_ratios`
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")  # the router's affinity (deepseek_v4.py)


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    def rate(self, kind: str) -> int:
        """Tokens per compressed entry of a layer kind (CSA, HCA)."""
        return {CSA: self.csa_rate, HCA: self.hca_rate}[kind]

    @property
    def rates(self) -> tuple[int, ...]:
        """The compression rates the layers use."""
        return tuple(sorted({self.rate(k) for k in self.layer_types if k != SLIDING}))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> V4Config:
        """From a V4 `config.json`: HF's field names, or the release's older ones
        (`compress_ratios` per layer, `num_hash_layers`, `qk_rope_head_dim`)."""
        n = int(cfg["num_hidden_layers"])
        rates = dict(cfg.get("compress_rates") or {})
        rates.setdefault(CSA, int(cfg.get("compress_rate_csa", 4)))
        rates.setdefault(HCA, int(cfg.get("compress_rate_hca", 128)))
        kinds = cfg.get("layer_types")
        if kinds is None and cfg.get("compress_ratios") is not None:
            kinds = [_RATIO_KIND[int(r)] for r in cfg["compress_ratios"]]
        if kinds is None:  # HF's default: two HCA layers, then CSA and HCA alternating
            kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp = cfg.get("mlp_layer_types")
        if mlp is None:
            hashed = int(cfg.get("num_hash_layers", 3))
            mlp = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        for name, types, allowed in (
            ("layer_types", kinds, (SLIDING, CSA, HCA)),
            ("mlp_layer_types", mlp, ("hash_moe", "moe")),
        ):
            bad = [t for t in types[:n] if t not in allowed]
            if len(types) < n or bad:
                raise ValueError(
                    f"config.json {name}: {n} entries of {allowed} expected, got {types!r}"
                )
        head_dim = int(cfg["head_dim"])
        rope_dim = cfg.get("qk_rope_head_dim")
        if rope_dim is None:
            rope_dim = int(head_dim * float(cfg.get("partial_rotary_factor") or 64 / 512))
        scoring = cfg.get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORING_FUNCS:
            raise ValueError(
                f"config.json scoring_func={scoring!r} is not supported; use one of "
                f"{list(SCORING_FUNCS)}"
            )
        main, compress = _v4_ropes(cfg)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=n,
            num_attention_heads=int(cfg["num_attention_heads"]),
            head_dim=head_dim,
            rope_dim=int(rope_dim),
            q_lora_rank=int(cfg["q_lora_rank"]),
            o_groups=int(cfg["o_groups"]),
            o_lora_rank=int(cfg["o_lora_rank"]),
            sliding_window=int(cfg["sliding_window"]),
            layer_types=tuple(kinds[:n]),
            mlp_layer_types=tuple(mlp[:n]),
            csa_rate=int(rates[CSA]),
            hca_rate=int(rates[HCA]),
            index_n_heads=int(cfg["index_n_heads"]),
            index_head_dim=int(cfg["index_head_dim"]),
            index_topk=int(cfg["index_topk"]),
            hc_mult=int(cfg.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            n_routed_experts=int(cfg["n_routed_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            scoring_func=scoring,
            swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            main_rope=main,
            compress_rope=compress,
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            raw=cfg,
        )


def _v4_ropes(cfg: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress): main is plain RoPE at `rope_theta`; compress is at
    `compress_rope_theta` with the config's YaRN, whose cos/sin are not rescaled (an
    attention factor of 1, as the release computes them). HF nests the two under
    `rope_parameters` {"main", "compress"}; the release gives the compress one as
    `compress_rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
    main_params = params["main"] if nested else {}
    compress_params = dict(params["compress"]) if nested else dict(params)
    if isinstance(cfg.get("compress_rope_parameters"), dict):
        compress_params = dict(cfg["compress_rope_parameters"])
    main_params = {
        "rope_theta": cfg.get("rope_theta", 10000.0),
        **main_params,
        "rope_type": "default",
    }
    compress_params.setdefault("rope_theta", cfg.get("compress_rope_theta", 160000.0))
    if compress_params.get("rope_type", compress_params.get("type")) == "yarn":
        compress_params.setdefault("attention_factor", 1.0)
    limits = {"max_position_embeddings": cfg["max_position_embeddings"]}
    return (
        RopeConfig.from_hf({**limits, "rope_parameters": main_params}),
        RopeConfig.from_hf({**limits, "rope_parameters": compress_params}),
    )
