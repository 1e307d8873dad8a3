"""DeepSeek-V4 causal LM (V4-Flash, V4-Pro), served over block-paged cache rows.

    streams_0 = [embed(ids)] * hc_mult                       # mHC: hc_mult residual streams
    for each layer i:
        post, comb, x = attn_hc(streams)                     # collapse the streams into x
        streams = post * Attention_i(attn_norm(x)) + comb^T @ streams
        post, comb, x = ffn_hc(streams)
        streams = post * MoE_i(ffn_norm(x)) + comb^T @ streams
    logits = head(norm(hc_head(streams)))

Attention is shared-KV multi-query attention (one head_dim-wide head read as key and
value) over a sliding window of the latest `sliding_window` tokens, with a learned sink per
head in the softmax. A layer is one of three kinds (`layer_types`):
- sliding_attention: the window only;
- compressed_sparse_attention (CSA): also compressed entries, one per `m` tokens (m = 4),
  each a softmax-gated mix of 2m tokens (the window's own and the one before: two series
  Cb and Ca of one projection), of which a lightning indexer picks `index_topk` per query;
- heavily_compressed_attention (HCA): also compressed entries, one per m' tokens
  (m' = 128), non-overlapping, all of them attended.
A token only sees entries of complete windows that end at or before it. Sliding layers
rotate with the `main` RoPE, CSA/HCA layers (and their compressors and indexer) with the
`compress` one (its own theta, YaRN with an attention factor of 1); both are tables
computed once (layers/rope.py's RotaryEmbedding), looked up once a pass. The attention
output is rotated back by its query's position (K = V carried the keys' rotation) and
projected by `o_groups` block-diagonal groups (`wo_a`) and one mix (`wo_b`). That layer,
its compressors and indexer, and the per-token cache rows they read and write through the
block table (so prefix caching, preemption and chunked prefill need nothing of their own)
are models/layers/compressed_attention.py.

The MoE routes the first layers (`mlp_layer_types` "hash_moe") by a frozen token-to-expert
table `tid2eid`, the rest by top-k of `sqrtsoftplus` scores plus a correction bias; the
chosen scores are normalised and scaled, expert gate and up activations are clamped at
`swiglu_limit`, and one shared expert is added. The routed experts run as a loop over the
chosen ones (torch), or with --moe_backend triton as two stacks through the fused MoE
kernels (ops/fused_moe.py, the clamp inside them).

Like V3, `forward(input_ids, positions)` takes a flat batch of any requests' tokens, and the
batch's layout in the cache arrives through `models.context`; it returns the streams before
the head's collapse (`hc_head`, `norm`: `compute_logits` applies them), since the MTP draft
(models/deepseek_v4_mtp.py) drafts from the streams. Checked against HF transformers'
`DeepseekV4ForCausalLM` (tests/test_deepseek_v4.py, one request in chunks) and through
the engine (tests/test_deepseek_v4_engine.py). The release's quantised weights (block-FP8
attention and shared experts, FP4 routed experts) are dequantised by the loader, or the
routed experts kept packed (weights/fp4.py `Fp4Linear`, --weight_dtype fp4). Tensor and
expert parallelism: `DeepseekV4ForCausalLM`. Not here: DP attention, graph mode (config.py
refuses them for V4). Parameter names are those HF's `save_pretrained` writes (the
release's: `attn.wq_a`, `attn.compressor.ape`, `ffn.gate.tid2eid`, `hc_attn_fn`, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.models.context import get_forward_context
from xllm_py.models.deepseek_v3 import process_tree
from xllm_py.models.deepseek_v4_config import CSA, HCA, SLIDING, V4Config
from xllm_py.models.layers.compressed_attention import (
    Attention,
    GroupView,
    Rope,
    group_view,
    linear,
    rms,
    shard,
)
from xllm_py.models.layers.norm import RMSNorm
from xllm_py.models.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from xllm_py.parallel.context import SINGLE, ParallelContext
from xllm_py.weights import fp4

__all__ = ["CSA", "HCA", "SLIDING", "DeepseekV4ForCausalLM", "V4Config"]

SCORES = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
}


# ---- MoE and hyper-connections ------------------------------------------------------------------


class Expert(nn.Module):
    def __init__(
        self,
        hidden: int,
        inter: int,
        limit: float,
        routed: bool = False,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        """`routed`: a routed expert, whose matrices may be held packed (weights/fp4.py).
        Under tensor parallelism this rank holds a share of the intermediate columns (w1
        and w3 rows, w2 columns) and its output is a partial sum."""
        super().__init__()
        inter = parallel.split(inter, "moe_intermediate_size")
        make = fp4.expert_linear if routed else linear
        self.w1, self.w2, self.w3 = make(hidden, inter), make(inter, hidden), make(hidden, inter)
        if parallel.tp_size > 1 and isinstance(self.w1, fp4.Fp4Linear):
            raise ValueError(
                "weight_dtype=fp4 with tensor parallelism keeps routed experts packed only "
                "whole: set --ep_size equal to the ranks per replica"
            )
        for p, dim in ((self.w1.weight, 0), (self.w3.weight, 0), (self.w2.weight, 1)):
            shard(p, dim, parallel)
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
    def __init__(self, cfg: V4Config, hashed: bool, parallel: ParallelContext = SINGLE) -> None:
        """Expert parallel (ep_size > 1: the tensor-parallel ranks): this rank holds
        experts [first_expert, first_expert + E / ep) whole (`experts`, keyed by global id
        as the checkpoint names them; the others are `remote_weight_prefixes`, which the
        loader skips). Otherwise every routed expert is split over the tensor-parallel
        ranks on its intermediate columns, as the shared expert always is. Either way the
        ranks' partial sums are added once."""
        super().__init__()
        inter, limit, E = cfg.moe_intermediate_size, cfg.swiglu_limit, cfg.n_routed_experts
        n_local = parallel.split(E, "n_routed_experts", over="ep_size")
        self.first_expert = parallel.ep_rank * n_local if parallel.ep_size > 1 else 0
        local = range(self.first_expert, self.first_expert + n_local)
        self.remote_weight_prefixes = tuple(f"experts.{e}." for e in range(E) if e not in local)
        self.gate = Gate(cfg, hashed)
        routed_tp = SINGLE if parallel.ep_size > 1 else parallel
        self.experts = nn.ModuleDict(
            {str(e): Expert(cfg.hidden_size, inter, limit, True, routed_tp) for e in local}
        )
        self.shared_experts = Expert(cfg.hidden_size, inter, limit, parallel=parallel)
        self.parallel = parallel
        self.fused_moe = None  # ops/fused_moe.py's kernels, with --moe_backend triton
        self.w13 = self.w2 = None  # then the experts' stacks (`use_kernels`)

    def use_kernels(self, kernels) -> None:
        """With the fused MoE kernels (ops/backends.py), the routed experts become two
        stacks, [E, 2 * inter, hidden] (w1 rows, then w3's) and [E, hidden, inter]; packed
        FP4 experts stay packed (`Fp4Weight`, unpacked tile by tile in the kernels)."""
        self.fused_moe = kernels.fused_moe()
        if self.fused_moe is None:
            return
        experts = list(self.experts.values())
        with torch.no_grad():
            if isinstance(experts[0].w1, fp4.Fp4Linear):
                held = [[fp4.Fp4Weight(m.weight, m.weight_scale_inv) for m in (e.w1, e.w3, e.w2)]
                        for e in experts]  # fmt: skip
                self.w13 = fp4.Fp4Weight.stack([fp4.Fp4Weight.cat(h[:2]) for h in held])
                self.w2 = fp4.Fp4Weight.stack([h[2] for h in held])
            else:
                self.w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts])
                self.w2 = torch.stack([e.w2.weight for e in experts])
        del self.experts

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x, input_ids)
        out = self.shared_experts(x)
        if self.fused_moe is not None:
            routed = self.fused_moe(x, weights, ids, self.w13, self.w2, self.first_expert,
                                    swiglu_limit=self.shared_experts.limit)  # fmt: skip
            return self.parallel.all_reduce(out + routed)
        for e in ids.unique().tolist():
            if str(e) not in self.experts:
                continue  # another rank's
            rows, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[str(e)](x[rows]) * weights[rows, slot, None]
            out = out.index_add(0, rows, y)
        return self.parallel.all_reduce(out)


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
    def __init__(
        self,
        cfg: V4Config,
        i: int,
        ropes: dict[str, Rope],
        kind: str = "",
        hashed: bool = False,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        """Layer i of the config's (its kind and routing from `layer_types` and
        `mlp_layer_types`), or past them (an MTP block: `kind` and `hashed` given)."""
        super().__init__()
        n = cfg.hc_mult
        if i < len(cfg.layer_types):
            kind, hashed = cfg.layer_types[i], cfg.mlp_layer_types[i] == "hash_moe"
        self.attn = Attention(cfg, kind, ropes, i, parallel)
        self.ffn = MoE(cfg, hashed, parallel)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        for part in ("attn", "ffn"):
            self.register_parameter(
                f"hc_{part}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size))
            )
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros((2 + n) * n)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))
        self.cfg = cfg

    def forward(self, streams, input_ids, cis: dict[str, torch.Tensor], views) -> torch.Tensor:
        """streams [T, hc_mult, hidden] of the step's tokens; cis: their rotations by RoPE
        name; views: the batch's attention groups (`group_view`)."""
        cfg, dtype = self.cfg, streams.dtype
        post, comb, x = hyper_weights(
            streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, cfg
        )
        out = self.attn(self.attn_norm(x), cis[self.attn.rope_name], views)
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
        return collapse(streams, self.hc_fn, self.hc_base, self.hc_scale, self.cfg)


