"""Multi-head Latent Attention (DeepSeek-V2/V3) over a paged latent cache.

Per token and layer the cache holds `c_kv` (kv_lora_rank, after
kv_a_layernorm) and the roped shared key `k_pe` (qk_rope_head_dim): one row of
the `[num_slots, kv_lora_rank + qk_rope_head_dim]` cache, whatever the head
count.

Two equivalent forms (tests check they agree):
  expanded  K, V = kv_b_proj(c_kv) per head, then ordinary attention over the
            context gathered from the cache; cheaper when many queries share the
            context (prefill).
  absorbed  kv_b_proj viewed as [H, nope + v, kv_lora]; its key half W_UK is
            folded into the query (q_nope @ W_UK is a latent query) and its
            value half W_UV into the output, so attention runs directly over
            the cached latents (decode, draft verification), read in place
            through the block table by the kernel --attention_backend chose
            (ops/paged_mla.py: block-wise torch, or Triton).

Tensor parallel: heads split across the tp ranks. q_b_proj (or q_proj) and
kv_b_proj are column-split by head (their output rows are grouped per head),
o_proj is row-split and its output all-reduced; q_a_proj, kv_a_proj_with_mqa
and the norms are replicated. `num_heads` is this rank's head count, so both
forms work on the local heads only; the cached latent is per token and full on
every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.config import ModelConfig
from xllm_py.models.attention_layout import expanded_mask
from xllm_py.models.context import AttnGroup, get_forward_context
from xllm_py.models.layers.indexer import Indexer
from xllm_py.models.layers.linear import (
    ColumnParallelLinear,
    Linear,
    RowParallelLinear,
    cat_weights,
    dense,
    linear,
)
from xllm_py.models.layers.norm import RMSNorm
from xllm_py.models.layers.rope import apply_rope
from xllm_py.ops.paged_mla import paged_mla_torch
from xllm_py.ops.rotary import apply_rope_triton
from xllm_py.parallel.context import SINGLE, ParallelContext

if TYPE_CHECKING:
    from xllm_py.ops.backends import Kernels


class MLAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, cache_index: int, parallel: ParallelContext = SINGLE
    ) -> None:
        super().__init__()
        self.cache_index = cache_index  # which layer of the paged cache this attention owns
        self.num_heads = parallel.split(cfg.num_attention_heads, "num_attention_heads")  # local
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.scale = cfg.softmax_scale
        hidden, heads, qk_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, parallel)
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank)
            # Like DeepSeek's own code and HF, the two MLA norms keep eps = 1e-6 whatever
            # config.json says; rms_norm_eps is the decoder norms' (same value in V3).
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * qk_dim, parallel)
        self.kv_a_proj_with_mqa = Linear(hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(
            cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), parallel
        )
        self.o_proj = RowParallelLinear(heads * cfg.v_head_dim, hidden, parallel)
        # DeepSeek-V3.2's sparse attention: each query attends to the tokens its indexer picks
        self.indexer = Indexer(cfg) if cfg.index_topk else None
        # The absorbed form's kernel (ops/backends.py; the worker may install another).
        self.paged_mla = paged_mla_torch
        # The rotary kernel, chosen with the attention backend: models/layers/rope.py's
        # apply_rope, or with the Triton backend ops/rotary.py's (same contract).
        self.rotate = apply_rope

    def process_weights_after_loading(self) -> None:
        # Every projection that reads x runs as one matmul: [q (or q_a) | c_kv | k_pe].
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        for lin in (first, self.kv_a_proj_with_mqa, self.kv_b_proj):
            lin.process_weights_after_loading()
        self.w_in = cat_weights([first.weight, self.kv_a_proj_with_mqa.weight])
        self.q_in_dim = first.weight.shape[0]
        if self.q_lora_rank is None:
            del self.q_proj
        else:
            del self.q_a_proj
        del self.kv_a_proj_with_mqa
        # The absorbed forms' copies stay in the run dtype (small next to the experts), and
        # kv_b_proj keeps its own form for the expanded path.
        w = dense(self.kv_b_proj.weight, self.kv_a_layernorm.weight.dtype)
        w = w.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.nope_dim, :].contiguous()  # [H, nope, kv_lora]
        self.w_uv = w[:, self.nope_dim :, :].transpose(1, 2).contiguous()  # [H, kv_lora, v]

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, q_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `q_scale` [T] multiplies each token's query (Llama-4
        scaling: its attention logits), after the rotation as HF's Mistral-4 does."""
        T = x.shape[0]
        q, c_kv, k_pe = linear(x, self.w_in).split(
            [self.q_in_dim, self.kv_lora_rank, self.rope_dim], dim=-1
        )
        if self.q_lora_rank is not None:
            q_resid = self.q_a_layernorm(q)
            q = self.q_b_proj(q_resid)
        q = q.view(T, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        # One rotation for the query heads and the shared key together: [T, H + 1, rope].
        q_pe, k_pe = self.rotate(torch.cat([q_pe, k_pe.unsqueeze(1)], dim=1), rope).split(
            [self.num_heads, 1], dim=1
        )
        k_pe = k_pe.squeeze(1)
        if q_scale is not None:
            s = q_scale.view(T, 1, 1).to(q_nope.dtype)
            q_nope, q_pe = q_nope * s, q_pe * s

        ctx = get_forward_context()
        cache = ctx.kv_caches[self.cache_index]  # [num_blocks, block_size, kv_lora + rope]
        new = [self.kv_a_layernorm(c_kv), k_pe]
        iq = None  # DSA: the indexer's queries and head weights, its key cached beside c_kv
        if self.indexer is not None:
            new.append(self.indexer.key(x, rope))
            iq = self.indexer.query(x, q_resid, rope)
        cache.view(-1, cache.shape[-1]).index_copy_(0, ctx.slot_mapping, torch.cat(new, dim=-1))

        if len(ctx.groups) == 1 and ctx.groups[0].q_index is None:
            out = self._attend(q_nope, q_pe, cache, ctx.groups[0], iq)
        else:
            out = x.new_empty(T, self.num_heads, self.v_dim)
            for group in ctx.groups:
                at = group.q_index
                rows = None if iq is None else (iq[0][at], iq[1][at])
                o = self._attend(q_nope[at], q_pe[at], cache, group, rows)
                if group.q_valid is None:
                    out[group.q_index.view(-1)] = o
                else:
                    out[group.q_index[group.q_valid]] = o[group.q_valid.view(-1)]
        return self.o_proj(out.reshape(T, self.num_heads * self.v_dim))

    def use_kernels(self, kernels: Kernels) -> None:
        self.paged_mla = kernels.paged_mla()
        self.rotate = apply_rope_triton if kernels.attention == "triton" else apply_rope

    def _attend(self, q_nope, q_pe, cache, g: AttnGroup, iq=None) -> torch.Tensor:
        """q_nope [B*Q (or B, Q), H, nope], q_pe [.., H, rope] -> [B * Q, H, v]; `iq`: the
        indexer's queries and weights for these rows (DSA: the expanded form, top-k masked)."""
        if g.absorbed and iq is None:
            return self._absorbed(q_nope, q_pe, cache, g)
        num_blocks, block_size, dim = cache.shape
        # index_select copies whole rows (one block each); [] indexing goes element by element.
        kv = cache.view(num_blocks, -1).index_select(0, g.kv_blocks.reshape(-1))
        kv = kv.view(g.batch, -1, dim)  # [B, L, dim]
        if iq is None:
            return self._expanded(q_nope, q_pe, kv, g.mask, g)
        width = self.kv_lora_rank + self.rope_dim
        mla, keys = kv.split([width, dim - width], dim=-1)
        visible = g.mask if g.mask is not None else expanded_mask(g, kv.shape[1])
        B, Q = g.batch, g.q_len
        q, w = iq[0].reshape(B, Q, *iq[0].shape[-2:]), iq[1].reshape(B, Q, -1)
        chosen = self.indexer.select(q, w, keys, visible[:, 0])
        return self._expanded(q_nope, q_pe, mla, chosen.unsqueeze(1), g)

    def _absorbed(self, q_nope, q_pe, cache, g: AttnGroup) -> torch.Tensor:
        """Attention over the cached latents, read in place through the block table."""
        H, B, Q = self.num_heads, g.batch, g.q_len
        q_nope = q_nope.reshape(B * Q, H, self.nope_dim)
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [BQ, H, kv_lora]
        q = torch.cat([q_lat, q_pe.reshape(B * Q, H, self.rope_dim)], dim=-1)
        o_lat = self.paged_mla(  # [B, Q, H, kv_lora]
            q.view(B, Q, H, -1),
            cache,
            g.kv_blocks,
            g.ctx_lens,
            g.q_lens,
            self.scale,
            self.kv_lora_rank,
        )
        o = torch.bmm(o_lat.reshape(B * Q, H, -1).transpose(0, 1), self.w_uv)  # [H, BQ, v]
        return o.transpose(0, 1)

    def _expanded(self, q_nope, q_pe, kv, mask, g: AttnGroup) -> torch.Tensor:
        H, B, Q = self.num_heads, g.batch, g.q_len
        L = kv.shape[1]
        c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_nope, v = self.kv_b_proj(c_kv).view(B, L, H, -1).split([self.nope_dim, self.v_dim], -1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, L, H, self.rope_dim)], dim=-1)
        q = torch.cat([q_nope.reshape(B, Q, H, -1), q_pe.reshape(B, Q, H, -1)], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
        )  # [B, H, Q, v]
        return o.transpose(1, 2).reshape(B * Q, H, self.v_dim)
