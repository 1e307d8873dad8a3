"""Absorbed MLA attention read from the paged latent cache, without a dense copy of the context.

Contract (every implementation):

    q            [B, Q, H, D]   latent query, D = kv_lora_rank + rope_dim: q_nope @ W_UK
                                concatenated with the roped q_pe
    cache        [num_blocks, block_size, D]  one layer of the paged cache; a row is
                                [c_kv (kv_lora_rank) | k_pe (rope_dim)]
    block_table  [B, W] int     each request's blocks in order; padding entries are any
                                valid block id (never read past ctx_len)
    ctx_lens     [B] int        context length after this step, its q_len new tokens
                                included (they are already in the cache)
    q_lens       [B] int        valid query rows, 1 <= q_len <= Q; rows q_len.. are padding
    scale        float          softmax scale
    kv_lora_rank int            values are cache[..., :kv_lora_rank]; keys are whole rows
    window_mask  [B, Q, Q] bool or None
    -> out       [B, Q, H, kv_lora_rank] in q.dtype, padding rows 0

Row i of request b is the token at position prefix + i, where prefix = ctx_len - q_len. It
sees every key before prefix (the earlier context) and the window key prefix + j iff
window_mask[b, i, j] (None: causal, j <= i; a tree of drafts passes its ancestor mask, which
must include the diagonal). Scores, softmax and the value sum are fp32.

Implementations:
    paged_mla_reference  gathers every block into one dense tensor; the tests' oracle
    paged_mla_torch      CPU production path: a chunk of blocks of every request at a time,
                         with an online softmax, so the memory a call adds is bounded by
                         KV_CHUNK_ROWS rather than by B x context (today's dense gather is
                         B x L x D per layer). One chunk (batch 1, short contexts) is a
                         single gather and two bmm, like the dense form. Under torch.compile
                         it is the custom op `xllm::paged_mla`: one opaque node.
    paged_mla_triton     reads the cache in place through the block table; flash-decoding:
                         the grid is (request, head group, KV split), and a combine kernel
                         merges the splits. On CPU it needs Triton's interpreter
                         (TRITON_INTERPRET=1), which is how the tests run it.

Split-KV combine: split s returns its normalised output o_s and its log-sum-exp
lse_s = log sum_{keys in s} exp(score). With M = max_s lse_s and w_s = exp(lse_s - M),
    out = sum_s w_s o_s / sum_s w_s
which is the softmax over all keys; an empty split has lse = -inf, so w = 0.
"""

from __future__ import annotations

import math

import torch

from xllm_py.ops.launch import check_launch, interpreted

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch paths need no Triton
    triton = None

# Rows of KV (summed over the batch) that one step of paged_mla_torch gathers. 4096 rows of
# V3's 576 fp32 values are 9 MiB: small enough to stay in cache, large enough that batch 1
# up to a 4096-token context is a single step.
KV_CHUNK_ROWS = 4096


