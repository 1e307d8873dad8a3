"""The embedding and the LM head split along the vocabulary across the tensor-parallel ranks.

Rank r of tp holds vocabulary rows [r*V/tp, (r+1)*V/tp) of `model.embed_tokens.weight` and
of `lm_head.weight` (`Shard(0, r, tp)`; the loader slices the checkpoint tensor):

    VocabParallelEmbedding  ids outside the rank's rows look up zeros; the partial
                            embeddings are all-reduced. Every row has exactly one non-zero
                            term, so the sum is exact: the full table's lookup, bit for bit.
    ParallelLMHead          each rank multiplies by its rows (logits [N, V/tp]); the slices
                            are all-gathered along the vocabulary (a concatenation, no
                            arithmetic): every rank returns the same full logits [N, V].

Sampling therefore sees the whole vocabulary, identically on every rank. With
tie_word_embeddings the head's weight is the embedding's (same rows, same Shard). The
vocabulary must divide by tp (DeepSeek-V3's 129280 = 2^7 * 1010 does for every power
of 2 up to 128); there is no padded last shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xllm_py.models.layers.linear import Shard, gemm_layout
from xllm_py.parallel.context import SINGLE, ParallelContext


def _vocab_rows(vocab_size: int, parallel: ParallelContext) -> int:
    if vocab_size % parallel.tp_size:
        raise ValueError(
            f"vocab_size={vocab_size} is not divisible by tp_size={parallel.tp_size} "
            "(the embedding and lm_head are split along the vocabulary)"
        )
    return vocab_size // parallel.tp_size


class VocabParallelEmbedding(nn.Module):
    """`nn.Embedding` (frozen, weight named `weight`) holding this rank's vocabulary rows."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, parallel: ParallelContext = SINGLE
    ) -> None:
        super().__init__()
        rows = _vocab_rows(num_embeddings, parallel)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.parallel = parallel
        self.vocab_start = parallel.tp_rank * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        self.weight.shard = Shard(0, parallel.tp_rank, parallel.tp_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> embeddings [..., embedding_dim], the same on every rank."""
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.parallel.all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings}, rows=[{self.vocab_start}, "
            f"{self.vocab_start + self.weight.shape[0]}), dim={self.embedding_dim}"
        )


class ParallelLMHead(nn.Module):
    """The LM head, `weight` [vocab/tp, hidden] (this rank's rows); `forward` gives the
    full logits [N, vocab] on every rank."""

    def __init__(self, hidden_size: int, vocab_size: int, parallel: ParallelContext = SINGLE):
        super().__init__()
        rows = _vocab_rows(vocab_size, parallel)
        self.in_features = hidden_size
        self.out_features = vocab_size
        self.parallel = parallel
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.weight.shard = Shard(0, parallel.tp_rank, parallel.tp_size)

    def process_weights_after_loading(self) -> None:
        self.weight.data = gemm_layout(self.weight.data)

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [N, hidden] -> logits [N, vocab], cast to `dtype` (default: x's) before the
        gather (a cast is per element, so it commutes with the concatenation)."""
        logits = F.linear(x, self.weight)
        if dtype is not None and logits.dtype != dtype:
            logits = logits.to(dtype)
        return self.parallel.all_gather(logits, dim=-1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, vocab={self.out_features}, rows={self.weight.shape[0]}"