def collapse(streams, fn, base, scale, cfg: V4Config) -> torch.Tensor:
    """streams [S, n, hidden] -> one hidden state [S, hidden], mixed by `pre` weights."""
    mix = F.linear(rms(streams.flatten(1).float(), cfg.rms_norm_eps), fn.float())
    pre = torch.sigmoid(mix * scale.float() + base.float()) + cfg.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: V4Config, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.ropes = {
            "main": Rope(cfg.main_rope, cfg.rope_dim, cfg.max_position_embeddings),
            "compress": Rope(cfg.compress_rope, cfg.rope_dim, cfg.max_position_embeddings),
        }
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.ropes, parallel=parallel)
            for i in range(cfg.num_hidden_layers)
        )
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    """Under tensor (and expert) parallelism (`parallel`) each rank holds its share of the
    attention heads and experts (compressed_attention.py `Attention`, `MoE` here) and of
    the embedding's and head's vocabulary rows (layers/vocab_parallel.py); the
    hyper-connections, compressors and indexer are whole on every rank. DP attention is
    not built for V4."""

    def __init__(self, cfg: V4Config, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        if parallel.dp_attention:
            raise ValueError(
                "DeepseekV4ForCausalLM: DP attention (--enable_dp_attention) is not "
                "implemented for DeepSeek-V4; use tensor and expert parallelism"
            )
        self.config = cfg
        self.parallel = parallel
        self.model = DeepseekV4Model(cfg, parallel)
        self.head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, parallel)
        if cfg.tie_word_embeddings:
            self.head.weight = self.model.embed_tokens.weight

    @property
    def num_cache_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def cache_dims(self) -> list[int]:
        """Numbers per token of each layer's cache row (compressed_attention.py)."""
        return [layer.attn.cache_width for layer in self.model.layers]

    def process_weights_after_loading(self) -> None:
        process_tree(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] (any requests' tokens, laid out by the forward context)
        -> the last layer's residual streams [T, hc_mult, hidden], before the head's collapse
        (`compute_logits` does that): the MTP layer drafts from them (deepseek_v4_mtp.py)."""
        views, cis = self.views_and_rotations(positions)
        h = self.model.embed_tokens(input_ids)
        streams = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            streams = layer(streams, input_ids, cis, views)
        return streams

    def views_and_rotations(self, positions: torch.Tensor):
        """The batch's attention groups (`group_view`) and the positions' rotations by each
        RoPE, for this pass's layers."""
        ctx = get_forward_context()
        block_size = ctx.kv_caches[0].shape[1]
        cfg = self.config
        views: list[GroupView] = [
            group_view(g, block_size, cfg.sliding_window, cfg.rates) for g in ctx.groups
        ]
        return views, {name: rope.cis(positions) for name, rope in self.model.ropes.items()}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Residual streams [T, hc_mult, hidden] -> logits [T, vocab] (float32)."""
        return self.head(self.model.norm(self.model.hc_head(hidden))).float()
