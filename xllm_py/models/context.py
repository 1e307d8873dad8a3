"""The one scoped object through which the runtime reaches attention.

The model's forward takes only `input_ids` and `positions`. Everything about
the batch's layout in the paged cache lives in a `ForwardContext`, installed
by the model runner around one forward pass with `forward_context(ctx)`;
nesting is refused so a stale batch can never leak into another.

Batch layout. The T scheduled tokens of all requests are flattened into one
row per token. For attention, requests are split into `AttnGroup`s (decode-like
requests with few query tokens use the absorbed MLA form; prefill chunks use
the expanded form). Inside a group, B requests are padded to Q query rows and
L context positions:

    q_index   [B, Q]    row of each query in the flat batch (None: rows are
                        exactly arange(T).view(B, Q), so no gather/scatter)
    q_valid   [B, Q]    False on padding rows
    kv_blocks [B, L / block_size]  block table rows (padded with any block id: entries
                        past a request's length are never attended to)
    ctx_lens  [B]       context length after this step (computed + q_len)
    q_lens    [B]       valid query rows; row i sits at position ctx_len - q_len + i
                        and sees keys up to it (the absorbed form reads the cache in
                        place from these: ops/paged_mla.py)
    mask      expanded only: bool [B, 1, Q, L], L a multiple of block_size (the
                        expanded form gathers whole blocks); None for the absorbed form
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class AttnGroup:
    absorbed: bool
    q_index: torch.Tensor | None  # [B, Q] or None for the identity layout
    q_valid: torch.Tensor | None  # [B, Q] bool, None when every row is valid
    kv_blocks: torch.Tensor  # [B, L / block_size]
    mask: torch.Tensor | None  # expanded form only; see module docstring
    batch: int
    q_len: int
    ctx_lens: torch.Tensor | None = None  # [B]
    q_lens: torch.Tensor | None = None  # [B]


@dataclass
class ForwardContext:
    slot_mapping: torch.Tensor  # [T] cache slot written by each new token
    groups: list[AttnGroup]
    kv_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_lora_rank + rope_dim]


# One per thread: graph mode compiles its buckets on a thread of its own (a dummy step
# each) while the engine's steps run on another (worker/graph_runner.py).
_local = threading.local()


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    if getattr(_local, "ctx", None) is not None:
        raise RuntimeError("forward_context is already set: nested forward passes are not allowed")
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = None


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("attention called outside forward_context(...)")
    return ctx