def paged_mla_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    window_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense oracle, one request at a time: its blocks gathered, cut to ctx_len, masked."""
    B, Q, H, D = q.shape
    out = q.new_zeros(B, Q, H, kv_lora_rank, dtype=torch.float32)
    if window_mask is None:
        window_mask = torch.ones(Q, Q, dtype=torch.bool, device=q.device).tril().expand(B, Q, Q)
    for b in range(B):
        n, m = int(ctx_lens[b]), int(q_lens[b])
        kv = cache[block_table[b].long()].reshape(-1, D)[:n].float()  # [n, D]
        allowed = torch.ones(m, n, dtype=torch.bool, device=q.device)
        allowed[:, n - m :] = window_mask[b, :m, :m]
        scores = torch.einsum("qhd,nd->qhn", q[b, :m].float(), kv) * scale
        probs = scores.masked_fill(~allowed.unsqueeze(1), float("-inf")).softmax(-1)
        out[b, :m] = torch.einsum("qhn,nd->qhd", probs, kv[:, :kv_lora_rank])
    return out.to(q.dtype)


def _allowed(
    pos: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    window_mask: torch.Tensor | None,
    Q: int,
) -> torch.Tensor:
    """[B, Q, n] bool: may query row i of request b see the key at position pos[n]?

    Padding rows (i >= q_len) see what the last valid row sees under the causal default,
    so no row is empty in the default case; their outputs are zeroed by the caller.
    """
    prefix = (ctx_lens - q_lens).view(-1, 1)
    rows = torch.arange(Q, device=pos.device)
    if window_mask is None:
        limit = torch.minimum(prefix + rows + 1, ctx_lens.view(-1, 1))  # [B, Q]
        return pos < limit.unsqueeze(-1)
    j = pos - prefix  # [B, n] position inside the window
    in_window = (j >= 0) & (j < q_lens.view(-1, 1))
    seen = window_mask.gather(2, j.clamp(0, Q - 1).unsqueeze(1).expand(-1, Q, -1))
    return (j < 0).unsqueeze(1) | (in_window.unsqueeze(1) & seen)


def paged_mla_torch(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    window_mask: torch.Tensor | None = None,
    kv_chunk_rows: int = KV_CHUNK_ROWS,
) -> torch.Tensor:
    """The CPU path. Under torch.compile it is the custom op `xllm::paged_mla`, one opaque
    node (its Python loop and its read of max(ctx_lens) stay out of the graph, and W stays
    dynamic); eager calls skip the op's dispatcher, ~0.08 ms a call on CPU."""
    fn = _paged_mla_op if torch.compiler.is_compiling() else _paged_mla_blockwise
    args = (q, cache, block_table, ctx_lens, q_lens, scale, kv_lora_rank, window_mask)
    return fn(*args, kv_chunk_rows=kv_chunk_rows)


