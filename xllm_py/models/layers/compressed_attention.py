"""DeepSeek-V4's attention over block-paged cache rows: a sliding window of the latest
`sliding_window` tokens, and on CSA / HCA layers the compressed entries of the context
(CSA: only those its lightning indexer picks), with a learned sink per head.

One cache row per token per layer (the worker allocates `[num_blocks, block_size, width]`
per layer, the width by the layer's kind; d = head_dim, i = index_head_dim):

    sliding  | kv d |
    HCA      | kv d | C.kv d  | C.gate d  |                         | C.entry d |
    CSA      | kv d | C.kv 2d | C.gate 2d | I.kv 2i | I.gate 2i   | C.entry d | I.key i |
             |<------------- written by every token ------------>|<-- by the token that -->|
                                                                   closes a window

- kv: the token's key, which is also its value (normed, rotated at its position); read by
  the next `sliding_window` queries.
- C.kv, C.gate: the token's projections that its compressor pools (CSA's are two series,
  Ca | Cb: Cb for its own window, Ca for the overlap the next window mixes in); I.kv,
  I.gate: the same for the indexer's own compressor.
- The token at position p with (p + 1) % m == 0 (m the layer's rate) closes window
  k = p // m: it pools its window's rows and writes entry k (and under CSA the indexer's
  key k) into its own row.

So everything a prefix's next token needs (its window's keys, the compressors' pending
tokens and overlap series, the entries) is the rows of the prefix's own tokens. A
prefix-cache hit at any block boundary (mid-window too), a request recomputed after
preemption and a prompt fed in chunks read what a cold whole-prompt run wrote; the model
reads it all through the block table, as V3 reads its latents. Known limit, not a
promise: rows are per token and never reclaimed. A token that has left the window and
whose window is compressed keeps its whole row, so a CSA layer costs 6d + 5i numbers per
token (3,712 at V4's d = 512, i = 128; V3's MLA row is 576), an HCA layer 4d.

Arithmetic (equal to HF transformers' DeepseekV4, tests/test_deepseek_v4.py): an entry is
the softmax over its window's slots of gate + ape (a learned bias per slot, per channel)
mixing the window's kv projections (CSA: the previous window's Ca, then this one's Cb, over
2m slots; before the first window, nothing), RMS-normed and rotated at the window's first
position. A query at p sees entries of windows complete at p (k < (p + 1) // m). Attention
logits, the sink and the output are dense torch over the gathered rows (no kernel yet):
each group's queries go `QUERY_CHUNK` at a time, each against its window's rows and every
entry of its request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.config import RopeConfig
from xllm_py.models.context import AttnGroup, get_forward_context
from xllm_py.models.deepseek_v4_config import CSA, SLIDING, V4Config
from xllm_py.models.layers.linear import Shard
from xllm_py.models.layers.norm import RMSNorm
from xllm_py.models.layers.rope import RotaryEmbedding, apply_rope
from xllm_py.parallel.context import SINGLE, ParallelContext

# Query rows of a group attended at once: bounds a prefill chunk's logits to
# [B, QUERY_CHUNK, heads, QUERY_CHUNK + sliding_window + entries].
QUERY_CHUNK = 256


def linear(dim_in: int, dim_out: int) -> nn.Linear:
    return nn.Linear(dim_in, dim_out, bias=False)


def shard(p: torch.Tensor, dim: int, parallel: ParallelContext) -> None:
    """Mark `p` as this tensor-parallel rank's part `dim`-wise of the checkpoint's tensor,
    which the loader reads as a slice (models/layers/linear.py `Shard`)."""
    if parallel.tp_size > 1:
        p.shard = Shard(dim, parallel.tp_rank, parallel.tp_size)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS norm over the last dimension, in float32, back in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


class Rope:
    """Rotation of the trailing `dim` channels of each head (interleaved pairs:
    layers/rope.py's `apply_rope`), by cos/sin tables computed once for every position."""

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int) -> None:
        self.table = RotaryEmbedding(rope, dim, max_positions)
        self.dim = dim

    def cis(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotation at each position [T]: [T, 1, dim / 2] (RotaryEmbedding's form)."""
        return self.table(positions)

    def rotate(self, x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [T, ..., D] rotated by `cis` (one row per T; by minus the angle with `inverse`)."""
        if inverse:
            cis = cis.conj() if cis.is_complex() else cis * cis.new_tensor([1.0, -1.0])
        rot = x[..., -self.dim :].reshape(x.shape[0], -1, self.dim)
        rot = apply_rope(rot, cis).view(*x.shape[:-1], self.dim)
        return torch.cat([x[..., : -self.dim], rot], dim=-1)


# ---- where a step's rows are ----------------------------------------------------------------


def slots_at(blocks: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` [N, K] in the block tables `blocks` [N, num_blocks]."""
    return blocks.gather(1, positions // block_size) * block_size + positions % block_size


@dataclass
class Windows:
    """The compression windows (rate m) that close in this step, N of them."""

    slots: torch.Tensor  # [N] the closing tokens' slots: where the entries go
    window: torch.Tensor  # [N, m] slots of each window's tokens
    previous: torch.Tensor  # [N, m] slots of the window before (any valid slot for window 0)
    has_previous: torch.Tensor  # [N] bool
    start: torch.Tensor  # [N] each window's first position: its entry rotates there


@dataclass
class Entries:
    """A group's compressed entries at one rate."""

    slots: torch.Tensor  # [B, E] slots of the tokens closing windows 0..E-1 (E: the longest)
    visible: torch.Tensor  # [B, Q, E] bool: the window is complete at the query
    closing: Windows


@dataclass
class GroupView:
    """One attention group (models/context.py) as V4's layers read it; built once a pass."""

    rows: torch.Tensor  # [B, Q] flat rows of the queries (padding rows repeat a valid one)
    valid: torch.Tensor  # [B, Q] bool
    window: torch.Tensor  # [B, W - 1 + Q] slots of positions start - (W - 1) ... end - 1
    window_mask: torch.Tensor  # [B, Q, W - 1 + Q] bool: that key is in the query's window
    entries: dict[int, Entries]  # by rate


def group_view(g: AttnGroup, block_size: int, window: int, rates) -> GroupView:
    """Where the queries of group `g`, their window's keys and their entries are."""
    dev = g.kv_blocks.device
    B, Q = g.batch, g.q_len
    ar = torch.arange(Q, device=dev)
    start = g.ctx_lens - g.q_lens
    valid = ar < g.q_lens[:, None]
    pos = start[:, None] + ar  # [B, Q]
    rows = g.q_index if g.q_index is not None else torch.arange(B * Q, device=dev).view(B, Q)
    key_pos = start[:, None] - (window - 1) + torch.arange(window - 1 + Q, device=dev)
    age = pos[:, :, None] - key_pos[:, None, :]
    mask = (age >= 0) & (age < window) & (key_pos >= 0)[:, None, :] & valid[:, :, None]
    in_context = torch.minimum(key_pos.clamp(min=0), g.ctx_lens[:, None] - 1)
    longest = int(g.ctx_lens.max())
    return GroupView(
        rows=rows,
        valid=valid,
        window=slots_at(g.kv_blocks, in_context, block_size),
        window_mask=mask,
        entries={r: _entries(g, block_size, r, pos, valid, longest) for r in rates},
    )


def _entries(g: AttnGroup, block_size: int, rate: int, pos, valid, longest: int) -> Entries:
    dev = pos.device
    k = torch.arange(longest // rate, device=dev)
    ends = ((k + 1) * rate - 1).expand(g.batch, -1)
    visible = (k < ((pos + 1) // rate)[:, :, None]) & valid[:, :, None]
    b, q = (valid & ((pos + 1) % rate == 0)).nonzero(as_tuple=True)
    last = pos[b, q]
    first = last + 1 - rate
    tokens = first[:, None] + torch.arange(rate, device=dev)  # [N, m]
    blocks = g.kv_blocks[b]
    closing = Windows(
        slots=slots_at(blocks, last[:, None], block_size)[:, 0],
        window=slots_at(blocks, tokens, block_size),
        previous=slots_at(blocks, (tokens - rate).clamp(min=0), block_size),
        has_previous=first >= rate,
        start=first,
    )
    return Entries(slots_at(g.kv_blocks, ends, block_size), visible, closing)


# ---- compressors and the indexer -------------------------------------------------------------


class Compressor(nn.Module):
    """Turns every `rate` tokens into one entry of `width` channels. `overlap` (CSA and its
    indexer): the projections are 2 x width, two series Ca | Cb; an entry mixes the
    window's Cb with the previous window's Ca over 2 x rate slots. Its token columns start
    at `token_col` (kv then gate), its entry's at `entry_col`."""

    def __init__(
        self,
        hidden: int,
        width: int,
        rate: int,
        overlap: bool,
        rope: Rope,
        eps: float,
        token_col: int,
        entry_col: int,
    ) -> None:
        super().__init__()
        self.proj = 2 * width if overlap else width
        self.wkv = linear(hidden, self.proj)
        self.wgate = linear(hidden, self.proj)
        self.ape = nn.Parameter(torch.zeros(rate, self.proj, dtype=torch.float32))
        self.norm = RMSNorm(width, eps)
        self.width, self.rate, self.overlap, self.rope = width, rate, overlap, rope
        self.token_col, self.entry_col = token_col, entry_col

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the tokens' columns [T, 2 x proj]: kv, then gate."""
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    def compress(self, rows: torch.Tensor, closing: Windows) -> None:
        """Pool every window that closes in this step into its entry, written into the
        closing token's row (`rows`: the layer's cache as [slots, width])."""
        if not closing.start.numel():
            return
        kv, gate = self._read(rows, closing.window)  # [N, m, proj]
        if self.overlap:
            w, first = self.width, ~closing.has_previous[:, None, None]
            prev_kv, prev_gate = self._read(rows, closing.previous)
            kv = torch.cat([prev_kv[..., :w].masked_fill(first, 0.0), kv[..., w:]], dim=1)
            gate = torch.cat(
                [prev_gate[..., :w].masked_fill(first, float("-inf")), gate[..., w:]], dim=1
            )
        mixed = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        entry = self.rope.rotate(self.norm(mixed).unsqueeze(1), self.rope.cis(closing.start))
        rows[closing.slots, self.entry_col : self.entry_col + self.width] = entry.squeeze(1).to(
            rows.dtype
        )

    def _read(self, rows: torch.Tensor, slots: torch.Tensor):
        """(kv, gate + ape) of the tokens at `slots` [N, m]: [N, m, proj] each."""
        cols = rows[:, self.token_col : self.token_col + 2 * self.proj]
        kv, gate = cols[slots].split([self.proj, self.proj], dim=-1)
        return kv, gate + self.ape

    def entries(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The entries stored at `slots` [B, E]: [B, E, width]."""
        return rows[:, self.entry_col : self.entry_col + self.width][slots]


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own overlapping compressor (index_head_dim
    wide: its entries are the keys), query heads from the attention's query latent, and per
    query the score sum_h w_h(x) * ReLU(q_h . k) / sqrt(index_head_dim) over the visible
    keys, of which it keeps the top `index_topk`."""

    def __init__(self, cfg: V4Config, rope: Rope, token_col: int, entry_col: int) -> None:
        super().__init__()
        self.compressor = Compressor(
            cfg.hidden_size, cfg.index_head_dim, cfg.csa_rate, True, rope,
            cfg.rms_norm_eps, token_col, entry_col,
        )  # fmt: skip
        self.wq_b = linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads)
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope = rope

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor, cis: torch.Tensor):
        """(queries [T, heads, dim], head weights [T, heads] float32) of the new tokens."""
        q = self.rope.rotate(self.wq_b(q_latent).view(-1, self.heads, self.dim), cis)
        return q, self.weights_proj(x).float() * self.heads**-0.5

    def pick(self, q, w, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [B, Q, heads, dim], w [B, Q, heads], keys [B, E, dim], visible [B, Q, E] ->
        bool [B, Q, E]: each query's top `index_topk` visible keys (all, when fewer)."""
        scores = F.relu(torch.einsum("bqhd,bed->bqhe", q.float(), keys.float())) * self.dim**-0.5
        index = (scores * w.unsqueeze(-1)).sum(dim=2).masked_fill(~visible, float("-inf"))
        top = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(-1, top, True) & visible


# ---- attention --------------------------------------------------------------------------------


class Attention(nn.Module):
    """Shared-KV multi-query attention of one layer over its cache rows (`cache_index`);
    `cache_width` numbers per token (module docstring)."""

    def __init__(
        self,
        cfg: V4Config,
        kind: str,
        ropes: dict[str, Rope],
        cache_index: int,
        parallel: ParallelContext = SINGLE,
    ):
        """Under tensor parallelism this rank holds its share of the query heads (and their
        sinks) and of the output groups, whole groups of whole heads; the key (one shared
        head), the compressors and the indexer are whole on every rank, which all write the
        same cache rows. The output is summed over the ranks (`wo_b`'s input columns)."""
        super().__init__()
        d, i = cfg.head_dim, cfg.index_head_dim
        h = parallel.split(cfg.num_attention_heads, "num_attention_heads")
        self.groups = parallel.split(cfg.o_groups, "o_groups")
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, h * d)
        self.wkv = linear(cfg.hidden_size, d)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        per_group = cfg.num_attention_heads * d // cfg.o_groups
        self.wo_a = linear(per_group, self.groups * cfg.o_lora_rank)  # block-diagonal, by group
        self.wo_b = linear(self.groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        for p, dim in ((self.wq_b.weight, 0), (self.wo_a.weight, 0), (self.wo_b.weight, 1),
                       (self.attn_sink, 0)):  # fmt: skip
            shard(p, dim, parallel)
        self.parallel = parallel
        self.rope_name = "main" if kind == SLIDING else "compress"
        self.rope = ropes[self.rope_name]
        proj = {SLIDING: 0, CSA: 2 * d}.get(kind, d)  # the compressor's projection width
        self.token_width = d + 2 * proj + (4 * i if kind == CSA else 0)
        self.cache_width = self.token_width + (d if proj else 0) + (i if kind == CSA else 0)
        self.compressor = self.indexer = None
        if kind != SLIDING:
            self.compressor = Compressor(
                cfg.hidden_size, d, cfg.rate(kind), kind == CSA, self.rope,
                cfg.rms_norm_eps, d, self.token_width,
            )  # fmt: skip
        if kind == CSA:
            self.indexer = Indexer(cfg, self.rope, d + 2 * proj, self.token_width + d)
        self.cfg, self.heads, self.dim, self.cache_index = cfg, h, d, cache_index

    def forward(self, x: torch.Tensor, cis: torch.Tensor, views: list[GroupView]) -> torch.Tensor:
        """x [T, hidden] of the step's tokens; cis: their rotation by this layer's RoPE."""
        T, cfg = x.shape[0], self.cfg
        q_latent = self.q_norm(self.wq_a(x))
        q = self.rope.rotate(
            rms(self.wq_b(q_latent).view(T, self.heads, self.dim), cfg.rms_norm_eps), cis
        )
        new = [self.rope.rotate(self.norm(self.wkv(x)), cis)]  # [T, dim]: key and value
        new += [c.project(x) for c in self.compressors()]
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.cache_index]
        rows = cache.view(-1, cache.shape[-1])
        rows[ctx.slot_mapping, : self.token_width] = torch.cat(new, dim=-1).to(rows.dtype)
        iq = None if self.indexer is None else self.indexer.queries(x, q_latent, cis)
        out = q.new_empty(T, self.heads, self.dim)
        for view in views:
            out[view.rows[view.valid]] = self._group(q, iq, rows, view)[view.valid]
        out = self.rope.rotate(out, cis, inverse=True)  # K = V carried the keys' rotation
        groups = out.reshape(T, self.groups, -1)  # [T, G, heads * dim / G]
        w = self.wo_a.weight.view(self.groups, cfg.o_lora_rank, -1)
        out = self.wo_b(torch.einsum("sgi,goi->sgo", groups, w).reshape(T, -1))
        return self.parallel.all_reduce(out)

    def compressors(self) -> list[Compressor]:
        """This layer's compressors, in the order of their token columns."""
        found = [self.compressor, None if self.indexer is None else self.indexer.compressor]
        return [c for c in found if c is not None]

    def _group(self, q, iq, rows: torch.Tensor, view: GroupView) -> torch.Tensor:
        """One group's attention output [B, Q, heads, dim] (padding rows: anything)."""
        q = q[view.rows]
        keys = rows[:, : self.dim][view.window]  # [B, W - 1 + Q, dim]
        entries = picked = None
        if self.compressor is not None:
            e = view.entries[self.compressor.rate]
            self.compressor.compress(rows, e.closing)
            entries, picked = self.compressor.entries(rows, e.slots), e.visible
            if self.indexer is not None:  # CSA: only the entries the indexer picks
                self.indexer.compressor.compress(rows, e.closing)
                index_keys = self.indexer.compressor.entries(rows, e.slots)
                picked = self.indexer.pick(iq[0][view.rows], iq[1][view.rows], index_keys, picked)
        W, Q = self.cfg.sliding_window, q.shape[1]
        out = []
        for a in range(0, Q, QUERY_CHUNK):
            b = min(a + QUERY_CHUNK, Q)
            k, mask = keys[:, a : b + W - 1], view.window_mask[:, a:b, a : b + W - 1]
            if entries is not None:
                k, mask = torch.cat([k, entries], dim=1), torch.cat([mask, picked[:, a:b]], -1)
            out.append(self._attend(q[:, a:b], k, mask))
        return torch.cat(out, dim=1)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, Q, heads, dim] over keys [B, K, dim] (also the values) where mask [B, Q, K],
        with the sink in the softmax."""
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device)
        bias = bias.masked_fill_(~mask, float("-inf")).to(q.dtype)
        logits = torch.einsum("bqhd,bkd->bqhk", q, keys) * self.dim**-0.5 + bias[:, :, None]
        sink = self.attn_sink.to(logits.dtype).view(1, 1, -1, 1).expand(*logits.shape[:3], 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("bqhk,bkd->bqhd", probs, keys.to(probs.dtype))
