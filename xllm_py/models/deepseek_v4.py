"""DeepSeek-V4 causal LM (V4-Flash, V4-Pro): the model's arithmetic, one request at a time.

    streams_0 = [embed(ids)] * hc_mult                       # mHC: hc_mult residual streams
    for each layer i:
        post, comb, x = attn_hc(streams)                     # collapse the streams into x
        streams = post * Attention_i(attn_norm(x)) + comb^T @ streams
        post, comb, x = ffn_hc(streams)
        streams = post * MoE_i(ffn_norm(x)) + comb^T @ streams
    hidden = norm(hc_head(streams))
    logits = head(hidden)

Attention is shared-KV multi-query attention (one 512-wide head read as key and value)
over a sliding window of the latest `sliding_window` tokens, with a learned sink per head
in the softmax. A layer is one of three kinds (`layer_types`):
- sliding_attention: the window only;
- compressed_sparse_attention (CSA): also compressed entries, one per `m` tokens (m = 4),
  each a softmax-gated mix of 2m tokens (the window's own and the one before: two series
  Cb and Ca of one projection), of which a lightning indexer picks `index_topk` per query;
- heavily_compressed_attention (HCA): also compressed entries, one per m' tokens
  (m' = 128), non-overlapping, all of them attended.
A token only sees entries of complete windows that end at or before it. Sliding layers
rotate with the `main` RoPE, CSA/HCA layers (and their compressors and indexer) with the
`compress` one (its own theta, YaRN with an attention factor of 1). The attention output
is rotated back by its query's position (K = V carried the keys' rotation) and projected
by `o_groups` block-diagonal groups (`wo_a`) and one mix (`wo_b`).

The MoE routes the first layers (`mlp_layer_types` "hash_moe") by a frozen token-to-expert
table `tid2eid`, the rest by top-k of `sqrtsoftplus` scores plus a correction bias; the
chosen scores are normalised and scaled, expert gate and up activations are clamped at
`swiglu_limit`, and one shared expert is added.

This module holds the arithmetic and its per-request state (`V4State`: each layer's window,
its compressors' pending tokens, overlap series and entries), checked against HF
transformers' `DeepseekV4ForCausalLM` (tests/test_deepseek_v4.py). It is not yet served:
the engine's block-paged caches, scheduler and MTP for V4 are the rest of that work, and
until they exist `config.json` of a V4 checkpoint is refused with a message saying so.
Parameter names are those HF's `save_pretrained` writes (the release's: `attn.wq_a`,
`attn.compressor.ape`, `ffn.gate.tid2eid`, `hc_attn_fn`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.config import RopeConfig
from xllm_py.models.deepseek_v3 import process_tree
from xllm_py.models.layers.norm import RMSNorm
from xllm_py.models.layers.rope import apply_rope, inverse_frequencies

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
_RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}  # the release's per-layer `compress_ratios`
SCORES = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
}


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
        if scoring not in SCORES:
            raise ValueError(
                f"config.json scoring_func={scoring!r} is not supported; use one of {list(SCORES)}"
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


# ---- small pieces ----------------------------------------------------------------------------


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS norm over the last dimension, in float32, back in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


class Rope:
    """Rotation of interleaved pairs (models/layers/rope.py's `apply_rope`) on the trailing
    `dim` channels of a head, at any positions."""

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        self.inv_freq = inverse_frequencies(rope, dim)
        self.scale = rope.cos_sin_scale

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """x [T, ..., D] rotated at positions [T] (by minus the angle with `inverse`)."""
        freqs = positions.float()[:, None] * self.inv_freq.to(x.device)  # [T, dim / 2]
        cis = torch.polar(torch.full_like(freqs, self.scale), freqs).unsqueeze(1)
        dim = 2 * freqs.shape[-1]
        rot = x[..., -dim:].reshape(x.shape[0], -1, dim)
        rot = apply_rope(rot, cis.conj() if inverse else cis).view(*x.shape[:-1], dim)
        return torch.cat([x[..., :-dim], rot], dim=-1)


def linear(dim_in: int, dim_out: int) -> nn.Linear:
    return nn.Linear(dim_in, dim_out, bias=False)


# ---- per-request state -----------------------------------------------------------------------


@dataclass
class CompressorState:
    """One compressor's tokens not yet in an entry, its emitted entries [E, width], and
    (overlapping compressors: CSA's and its indexer's) the last complete window's Ca
    series, which the next window's entry mixes in."""

    pending_kv: torch.Tensor | None = None  # [P < rate, projection width]
    pending_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None  # [E, width]
    overlap_kv: torch.Tensor | None = None  # [rate, width]
    overlap_gate: torch.Tensor | None = None


@dataclass
class LayerState:
    window: torch.Tensor | None = None  # the last sliding_window - 1 keys [W, head_dim]
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)