def _paged_mla_blockwise(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    window_mask: torch.Tensor | None = None,
    kv_chunk_rows: int = KV_CHUNK_ROWS,
) -> torch.Tensor:
    """Block-wise absorbed MLA: `chunk` blocks of every request per step, online softmax."""
    B, Q, H, D = q.shape
    num_blocks, block_size, _ = cache.shape
    width = block_table.shape[1]
    end, seen_by_all = width * block_size, 0
    if ctx_lens.device.type == "cpu":  # free to read here; on a GPU it would be a sync
        end = int(ctx_lens.max())  # keys at or past `end` are no one's: left out, not masked
        width = min(width, -(-end // block_size))
        # Every row sees the keys before this (each request's earlier context, and under
        # the causal default its first new token): chunks below it need no mask.
        seen_by_all = int((ctx_lens - q_lens).min()) + (window_mask is None)
    chunk = max(1, kv_chunk_rows // (B * block_size))
    # One row per block: index_select copies whole blocks, [] indexing goes element-wise.
    blocks = cache.view(num_blocks, block_size * D)
    q_scaled = (q.float() * scale).reshape(B, Q * H, D)

    def scores(first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Q*H, n] scores of the keys in blocks first..last-1 (cut at `end`), and values."""
        ids = block_table[:, first:last].reshape(-1)
        start, stop = first * block_size, min(last * block_size, end)
        kv = blocks.index_select(0, ids).view(B, -1, D)[:, : stop - start].float()  # no-op if fp32
        s = torch.bmm(q_scaled, kv.transpose(1, 2))
        if stop > seen_by_all:
            pos = torch.arange(start, stop, device=q.device)
            hidden = ~_allowed(pos, ctx_lens, q_lens, window_mask, Q)
            s.view(B, Q, H, -1).masked_fill_(hidden.unsqueeze(2), float("-inf"))
        return s, kv[..., :kv_lora_rank]

    if width <= chunk:
        s, v = scores(0, width)
        out = torch.bmm(torch.softmax(s, dim=-1), v)
    else:
        # Running max starts at the lowest finite float, not -inf, so a row none of whose
        # keys lie in a chunk gets exp(-inf - finite) = 0 instead of NaN.
        m = q_scaled.new_full((B, Q * H, 1), torch.finfo(torch.float32).min)
        denom = q_scaled.new_zeros(B, Q * H, 1)
        out = q_scaled.new_zeros(B, Q * H, kv_lora_rank)
        for first in range(0, width, chunk):
            s, v = scores(first, min(first + chunk, width))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            rescale = torch.exp(m - m_new)
            denom = denom * rescale + p.sum(-1, keepdim=True)
            out = torch.baddbmm(out * rescale, p, v)
            m = m_new
            del s, v, p  # this chunk's keys go before the next chunk's are gathered
        out = out / denom  # denom >= 1 where a row saw a key: its max adds exp(0)
    out = out.view(B, Q, H, kv_lora_rank)
    if Q > 1:
        padding = torch.arange(Q, device=q.device) >= q_lens.view(-1, 1)  # [B, Q]
        out = out.masked_fill(padding[:, :, None, None], 0.0)
    return out.to(q.dtype)


_paged_mla_op = torch.library.custom_op("xllm::paged_mla", _paged_mla_blockwise, mutates_args=())


@_paged_mla_op.register_fake
def _(q, cache, block_table, ctx_lens, q_lens, scale, kv_lora_rank, window_mask=None,
      kv_chunk_rows=KV_CHUNK_ROWS):  # fmt: skip
    B, Q, H, _ = q.shape
    return q.new_empty(B, Q, H, kv_lora_rank)


# ---- Triton ---------------------------------------------------------------------------------

# Keys per inner-loop tile. A tile may span blocks (each key looks up its own block), so any
# block_size works; 32 keeps the [BLOCK_N, 512] bf16 tile of V3 at 32 KiB.
BLOCK_N = 32
# Query rows (Q rows x heads) one program handles: the M of its dots, and of its fp32
# accumulator [rows, kv_lora_rank].
ROWS_PER_PROGRAM = 32
# Splits only pay when a program would get this many keys or more.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32

if triton is not None:

    @triton.jit
    def _split_kernel(
        q_ptr, cache_ptr, table_ptr, ctx_ptr, qlen_ptr, win_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
        scale_log2, H, Q, R, P, block_size,
        s_qb, s_qq, s_qh, s_cb, s_cr, s_tb, s_wb, s_wq, s_ob, s_oq, s_oh,
        HG: tl.constexpr, BLOCK_HG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
        HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        scale_log2 = tl.cast(scale_log2, tl.float32)  # an fp64 scale would make scores fp64
        b = tl.program_id(0)
        head0 = tl.program_id(1) * HG
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + b)
        q_len = tl.load(qlen_ptr + b)
        prefix = ctx - q_len

        # Row m of the program is query row qi of head `head`: rows x heads form the M of dot.
        m = tl.arange(0, BLOCK_M)
        qi = m // BLOCK_HG
        head = head0 + m % BLOCK_HG
        row_ok = (qi < Q) & (m % BLOCK_HG < HG) & (head < H)  # rows that exist in q and out
        r = tl.arange(0, BLOCK_R)
        p = tl.arange(0, BLOCK_P)
        q_row = q_ptr + b * s_qb + qi * s_qq + head * s_qh
        q_lat = tl.load(q_row[:, None] + r[None, :], row_ok[:, None] & (r < R)[None, :], 0.0)
        q_pe = tl.load(q_row[:, None] + R + p[None, :], row_ok[:, None] & (p < P)[None, :], 0.0)
        if UPCAST:
            q_lat, q_pe = q_lat.to(tl.float32), q_pe.to(tl.float32)
        limit = tl.minimum(prefix + qi + 1, ctx)  # causal; padding rows see the whole context

        per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), NUM_SPLITS) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, ctx)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            key_ok = pos < end
            blk = tl.load(table_ptr + b * s_tb + pos // block_size, key_ok, 0).to(tl.int64)
            row = cache_ptr + blk * s_cb + (pos % block_size) * s_cr
            kv = tl.load(row[:, None] + r[None, :], key_ok[:, None] & (r < R)[None, :], 0.0)
            k_pe = tl.load(row[:, None] + R + p[None, :], key_ok[:, None] & (p < P)[None, :], 0.0)
            if UPCAST:
                kv, k_pe = kv.to(tl.float32), k_pe.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(kv), input_precision=PRECISION)
            s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)
            if HAS_WINDOW:
                j = pos - prefix
                in_win = (j >= 0) & (j < q_len)
                w_ptr = win_ptr + b * s_wb + qi[:, None] * s_wq + j[None, :]
                win = tl.load(w_ptr, (qi < Q)[:, None] & in_win[None, :], 0)
                allowed = (pos < prefix)[None, :] | (win != 0)
            else:
                allowed = pos[None, :] < limit[:, None]
            # False at and past ctx_len; splits are whole tiles: key_ok need not apply again.
            s = tl.where(allowed, s * scale_log2, float("-inf"))
            # A row with no visible key so far keeps m = -inf; subtracting 0 instead keeps
            # exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            prob = tl.exp2(s - m_safe[:, None])
            rescale = tl.exp2(m_i - m_safe)
            l_i = l_i * rescale + tl.sum(prob, 1)
            acc = tl.dot(prob.to(kv.dtype), kv, acc * rescale[:, None], input_precision=PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # 0 only where no key was visible: acc is 0
        out = acc / l_safe[:, None]
        o_mask = row_ok[:, None] & (r < R)[None, :]
        if NUM_SPLITS == 1:
            out = tl.where((qi < q_len)[:, None], out, 0.0)
            o_ptr = out_ptr + b * s_ob + qi * s_oq + head * s_oh
            tl.store(o_ptr[:, None] + r[None, :], out.to(out_ptr.dtype.element_ty), o_mask)
        else:
            # mid_o [B, Q, H, NUM_SPLITS, R] and mid_lse [B, Q, H, NUM_SPLITS], contiguous.
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 units
            slot = (((b * Q + qi) * H + head) * NUM_SPLITS + split).to(tl.int64)
            tl.store(mid_o_ptr + slot[:, None] * R + r[None, :], out, o_mask)
            tl.store(mid_lse_ptr + slot, lse, row_ok)

    @triton.jit
    def _combine_kernel(
        mid_o_ptr, mid_lse_ptr, qlen_ptr, out_ptr, H, Q, R, s_ob, s_oq, s_oh,
        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        qi = tl.program_id(1) // H
        head = tl.program_id(1) % H
        splits = tl.arange(0, BLOCK_S)
        r = tl.arange(0, BLOCK_R)
        slot = (((b * Q + qi) * H + head) * NUM_SPLITS + splits).to(tl.int64)
        lse = tl.load(mid_lse_ptr + slot, splits < NUM_SPLITS, float("-inf"))
        top = tl.max(lse, 0)
        weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
        part_mask = (splits < NUM_SPLITS)[:, None] & (r < R)[None, :]
        part = tl.load(mid_o_ptr + slot[:, None] * R + r[None, :], part_mask, 0.0)
        out = tl.sum(part * weight[:, None], 0) / tl.maximum(tl.sum(weight, 0), 1e-30)
        out = tl.where(qi < tl.load(qlen_ptr + b), out, 0.0)
        o_ptr = out_ptr + b * s_ob + qi * s_oq + head * s_oh + r
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), r < R)


def auto_num_splits(programs: int, max_keys: int, units: int) -> int:
    """KV splits per request so that `programs` (requests x head groups) fill `units` (SMs).

    `max_keys` bounds the longest context (W * block_size, known without a device sync).
    Many requests, or short contexts, get 1 (no combine step).
    """
    by_fill = -(-units // programs)
    by_length = -(-max_keys // MIN_KEYS_PER_SPLIT)
    return max(1, min(by_fill, by_length, MAX_SPLITS))


def paged_mla_triton(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    window_mask: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The contract above as Triton kernels reading `cache` in place (no gather). Under
    torch.compile it is the custom op `xllm::paged_mla_triton`, one opaque node: Inductor
    neither re-types the launch (it would pass the scale as fp64) nor autotunes it, which
    allocates a copy of every tensor argument, the whole KV cache included (an out-of-memory
    error on an H200 with the cache at 0.9 of the device)."""
    fn = _paged_mla_triton_op if torch.compiler.is_compiling() else _paged_mla_triton
    args = (q, cache, block_table, ctx_lens, q_lens, scale, kv_lora_rank, window_mask)
    return fn(*args, num_splits=num_splits)


def _paged_mla_triton(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    window_mask: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    check_launch(_split_kernel if triton else None, q.device, "paged_mla_triton")
    B, Q, H, D = q.shape
    R, P = kv_lora_rank, D - kv_lora_rank
    q = q if q.stride(-1) == 1 else q.contiguous()
    assert cache.stride(-1) == 1 and cache.stride(0) == cache.shape[1] * cache.stride(1)
    block_q = triton.next_power_of_2(Q)
    heads = min(H, max(1, ROWS_PER_PROGRAM // block_q))  # heads per program
    block_hg = triton.next_power_of_2(heads)
    groups = -(-H // heads)
    if num_splits is None:
        units = 1  # the interpreter runs one program at a time
        if q.device.type == "cuda":
            units = torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = auto_num_splits(B * groups, block_table.shape[1] * cache.shape[1], units)
    out = q.new_empty(B, Q, H, R)
    mid_o = mid_lse = out  # unused when one split writes `out` directly
    if num_splits > 1:
        mid_o = q.new_empty(B, Q, H, num_splits, R, dtype=torch.float32)
        mid_lse = q.new_empty(B, Q, H, num_splits, dtype=torch.float32)
    block_m = max(16, block_q * block_hg)
    block_r = max(16, triton.next_power_of_2(R))
    win, s_w = ctx_lens, (0, 0)  # a placeholder pointer when there is no window
    if window_mask is not None:  # the kernel reads it as bytes along a contiguous last dim
        win = window_mask.contiguous().view(torch.uint8)
        s_w = win.stride()[:2]
    _split_kernel[(B, groups, num_splits)](
        q, cache, block_table, ctx_lens, q_lens, win, out, mid_o, mid_lse,
        scale * math.log2(math.e), H, Q, R, P, cache.shape[1],
        *q.stride()[:3], cache.stride(0), cache.stride(1), block_table.stride(0), *s_w,
        *out.stride()[:3],
        HG=heads, BLOCK_HG=block_hg, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(P)),
        NUM_SPLITS=num_splits, HAS_WINDOW=window_mask is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # The interpreter multiplies bf16 (numpy has none; it keeps the bits in uint16) as
        # integers: there the tiles go to fp32 before each dot.
        UPCAST=q.dtype == torch.bfloat16 and interpreted(_split_kernel),
        num_warps=8 if block_m * block_r >= 16384 else 4,  # the fp32 accumulator lives in registers
    )  # fmt: skip
    if num_splits > 1:
        _combine_kernel[(B, Q * H)](
            mid_o, mid_lse, q_lens, out, H, Q, R, *out.stride()[:3],
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_R=triton.next_power_of_2(R),
        )  # fmt: skip
    return out


_paged_mla_triton_op = torch.library.custom_op(
    "xllm::paged_mla_triton", _paged_mla_triton, mutates_args=()
)


@_paged_mla_triton_op.register_fake
def _(q, cache, block_table, ctx_lens, q_lens, scale, kv_lora_rank, window_mask=None,
      num_splits=None):  # fmt: skip
    B, Q, H, _ = q.shape
    return q.new_empty(B, Q, H, kv_lora_rank)
