"""DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): for each query, which
cached tokens MLA attends to.

Per token t the indexer caches one key (`index_head_dim` numbers), beside the MLA latent in
the same cache row (config.py `kv_cache_dim`), so it follows the latent through prefix
caching, chunked prefill, preemption and every tensor-parallel rank:

    k_t   = LayerNorm(wk x_t), its first qk_rope_head_dim numbers rotated (half-split
            pairs (i, i + d/2), not MLA's interleaved ones) by the same rotary table
    q_s,h = wq_b q_resid_s (q_resid: MLA's q_a_layernorm output), rotated the same way
    w_s,h = weights_proj x_s / sqrt(index_n_heads)                     (float32)
    I[s, t] = sum_h w_s,h * relu(q_s,h . k_t / sqrt(index_head_dim))   t visible from s

and query s attends to the `index_topk` visible tokens of highest I (all of them when it
sees fewer; among equal scores the earliest). The scores are float32 and the key cache
holds the run dtype: DeepSeek's reference rotates q and k by a Hadamard transform and
scores in FP8; the transform keeps dot products, and HF transformers' reference (which
this matches) skips both.

The indexer is replicated on every tensor-parallel rank (it is small), so all ranks pick
the same tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.config import ModelConfig
from xllm_py.models.layers.linear import Linear, dense


def rotate_half_split(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + d/2]) of x [T, H, d] by `cis` ([T, 1, d/2] complex, or
    the real [T, 1, d/2, 2] (cos, sin) table of graph mode)."""
    d = x.shape[-1] // 2
    x1, x2 = x.float()[..., :d], x.float()[..., d:]
    if cis.is_complex():
        cos, sin = cis.real, cis.imag
    else:
        cos, sin = cis[..., 0], cis[..., 1]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim, self.topk = cfg.qk_rope_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(cfg.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)

    def _rope(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        rot, rest = x.split([self.rope_dim, x.shape[-1] - self.rope_dim], dim=-1)
        return torch.cat([rotate_half_split(rot, cis), rest], dim=-1)

    def key(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the keys to cache [T, index_head_dim]."""
        return self._rope(self.k_norm(self.wk(x)).unsqueeze(1), cis).squeeze(1)

    def query(
        self, x: torch.Tensor, q_resid: torch.Tensor, cis: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, H, index_head_dim], head weights [T, H] float32)."""
        q = self.wq_b(q_resid).view(x.shape[0], self.n_heads, self.head_dim)
        weights = x.float() @ dense(self.weights_proj.weight, torch.float32).T  # as HF: fp32
        return self._rope(q, cis), weights * self.n_heads**-0.5

    def select(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """q [B, Q, H, D], w [B, Q, H], keys [B, L, D], visible [B, Q, L] bool -> the tokens
        each query attends to: bool [B, Q, L], its top `index_topk` visible ones."""
        scores = torch.einsum("bqhd,bld->bqhl", q.float(), keys.float()) * self.head_dim**-0.5
        index = torch.einsum("bqh,bqhl->bql", w, F.relu(scores))
        index = index.masked_fill(~visible, float("-inf"))
        # A stable sort, not topk: among equal scores (keys whose every head's relu is 0
        # score exactly 0) the earliest tokens win, whatever the batch's padded width, so a
        # request picks the same tokens alone, batched, or verifying drafts.
        top = index.sort(dim=-1, descending=True, stable=True).indices[..., : self.topk]
        return torch.zeros_like(visible).scatter_(-1, top, True) & visible