@dataclass
class V4State:
    """Everything one request's next forward pass needs from its past tokens."""

    layers: list[LayerState]
    position: int = 0  # tokens processed so far

    @classmethod
    def empty(cls, cfg: V4Config) -> V4State:
        return cls([LayerState() for _ in range(cfg.num_hidden_layers)])


# ---- compressors and the indexer ----------------------------------------------------------------


class Compressor(nn.Module):
    """Turns every `rate` tokens into one entry of `width` channels: the window's
    projections `wkv`, mixed by a softmax over the window of `wgate` + `ape` (a learned bias
    per slot), RMS-normed and rotated at the window's first position. `overlap` (CSA and
    its indexer): the projections are 2 x width, two series Ca | Cb; an entry mixes the
    window's Cb with the previous window's Ca over 2 x rate slots."""

    def __init__(
        self, hidden: int, width: int, rate: int, overlap: bool, rope: Rope, eps: float
    ) -> None:
        super().__init__()
        proj = 2 * width if overlap else width
        self.wkv = linear(hidden, proj)
        self.wgate = linear(hidden, proj)
        self.ape = nn.Parameter(torch.zeros(rate, proj, dtype=torch.float32))
        self.norm = RMSNorm(width, eps)
        self.width, self.rate, self.overlap, self.rope = width, rate, overlap, rope

    def forward(self, x: torch.Tensor, state: CompressorState) -> torch.Tensor:
        """Feed x [S, hidden] (the next S tokens); returns every entry so far [E, width]."""
        kv, gate = self.wkv(x), self.wgate(x)
        if state.pending_kv is not None:
            kv, gate = torch.cat([state.pending_kv, kv]), torch.cat([state.pending_gate, gate])
        usable = kv.shape[0] // self.rate * self.rate
        state.pending_kv, state.pending_gate = kv[usable:], gate[usable:]
        emitted = 0 if state.entries is None else state.entries.shape[0]
        if usable:
            n, r = usable // self.rate, self.rate
            kv = kv[:usable].view(n, r, -1)
            gate = gate[:usable].view(n, r, -1) + self.ape
            if self.overlap:
                kv, gate = self._overlapped(kv, gate, state)
            mixed = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
            positions = (torch.arange(n, device=x.device) + emitted) * self.rate
            new = self.rope(self.norm(mixed).unsqueeze(1), positions).squeeze(1)
            state.entries = new if state.entries is None else torch.cat([state.entries, new])
        if state.entries is None:
            state.entries = x.new_zeros((0, self.width))
        return state.entries

    def _overlapped(self, kv, gate, state: CompressorState):
        """[n, rate, 2w] -> [n, 2 rate, w]: the previous window's Ca, then this one's Cb
        (the first window's Ca from the state; before any, zero with weight zero)."""
        n, r, w = kv.shape[0], self.rate, self.width
        out_kv = kv.new_zeros((n, 2 * r, w))
        out_gate = gate.new_full((n, 2 * r, w), float("-inf"))
        out_kv[:, r:], out_gate[:, r:] = kv[..., w:], gate[..., w:]
        out_kv[1:, :r], out_gate[1:, :r] = kv[:-1, :, :w], gate[:-1, :, :w]
        if state.overlap_kv is not None:
            out_kv[0, :r], out_gate[0, :r] = state.overlap_kv, state.overlap_gate
        state.overlap_kv, state.overlap_gate = kv[-1, :, :w].clone(), gate[-1, :, :w].clone()
        return out_kv, out_gate


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own overlapping compressor (index_head_dim
    wide), query heads from the attention's query latent, and per query the score
    sum_h w_h(x) * ReLU(q_h . k) over the entries; returns the top `index_topk` entries a
    query may see ([S, k], -1 where fewer are complete)."""

    def __init__(self, cfg: V4Config, rope: Rope) -> None:
        super().__init__()
        self.compressor = Compressor(
            cfg.hidden_size, cfg.index_head_dim, cfg.csa_rate, True, rope, cfg.rms_norm_eps
        )
        self.wq_b = linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads)
        self.heads, self.dim, self.topk, self.rate = (
            cfg.index_n_heads,
            cfg.index_head_dim,
            cfg.index_topk,
            cfg.csa_rate,
        )
        self.rope = rope

    def forward(self, x, q_latent, positions, state: CompressorState) -> torch.Tensor:
        keys = self.compressor(x, state)  # [E, dim]
        q = self.rope(self.wq_b(q_latent).view(-1, self.heads, self.dim), positions)
        scores = F.relu(torch.einsum("shd,ed->she", q.float(), keys.float())) * self.dim**-0.5
        weights = self.weights_proj(x).float() * self.heads**-0.5  # [S, heads]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [S, E]
        visible = (positions + 1) // self.rate  # entries complete at each query
        future = torch.arange(keys.shape[0], device=x.device) >= visible[:, None]
        top = (
            scores.masked_fill(future, float("-inf"))
            .topk(min(self.topk, keys.shape[0]), dim=-1)
            .indices
        )
        return torch.where(top >= visible[:, None], torch.full_like(top, -1), top)


# ---- attention --------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: V4Config, kind: str, ropes: dict[str, Rope]) -> None:
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, h * d)
        self.wkv = linear(cfg.hidden_size, d)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)  # per group
        self.wo_b = linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.rope = ropes["main" if kind == SLIDING else "compress"]
        self.compressor = None
        if kind != SLIDING:
            rate = cfg.csa_rate if kind == CSA else cfg.hca_rate
            self.compressor = Compressor(
                cfg.hidden_size, d, rate, kind == CSA, self.rope, cfg.rms_norm_eps
            )
        self.indexer = Indexer(cfg, self.rope) if kind == CSA else None
        self.cfg, self.heads, self.dim, self.eps = cfg, h, d, cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: LayerState) -> torch.Tensor:
        """x [S, hidden] at positions [S] (contiguous, after the state's tokens)."""
        S, cfg = x.shape[0], self.cfg
        q_latent = self.q_norm(self.wq_a(x))
        q = self.rope(rms(self.wq_b(q_latent).view(S, self.heads, self.dim), self.eps), positions)
        kv = self.rope(self.norm(self.wkv(x)), positions)  # [S, dim]: key and value
        keys = kv if state.window is None else torch.cat([state.window, kv])
        state.window = keys[max(keys.shape[0] - (cfg.sliding_window - 1), 0) :]
        key_pos = (
            torch.arange(keys.shape[0], device=x.device) + int(positions[0]) - (keys.shape[0] - S)
        )
        age = positions[:, None] - key_pos[None, :]
        bias = torch.zeros((S, keys.shape[0]), dtype=torch.float32, device=x.device)
        bias.masked_fill_((age < 0) | (age >= cfg.sliding_window), float("-inf"))
        if self.compressor is not None:
            entries = self.compressor(x, state.compressor)
            extra = torch.full((S, entries.shape[0]), float("-inf"), device=x.device)
            if self.indexer is not None:  # CSA: the entries the indexer picked
                picked = self.indexer(x, q_latent, positions, state.indexer)
                rows = torch.arange(S, device=x.device)[:, None].expand_as(picked)
                ok = picked >= 0
                extra[rows[ok], picked[ok]] = 0.0
            else:  # HCA: every complete entry
                visible = (positions + 1) // self.compressor.rate
                extra.masked_fill_(
                    torch.arange(entries.shape[0], device=x.device) < visible[:, None], 0.0
                )
            keys, bias = torch.cat([keys, entries]), torch.cat([bias, extra], dim=1)
        logits = torch.einsum("shd,kd->shk", q, keys) * self.dim**-0.5 + bias[:, None, :].to(
            q.dtype
        )
        sink = self.attn_sink.to(logits.dtype).view(1, -1, 1).expand(S, -1, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = self.rope(torch.einsum("shk,kd->shd", probs, keys), positions, inverse=True)
        groups = out.reshape(S, cfg.o_groups, -1)  # [S, G, heads * dim / G]
        w = self.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)
        return self.wo_b(torch.einsum("sgi,goi->sgo", groups, w).reshape(S, -1))


# ---- MoE and hyper-connections ------------------------------------------------------------------


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (
            linear(hidden, inter),
            linear(inter, hidden),
            linear(hidden, inter),
        )
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long)
            )
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.hashed, self.cfg = hashed, cfg

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [S, k], weights [S, k])."""
        scores = SCORES[self.cfg.scoring_func](F.linear(x, self.weight))
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = (
                (scores + self.bias)
                .topk(self.cfg.num_experts_per_tok, dim=-1, sorted=False)
                .indices
            )
        w = scores.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.cfg.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        inter, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        self.gate = Gate(cfg, hashed)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, inter, limit) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = Expert(cfg.hidden_size, inter, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x, input_ids)
        out = self.shared_experts(x)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            out = out.index_add(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        return out


def hyper_weights(streams, fn, base, scale, cfg: V4Config):
    """mHC: (post [S, n], comb [S, n, n], x [S, hidden]) from the streams [S, n, hidden]:
    x = the streams collapsed by `pre`; comb made doubly stochastic by Sinkhorn-Knopp."""
    n = cfg.hc_mult
    mix = F.linear(rms(streams.flatten(1).float(), cfg.rms_norm_eps), fn.float())
    pre, post, comb = mix.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.split([n, n, n * n])
    pre = torch.sigmoid(pre * scale[0] + b_pre) + cfg.hc_eps
    post = 2 * torch.sigmoid(post * scale[1] + b_post)
    comb = torch.softmax(comb.view(-1, n, n) * scale[2] + b_comb.view(n, n), dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
    x = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, x


class DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, i: int, ropes: dict[str, Rope]) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.attn = Attention(cfg, cfg.layer_types[i], ropes)
        self.ffn = MoE(cfg, cfg.mlp_layer_types[i] == "hash_moe")
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        for part in ("attn", "ffn"):
            self.register_parameter(
                f"hc_{part}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size))
            )
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros((2 + n) * n)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))
        self.cfg = cfg

    def forward(self, streams, input_ids, positions, state: LayerState) -> torch.Tensor:
        cfg, dtype = self.cfg, streams.dtype
        post, comb, x = hyper_weights(
            streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, cfg
        )
        out = self.attn(self.attn_norm(x), positions, state)
        streams = (
            post.to(dtype).unsqueeze(-1) * out.unsqueeze(1)
            + comb.to(dtype).transpose(-1, -2) @ streams
        )
        post, comb, x = hyper_weights(
            streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, cfg
        )
        out = self.ffn(self.ffn_norm(x), input_ids)
        return (
            post.to(dtype).unsqueeze(-1) * out.unsqueeze(1)
            + comb.to(dtype).transpose(-1, -2) @ streams
        )


class HyperHead(nn.Module):
    """The last collapse of the streams into one hidden state."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.hc_fn = nn.Parameter(torch.zeros(n, n * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))
        self.cfg = cfg

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mix = F.linear(rms(streams.flatten(1).float(), self.cfg.rms_norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.cfg.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        ropes = {
            "main": Rope(cfg.main_rope, cfg.rope_dim),
            "compress": Rope(cfg.compress_rope, cfg.rope_dim),
        }
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, ropes) for i in range(cfg.num_hidden_layers)
        )
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = DeepseekV4Model(cfg)
        self.head = linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.head.weight = self.model.embed_tokens.weight

    def process_weights_after_loading(self) -> None:
        process_tree(self)

    def forward(self, input_ids: torch.Tensor, state: V4State) -> torch.Tensor:
        """The next tokens of one request, input_ids [S] -> hidden states [S, hidden];
        advances `state` past them."""
        positions = torch.arange(input_ids.shape[0], device=input_ids.device) + state.position
        h = self.model.embed_tokens(input_ids)
        streams = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer, layer_state in zip(self.model.layers, state.layers):
            streams = layer(streams, input_ids, positions, layer_state)
        state.position += input_ids.shape[0]
        return self.model.norm(self.model.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
