"""Build the per-step attention layout (`models.context`) from block tables.

Input per request, in batch order: where its query rows start in the flat
batch, how many tokens it schedules (q_len), how long its context is after this
step (ctx_len = computed + q_len), and its block table. Requests with at most
`ABSORB_MAX_Q` query tokens (decode, draft verification) form the absorbed
group; longer ones (prefill chunks) the expanded group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xllm_py.models.context import AttnGroup, ForwardContext

ABSORB_MAX_Q = 8


@dataclass
class RequestLayout:
    start: int  # first row in the flat batch
    q_len: int
    ctx_len: int
    block_ids: list[int]


def slot_mapping(
    block_table: torch.Tensor, row_req: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Cache slot of each new token: [T]."""
    return block_table[row_req, positions // block_size] * block_size + positions % block_size


def block_table_tensor(reqs: list[RequestLayout], device: torch.device) -> torch.Tensor:
    width = max(len(r.block_ids) for r in reqs)
    return torch.tensor(
        [r.block_ids + [0] * (width - len(r.block_ids)) for r in reqs], device=device
    )


def build_groups(
    reqs: list[RequestLayout],
    block_table: torch.Tensor,
    block_size: int,
    num_rows: int,
) -> list[AttnGroup]:
    short = [i for i, r in enumerate(reqs) if r.q_len <= ABSORB_MAX_Q]
    long = [i for i, r in enumerate(reqs) if r.q_len > ABSORB_MAX_Q]
    groups = []
    for absorbed, idx in ((True, short), (False, long)):
        if idx:
            groups.append(
                _group([reqs[i] for i in idx], block_table[idx], block_size, num_rows, absorbed)
            )
    return groups


def _group(
    reqs: list[RequestLayout],
    block_table: torch.Tensor,
    block_size: int,
    num_rows: int,
    absorbed: bool,
) -> AttnGroup:
    device = block_table.device
    B = len(reqs)
    Q = max(r.q_len for r in reqs)
    L = max(r.ctx_len for r in reqs)
    q_lens = torch.tensor([r.q_len for r in reqs], device=device)
    ctx_lens = torch.tensor([r.ctx_len for r in reqs], device=device)
    ar_q = torch.arange(Q, device=device)
    identity = B * Q == num_rows and all(
        r.q_len == Q and r.start == i * Q for i, r in enumerate(reqs)
    )
    q_valid = ar_q.unsqueeze(0) < q_lens.unsqueeze(1)  # [B, Q]
    q_pos = torch.where(
        q_valid, (ctx_lens - q_lens).unsqueeze(1) + ar_q, 0
    )  # padding rows see key 0
    width = -(-L // block_size)  # the table is padded to its longest row
    kv_blocks = block_table[:, :width]  # with block 0, never read past a request's ctx_len
    # The absorbed form masks from ctx_lens and q_lens as it reads the cache; the expanded
    # form gathers whole blocks: positions past each row's own masked.
    mask = None if absorbed else _causal(q_pos, width * block_size)
    all_valid = all(r.q_len == Q for r in reqs)
    q_index = None
    if not identity:
        starts = torch.tensor([r.start for r in reqs], device=device)
        q_index = torch.where(q_valid, starts.unsqueeze(1) + ar_q, starts.unsqueeze(1))
    return AttnGroup(
        absorbed=absorbed,
        q_index=q_index,
        q_valid=None if all_valid else q_valid,
        kv_blocks=kv_blocks,
        mask=mask,
        batch=B,
        q_len=Q,
        ctx_lens=ctx_lens,
        q_lens=q_lens,
    )


def _causal(q_pos: torch.Tensor, L: int) -> torch.Tensor:
    """bool [B, 1, Q, L]: key j visible from the row at q_pos [B, Q] when j <= q_pos."""
    key_pos = torch.arange(L, device=q_pos.device)
    return (key_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)).unsqueeze(1)


def expanded_mask(g: AttnGroup, L: int) -> torch.Tensor:
    """The expanded form's mask [B, 1, Q, L] for an absorbed group (from its ctx_lens and
    q_lens; padding rows see key 0): what `_group` builds for an expanded one."""
    ar_q = torch.arange(g.q_len, device=g.ctx_lens.device)
    q_valid = ar_q.unsqueeze(0) < g.q_lens.unsqueeze(1)
    q_pos = torch.where(q_valid, (g.ctx_lens - g.q_lens).unsqueeze(1) + ar_q, 0)
    return _causal(q_pos, L)


def build_context(
    layouts: list[RequestLayout],
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    block_size: int,
) -> ForwardContext:
    """The forward context of one pass over `layouts` (rows in layout order, `positions` [T])."""
    dev = positions.device
    table = block_table_tensor(layouts, dev)
    row_req = torch.tensor(
        [i for i, lay in enumerate(layouts) for _ in range(lay.q_len)], device=dev
    )
    slots = slot_mapping(table, row_req, positions, block_size)
    groups = build_groups(layouts, table, block_size, len(positions))
    return ForwardContext(slots, groups, kv_caches)
