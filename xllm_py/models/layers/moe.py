"""DeepSeek-V2/V3 mixture of experts: top-k routing, routed experts run grouped by expert,
plus always-on shared experts.

Routing, in float32 (docs/design.md section 3), by the config's scoring_func and
topk_method:
    s  = sigmoid(x Wg^T) or softmax(x Wg^T)   # [T, E] affinity
    noaux_tc (V3):  s' = s + e_score_correction_bias, only used to *choose* experts;
        group score = sum of the top-2 s' per group; keep `topk_group` groups, the rest
        masked with -inf; pick the top `num_experts_per_tok` of s'.
    group_limited_greedy (V2): group score = max s per group; keep `topk_group` groups;
        pick the top `num_experts_per_tok` of s among them.
    greedy (V2-Lite): the top `num_experts_per_tok` of s.
    weight = s at the picks (never the bias), / sum when norm_topk_prob,
             * routed_scaling_factor
Expert execution sorts the T * top_k (token, expert) assignments by expert so
each active expert runs one matmul over all of its tokens.

Parallel (parallel/context.py): routing is replicated, so every rank picks
the same experts. ep_size == 1: every expert is split on its intermediate dim.
ep_size > 1: this rank holds experts [first_expert, first_expert + E/ep) whole
(`experts` is keyed by global id, so checkpoint names load unchanged; the other
ranks' experts are `remote_weight_prefixes`, which the loader skips) and runs
only the assignments to them. Either way the routed and shared partial sums are
added and all-reduced once.
DP attention (parallel.dp_attention): each rank routes its own tokens, sends every
(token, expert) assignment's activations to the rank holding that expert, runs the
assignments it receives, and sends the results back, where they are weighted and summed
(`_exchanged`: counts, activations and expert ids out, results back, four all-to-alls).
The shared experts are whole on every rank; nothing is all-reduced.

Lockstep: each exchange needs every rank, in the same layer order. So on every rank a step
is one target forward (a rank with nothing scheduled joins its exchanges with no tokens:
`idle_forward`, worker/model_runner.py), then the MTP draft passes, whose number the ranks
agree on first by one small all-reduce (speculative/mtp_proposer.py); a rank with fewer
passes of its own, or whose chains stopped early (the context end, a grammar), joins the
rest with no tokens. The engine steps every rank whenever any has work
(engine/dp_engine_core.py), so a rank with no requests for many steps still runs them.

Held weights (`w13`, `w2`): run-dtype tensors, FP8-resident `Fp8Weight`s
(weights/fp8.py), or, built inside `int4.int4_resident(group)` (--weight_dtype int4),
packed INT4 `Int4Weight`s (weights/int4.py): the routed experts only, the shared experts
stay in the run dtype as Kimi-K2-Thinking stores them.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.config import ModelConfig
from xllm_py.models.layers.linear import Weight, cat_weights, dense, stack_weights
from xllm_py.models.layers.mlp import MLP, swiglu
from xllm_py.parallel.context import SINGLE, ParallelContext
from xllm_py.weights import int4

if TYPE_CHECKING:
    from xllm_py.ops.backends import Kernels

# Up to this many (token, expert) assignments, experts run pair by pair (see _routed_small).
SMALL_BATCH_ASSIGNMENTS = 8
# In graph mode, up to this many assignments gather the chosen experts' weights; more run
# the grouped form as one opaque op (see _routed_gathered, routed_grouped). Measured on the
# bundled small model (top-4 of 16 experts), 2 CPU threads, ms per step: verifying one
# draft each for 4 requests (32 assignments) 56-64 gathered, 74 grouped; a plain step of 8
# requests (32) 49-54 gathered, 52-56 grouped.
GRAPH_GATHER_ASSIGNMENTS = 32


# DP attention: the MoE layers whose exchange `moe_exchange` runs, by key (graph mode's
# graphs hold the exchange as one op, which reaches its layer here)
_EXCHANGES: weakref.WeakValueDictionary[int, MoE] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class Router(nn.Module):
    """Checkpoint names: `mlp.gate.weight`, `mlp.gate.e_score_correction_bias` (noaux_tc only)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        # Routing decisions are made in float32 whatever the run dtype.
        f32 = torch.float32
        self.weight = nn.Parameter(
            torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=f32), requires_grad=False
        )
        self.softmax = cfg.scoring_func == "softmax"
        self.method = cfg.topk_method
        if self.method == "noaux_tc":  # only V3's routing has (and loads) a correction bias
            self.register_buffer(
                "e_score_correction_bias", torch.empty(cfg.n_routed_experts, dtype=f32)
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, top_k] float32, expert ids [T, top_k])."""
        logits = F.linear(x if x.dtype == torch.float32 else x.float(), self.weight)
        scores = logits.softmax(dim=-1) if self.softmax else logits.sigmoid()
        choice = scores
        if self.method == "noaux_tc":
            choice = scores + self.e_score_correction_bias
        # with every group kept, masking is a no-op
        if self.method != "greedy" and self.topk_group < self.n_group:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            if self.method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
            else:
                group_scores = grouped.amax(dim=-1)
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
            choice = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view_as(scores)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        E, ep = cfg.n_routed_experts, parallel.ep_size
        self.parallel = parallel
        self.num_experts = E
        self.num_local_experts = parallel.split(E, "n_routed_experts", over="ep_size")
        self.first_expert = parallel.ep_rank * self.num_local_experts
        local = range(self.first_expert, self.first_expert + self.num_local_experts)
        self.remote_weight_prefixes = tuple(f"experts.{e}." for e in range(E) if e not in local)
        self.gate = Router(cfg)
        # Under expert parallelism an owned expert is whole on this rank.
        expert_parallel = SINGLE if ep > 1 else parallel
        with int4.packed_linears(int4.resident_group()):  # None: as the model's other linears
            self.experts = nn.ModuleDict(
                {
                    str(e): MLP(
                        cfg.hidden_size,
                        cfg.moe_intermediate_size,
                        expert_parallel,
                        reduce=False,
                        name="moe_intermediate_size",
                    )
                    for e in local
                }
            )
        self.shared_experts = (
            MLP(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                parallel,
                reduce=False,
                name="moe_intermediate_size * n_shared_experts",
            )
            if cfg.n_shared_experts
            else None
        )
        self.w13: Weight | None = None  # [E_local, 2 * inter_local, hidden] after loading
        self.w2: Weight | None = None  # [E_local, hidden, inter_local]
        self.quantized = False  # FP8-resident or packed INT4 expert stacks
        # The fused routed-expert kernel when --moe_backend chose one (ops/backends.py),
        # else None: the torch forms below.
        self.fused_moe = None
        if parallel.dp_attention:
            self.exchange_key = next(_KEYS)
            _EXCHANGES[self.exchange_key] = self

    def process_weights_after_loading(self) -> None:
        # Runs before the model visits children: the per-expert modules are gone by then.
        # The shared experts are processed on their own.
        w13, w2 = [], []
        for e in self.experts.values():
            for lin in (e.gate_proj, e.up_proj, e.down_proj):
                lin.process_weights_after_loading()
            w13.append(cat_weights([e.gate_proj.weight, e.up_proj.weight]))
            w2.append(e.down_proj.weight)
        self.w13, self.w2 = stack_weights(w13), stack_weights(w2)
        self.quantized = not isinstance(self.w13, torch.Tensor)
        del self.experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.parallel.dp_attention:
            out = moe_exchange(x, weights.to(x.dtype), ids, self.exchange_key)
        else:
            out = self._routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.parallel.all_reduce(out)

    def idle(self, dtype: torch.dtype, device: torch.device) -> None:
        """DP attention, a rank without tokens this pass: join the layer's exchange."""
        x = torch.empty(0, self.gate.weight.shape[1], dtype=dtype, device=device)
        top_k = self.gate.top_k
        ids = torch.empty(0, top_k, dtype=torch.long, device=device)
        self._exchanged(x, torch.empty(0, top_k, dtype=dtype, device=device), ids)

    def _exchanged(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """The routed experts under DP attention: every assignment runs on its expert's rank."""
        par, n_local = self.parallel, self.num_local_experts
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        dest = flat // n_local  # the rank holding each assignment's expert
        order = dest.argsort(stable=True)  # assignments grouped by rank, tokens in order
        send = torch.bincount(dest, minlength=par.dp_size)
        recv = par.counts_to_all(send)
        send_n, recv_n = send.tolist(), recv.tolist()
        token_of = order // top_k
        xs = par.all_to_all(x[token_of], send_n, recv_n)
        experts = par.all_to_all(flat[order] % n_local, send_n, recv_n)  # local ids there
        ones = torch.ones(len(experts), 1, dtype=x.dtype, device=x.device)
        ys = self._routed(xs, ones, experts.view(-1, 1), first_expert=0) if len(xs) else xs
        back = par.all_to_all(ys, recv_n, send_n)  # in the order the assignments left
        back = back * weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token_of, back)

    def use_kernels(self, kernels: Kernels) -> None:
        self.fused_moe = kernels.fused_moe()

    def _routed(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        first_expert: int | None = None,
    ) -> torch.Tensor:
        """Ids are global expert ids, or local ones with first_expert=0 (DP attention)."""
        weights = weights.to(x.dtype)
        first = self.first_expert if first_expert is None else first_expert
        if self.fused_moe is not None:  # every batch size, eager and compiled
            return self.fused_moe(x, weights, ids, self.w13, self.w2, first)
        if torch.compiler.is_compiling() and ids.numel() <= GRAPH_GATHER_ASSIGNMENTS:
            return self._routed_gathered(x, weights, ids)  # graph mode, few tokens
        if not torch.compiler.is_compiling() and ids.numel() <= SMALL_BATCH_ASSIGNMENTS:
            return self._routed_small(x, weights, ids, first)
        if torch.compiler.is_compiling() and not self.quantized:  # one opaque op in a graph
            return routed_grouped(x, weights, ids, self.w13, self.w2, first)
        # eager, and FP8-resident or packed INT4 stacks: the op's body, without the op's
        # dispatcher (its first call imports torch._dynamo: seconds of every process's CPU)
        return grouped_experts(x, weights, ids, self.w13, self.w2, first)

    def _routed_small(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int
    ) -> torch.Tensor:
        """Few tokens (decode at small batch): one expert call per (token, expert) pair
        costs fewer ops than sorting and scattering."""
        rows, n_local = [], self.num_local_experts
        for t, experts in enumerate(ids.tolist()):
            xt, out = x[t : t + 1], None
            for j, e in enumerate(experts):
                if not first <= e < first + n_local:
                    continue  # another rank's expert
                y = swiglu(xt, self.w13[e - first], self.w2[e - first]) * weights[t, j]
                out = y if out is None else out + y
            rows.append(torch.zeros_like(xt) if out is None else out)
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _routed_gathered(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Few tokens, graph mode: each (token, expert) pair multiplies by its expert's
        weights gathered by id, so only the chosen experts are read; another rank's expert
        gets weight 0 (and reads local expert 0 instead)."""
        T, top_k = ids.shape
        local = ids - self.first_expert
        owned = (local >= 0) & (local < self.num_local_experts)
        idx = torch.where(owned, local, 0).view(-1)  # [A = T * top_k]
        xa = x.unsqueeze(1).expand(T, top_k, x.shape[1]).reshape(T * top_k, -1, 1)
        w13, w2 = dense(self.w13[idx], x.dtype), dense(self.w2[idx], x.dtype)
        gate, up = torch.bmm(w13, xa).squeeze(-1).chunk(2, dim=-1)  # [A, I] each
        act = F.silu(gate) * up * torch.where(owned, weights, 0).view(-1, 1)
        y = torch.bmm(w2, act.unsqueeze(-1)).view(T, top_k, -1)
        return y.sum(dim=1)


@torch.library.custom_op("xllm::moe_exchange", mutates_args=())
def moe_exchange(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, key: int
) -> torch.Tensor:
    """DP attention: MoE layer `key`'s routed experts over its exchange (`MoE._exchanged`).
    An operator the compiler does not look into: its counts are read on the host and its
    all-to-alls have data-dependent sizes, so in graph mode it runs as eager code does,
    and ranks whose batches fall in different buckets still meet in it."""
    return _EXCHANGES[key]._exchanged(x, weights, ids)


@moe_exchange.register_fake
def _(x, weights, ids, key):
    return torch.empty_like(x)


@torch.library.custom_op("xllm::routed_grouped", mutates_args=())
def routed_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first_expert: int,
) -> torch.Tensor:
    """The routed experts over many tokens: the (token, expert) assignments sorted by
    expert, one matmul pair per active local expert (`w13`/`w2`: experts first_expert ..
    first_expert + E_local - 1; assignments to other ranks' experts are dropped).

    An operator the compiler does not look into: in graph mode its host syncs (the
    per-expert counts) and data-dependent loop stay inside one op of the graph, which
    runs it as eager code does (measured against a static dense form, every expert over
    every token: docs/graph_mode.md). Eager code calls the body, `grouped_experts`."""
    return grouped_experts(x, weights, ids, w13, w2, first_expert)


def grouped_experts(x, weights, ids, w13: Weight, w2: Weight, first_expert: int) -> torch.Tensor:
    """The body of `routed_grouped`, for run-dtype, FP8-resident or packed INT4 stacks."""
    top_k, n_local = ids.shape[1], w13.shape[0]
    flat_ids = ids.view(-1) - first_expert  # local expert ids; another rank's -> n_local
    flat_ids = flat_ids.masked_fill((flat_ids < 0) | (flat_ids >= n_local), n_local)
    order = flat_ids.argsort()  # assignments grouped by expert
    counts = torch.bincount(flat_ids, minlength=n_local + 1).tolist()[:n_local]
    order = order[: sum(counts)]  # drop the assignments to other ranks' experts
    token_of = order // top_k  # [assignments] source token of each sorted assignment
    xs = x[token_of]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start : start + n] = swiglu(xs[start : start + n], w13[e], w2[e])
            start += n
    ys = ys * weights.view(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token_of, ys)


@routed_grouped.register_fake
def _(x, weights, ids, w13, w2, first_expert):
    return torch.empty_like(x)


def idle_forward(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """DP attention: join every expert exchange of a forward of `module` (its MoE layers in
    registration order, which is the order a forward runs them) with no tokens."""
    for moe in module.modules():
        if isinstance(moe, MoE):
            moe.idle(dtype, device)
