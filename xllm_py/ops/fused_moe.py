"""Fused MoE: the routed experts of one MoE layer as two grouped GEMMs over the
(token, expert) assignments, sorted and padded by expert on the device.

Contract (that of models/layers/moe.py's `grouped_experts`):

    x        [T, hidden]       run dtype (bf16 / fp16 / fp32)
    weights  [T, top_k]        routing weights, already scaled; x.dtype or float32
    ids      [T, top_k] int    GLOBAL expert ids; this rank owns first_expert ..
                               first_expert + E_local - 1, the others contribute 0
    w13      [E_local, 2*I, hidden]  gate rows, then up rows: a tensor in x.dtype, an
                               Fp8Weight (block-scaled e4m3; weights/fp8.py), an
                               Int4Weight (packed INT4, group scales; weights/int4.py) or
                               an Fp4Weight (packed e2m1, ue8m0 scales; weights/fp4.py)
    w2       [E_local, hidden, I]    the same form as w13
    -> out   [T, hidden] in x.dtype:
             out[t] = sum_j weights[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t),
             e = ids[t, j] - first_expert, over the j whose expert is owned
             (DeepSeek-V4, swiglu_limit L > 0: gate_e x_t clamped to <= L, up_e x_t to
             [-L, L], before the silu)

Assignment a = t * top_k + j is (token t, its j-th expert). `align_by_expert` sorts the
A = T * top_k assignments by local expert and pads each expert's run to a multiple of
block_m with a sentinel (A), so that every block of block_m slots belongs to one expert:

    local expert   0                  2          3
    slots         |a a a a|a - - -|  |a - - -|  |a a a a|  ...  |- - - -|- - - -|
    block          0       1          2          3               expert -1: past the runs

(block_m = 4; `a`: an assignment index, `-`: the sentinel; expert 1 has no assignments,
so no slots.) Assignments to other ranks' experts appear nowhere. The slot count is a
static upper bound, P = roundup(A + min(A, E_local) * (block_m - 1), block_m), as at
most min(A, E_local) runs are padded, each by under block_m; blocks past the used ones
get expert -1 and their programs exit at once.

Kernels (one program per (block of block_m slots, tile of output columns)):
    1 gate/up  gathers x rows by token (a // top_k), multiplies them with the block's
               expert's gate and up rows, and writes silu(gate) * up (fp32 math, stored
               in x.dtype) to act[a]          act [A, I], indexed by assignment
    2 down     act[a] @ w2[e]^T * weights[a] -> out_a[a]   out_a [A, hidden], x.dtype
then out = out_a.view(T, top_k, hidden).sum(1): a deterministic sum, no atomics. Rows
of act and out_a are indexed by assignment rather than by slot, so they take A rows, not
P (E_local = 256 experts at block_m 64 would pad a decode batch to thousands of slots);
act rows of other ranks' assignments are never written or read, their out_a rows are 0.

FP8 (w13, w2 Fp8Weight with B0 x B1 blocks, 128 x 128 in DeepSeek-V3): the input of each
GEMM, x for the first and act for the second, is quantised per token and group of B1
columns (1 x 128, fp8_gemm.per_token_group_quant) and the e4m3 tiles are multiplied by
`tl.dot` natively on a GPU, the product scaled by the row's activation scale and the
weight block's scale (see fp8_gemm.py; each K tile lies in one group). The reference
quantises at the same two points, so the two agree to rounding order.

INT4 (w13, w2 Int4Weight, groups of G input columns): activations stay in the run dtype;
each weight tile is loaded as its int32 words [BLOCK_N, BLOCK_K / 8], unpacked to
[BLOCK_N, BLOCK_K] nibbles in registers, shifted by -8 and multiplied by its group scales
in fp32 (`_int4_tile`: exact, q has 4 bits), then cast to the dot's dtype as a run-dtype
tile is. On a GPU in bf16 that rounds each weight once, to `Int4Weight.dequant(bf16)`'s
value; under the interpreter (fp32 dots) it keeps them exact, as the reference does
(weights dequantised to fp32, fp32 products). Nothing needs K tiles to line up with
groups; 4 bits a weight are all that is read.

FP4 (w13, w2 Fp4Weight, DeepSeek-V4's routed experts): as INT4, activations stay in the
run dtype and each weight tile is loaded packed, here int8 bytes [BLOCK_N, BLOCK_K / 2]
(column 2j in the low nibble of byte j), unpacked to e2m1 codes, decoded by building each
value's float32 bits, and multiplied by its row's ue8m0 scale of the 32-column block
(exponent bytes: 2 ** (byte - 127), also built as bits): exact in fp32 (`_fp4_tile`),
then cast to the dot's dtype, so on a GPU in bf16 each weight is `Fp4Weight.dequant(bf16)`'s
value. The kernels tell FP4 from a run-dtype weight by the weight pointer's element type
(int8: no float weight is stored so), as HF transformers' dispatcher does, so the
kernels' signatures are those of the other forms.

Under Triton's interpreter (CPU tests) bf16 tiles are multiplied in fp32 and bf16 results
written as fp32, then rounded by torch: its bf16 dot and fp32 -> bf16 cast are wrong
(fp8_gemm.py says how); the kernel source is the one a GPU runs.

No host sync: align_by_expert uses only device ops (scatter_add counts, cumsum, a stable
argsort, scatter, searchsorted) whose output sizes follow from the input shapes, and the
launch grid is (P / block_m, column tiles), also fixed by the shapes, so a CUDA graph can
capture the whole op for a given T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xllm_py.ops.fp8_gemm import (
    FLOAT_DTYPES,
    block_k_for,
    check_fp8_weight,
    dequant_groups,
    dot_dtype,
    per_token_group_quant,
    store_dtype,
)
from xllm_py.ops.launch import check_launch
from xllm_py.weights import fp4
from xllm_py.weights.fp4 import Fp4Weight
from xllm_py.weights.fp8 import Fp8Weight
from xllm_py.weights.int4 import Int4Weight

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference needs no Triton; the launcher says so
    triton = None

Weight = torch.Tensor | Fp8Weight | Int4Weight | Fp4Weight


# ---- sorting and padding (device ops only) -----------------------------------------------------


def align_by_expert(
    ids: torch.Tensor, num_local: int, first_expert: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, top_k] global expert ids -> (sorted_assignment_ids [P] int32, expert_of_block
    [P / block_m] int32, num_padded [] int64), all on ids' device.

    sorted_assignment_ids: assignment indices grouped by local expert, in increasing order
    within an expert, each expert's run padded to a multiple of block_m with the sentinel
    A = ids.numel(); num_padded: the slots the runs use; expert_of_block: each block's
    local expert, -1 for blocks at or past num_padded. P is the static bound in the
    module docstring."""
    A = ids.numel()
    P = padded_slots(A, num_local, block_m)
    local = ids.reshape(-1).long() - first_expert
    owned = (local >= 0) & (local < num_local)
    bucket = torch.where(owned, local, num_local)  # other ranks' assignments -> bucket E
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # [E + 1]; not bincount (syncs)
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m  # [E]
    ends = padded.cumsum(0)  # [E] end slot of each expert's run
    starts = F.pad(ends, (1, 0))  # [E + 1]: start slot of each run; bucket E's is unused
    order = torch.argsort(bucket, stable=True)  # [A] assignments by expert, E's last
    sorted_bucket = bucket[order]
    first_of = counts.cumsum(0) - counts  # [E + 1] first sorted position of each bucket
    rank = torch.arange(A, device=ids.device) - first_of[sorted_bucket]  # place in its run
    # Other ranks' assignments go to slot P, which is cut off below.
    dest = torch.where(sorted_bucket < num_local, starts[sorted_bucket] + rank, P)
    sorted_ids = torch.full((P + 1,), A, dtype=torch.int32, device=ids.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, P, block_m, device=ids.device)
    expert = torch.searchsorted(ends, block_start, right=True, out_int32=True)  # E: past end
    expert_of_block = torch.where(expert < num_local, expert, -1)
    return sorted_ids[:P], expert_of_block, ends[-1]


def padded_slots(num_assignments: int, num_local: int, block_m: int) -> int:
    """P: at most min(A, E) runs are padded, each by at most block_m - 1 slots."""
    bound = num_assignments + min(num_assignments, num_local) * (block_m - 1)
    return -(-bound // block_m) * block_m


def default_block_m(num_assignments: int, num_local: int) -> int:
    """Rows per program: about the mean run length, 16 (the smallest `tl.dot`) to 64. A
    function of the shapes only, so a captured graph keeps its choice."""
    mean = max(1, num_assignments // max(1, num_local))
    return min(64, max(16, triton.next_power_of_2(mean)))


# ---- the torch reference -----------------------------------------------------------------------


def fused_moe_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: Weight,
    w2: Weight,
    first_expert: int,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """The contract in torch, rounding where the kernels round: gate/up and down in fp32
    from the run-dtype (or, for FP8, 1 x B1-quantised) inputs, act and each assignment's
    output stored in x.dtype, the top_k outputs of a token summed last. One matmul pair
    per active expert (host syncs: this is the oracle, not the fast path)."""
    T, top_k = ids.shape
    n_local, hidden = w13.shape[0], x.shape[1]
    local = ids.reshape(-1) - first_expert
    token_of = torch.arange(T * top_k, device=x.device) // top_k
    out_a = torch.zeros(T * top_k, hidden, dtype=x.dtype, device=x.device)
    for e in range(n_local):
        rows = (local == e).nonzero().view(-1)  # this expert's assignments
        if rows.numel() == 0:
            continue
        h = _ref_linear(x[token_of[rows]], w13[e])
        gate, up = h.chunk(2, dim=-1)
        if swiglu_limit > 0:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        act = (F.silu(gate) * up).to(x.dtype)
        y = _ref_linear(act, w2[e]) * weights.reshape(-1)[rows].float().unsqueeze(1)
        out_a[rows] = y.to(x.dtype)
    return out_a.view(T, top_k, hidden).sum(dim=1)


def _ref_linear(a: torch.Tensor, w: Weight) -> torch.Tensor:
    """a @ w^T in fp32; for FP8, `a` quantised per token group first, as the kernels do;
    for INT4 and FP4, the weight dequantised (exactly: q * scale)."""
    if isinstance(w, Fp8Weight):
        aq, scale = per_token_group_quant(a, w.block[1])
        return dequant_groups(aq, scale, w.block[1]) @ w.dequant(torch.float32).T
    if isinstance(w, (Int4Weight, Fp4Weight)):
        return a.float() @ w.dequant(torch.float32).T
    return a.float() @ w.float().T


# ---- the kernels -------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _int4_tile(
        w_ptr,  # one expert's packed words [N, ceil(K / 8)] int32
        s_ptr,  # its group scales [N, ceil(K / GROUP)]
        rn,  # [BLOCK_N] weight rows
        n_ok,
        k0,
        K,
        stride_wn,
        stride_wk,
        stride_sn,
        stride_sg,
        GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Rows rn, columns k0 .. k0 + BLOCK_K of a packed INT4 matrix, dequantised: fp32
        [BLOCK_N, BLOCK_K], 0 past K. k0 is a multiple of BLOCK_K, itself of 8."""
        rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # the tile's words
        words = tl.load(
            w_ptr + rn[:, None] * stride_wn + rw[None, :] * stride_wk,
            mask=n_ok[:, None] & (rw < tl.cdiv(K, 8))[None, :],
            other=0,
        )
        shifts = tl.arange(0, 8) * 4  # column 8j + i: bits 4i .. 4i + 3 of word j
        nibbles = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # (>> keeps the sign;
        q = tl.reshape(nibbles, (BLOCK_N, BLOCK_K)).to(tl.float32) - 8.0  # the mask drops it)
        k = k0 + tl.arange(0, BLOCK_K)
        s = tl.load(
            s_ptr + rn[:, None] * stride_sn + (k // GROUP)[None, :] * stride_sg,
            mask=n_ok[:, None] & (k < K)[None, :],
            other=0.0,
        )
        return q * s.to(tl.float32)

    @triton.jit
    def _e2m1(code):
        """e2m1 codes (int32 in [0, 15]: sign, 2 exponent bits, 1 mantissa bit) -> their
        values, fp32, by building the bits: 0 and 0.5 below exponent 1, else
        2 ** (exponent - 1) * (1 + mantissa / 2); the sign kept (code 8 is -0.0)."""
        exp = (code >> 1) & 3
        man = code & 1
        bits = tl.where(exp == 0, man * 0x3F000000, ((exp + 126) << 23) | (man << 22))
        value = bits.to(tl.float32, bitcast=True)
        return tl.where(code >= 8, -value, value)

    @triton.jit
    def _fp4_tile(
        w_ptr,  # one expert's bytes [N, K / 2] int8
        s_ptr,  # its ue8m0 exponent bytes [N, K / GROUP] uint8 (GROUP = 32)
        rn,  # [BLOCK_N] weight rows
        n_ok,
        k0,
        K,
        stride_wn,
        stride_wk,
        stride_sn,
        stride_sg,
        GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Rows rn, columns k0 .. k0 + BLOCK_K of a packed FP4 matrix, dequantised: fp32
        [BLOCK_N, BLOCK_K], 0 past K. k0 is a multiple of BLOCK_K, itself even."""
        rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # the tile's bytes
        b = tl.load(
            w_ptr + rn[:, None] * stride_wn + rb[None, :] * stride_wk,
            mask=n_ok[:, None] & (rb < K // 2)[None, :],
            other=0,
        ).to(tl.int32)  # (sign-extended: the & 0xF below drops it)
        shifts = tl.arange(0, 2) * 4  # column 2j: bits 0..3 of byte j; 2j + 1: bits 4..7
        codes = (b[:, :, None] >> shifts[None, None, :]) & 0xF
        q = _e2m1(tl.reshape(codes, (BLOCK_N, BLOCK_K)))
        k = k0 + tl.arange(0, BLOCK_K)
        e = tl.load(
            s_ptr + rn[:, None] * stride_sn + (k // GROUP)[None, :] * stride_sg,
            mask=n_ok[:, None] & (k < K)[None, :],
            other=127,
        ).to(tl.int32)
        # 2 ** (e - 127): the exponent field e, or for e = 0 the subnormal 2 ** -127
        s = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)
        return q * s

    @triton.jit
    def _weight_tile(
        w_e,  # one expert's weight: [N, K] as stored, or INT4 words [N, ceil(K / 8)]
        ws_e,  # its scales (INT4: [N, ceil(K / GROUP)]; read only for INT4)
        rn,
        n_ok,
        k0,
        K,
        stride_wn,
        stride_wk,
        stride_sn,
        stride_sg,
        INT4: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Rows rn, columns k0 .. k0 + BLOCK_K of one expert's weight, 0 outside it: as
        stored (run dtype or e4m3), or for INT4 and FP4 (int8 bytes) unpacked and scaled
        (fp32)."""
        if INT4:
            w = _int4_tile(w_e, ws_e, rn, n_ok, k0, K, stride_wn, stride_wk, stride_sn,
                           stride_sg, GROUP, BLOCK_N, BLOCK_K)  # fmt: skip
        elif w_e.dtype.element_ty == tl.int8:  # FP4
            w = _fp4_tile(w_e, ws_e, rn, n_ok, k0, K, stride_wn, stride_wk, stride_sn,
                          stride_sg, GROUP, BLOCK_N, BLOCK_K)  # fmt: skip
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(
                w_e + rn[:, None] * stride_wn + k[None, :] * stride_wk,
                mask=n_ok[:, None] & (k < K)[None, :],
                other=0.0,
            )
        return w

    @triton.jit
    def _swiglu(gate, up, LIMIT: tl.constexpr):
        """silu(gate) * up; with LIMIT > 0 (DeepSeek-V4's swiglu_limit) gate clamped to at
        most LIMIT and up to [-LIMIT, LIMIT] first."""
        if LIMIT > 0:
            gate = tl.minimum(gate, LIMIT)
            up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        return gate * tl.sigmoid(gate) * up

    @triton.jit
    def _gate_up_kernel(
        x_ptr,  # [T, K] run dtype, or float8 e4m3 (FP8)
        xs_ptr,  # [T, ceil(K / GROUP_K)] float32 (FP8 only)
        w_ptr,  # [E, 2 * I, K]; INT4: int32 words [E, 2 * I, ceil(K / 8)]; FP4: int8 [.., K / 2]
        ws_ptr,  # [E, R, C] float32 (FP8); INT4 / FP4: [E, 2 * I, ceil(K / GROUP_K)]
        rows_ptr,  # [2 * I] int32: scale row of each weight row (FP8 only)
        act_ptr,  # [A, I] run dtype
        sorted_ptr,  # [P] int32
        expert_ptr,  # [P / BLOCK_M] int32
        A,
        I,
        K,
        top_k,
        stride_xt,
        stride_xk,
        stride_xst,
        stride_xsg,
        stride_we,
        stride_wn,
        stride_wk,
        stride_wse,
        stride_wsr,
        stride_wsc,
        stride_aa,
        stride_ai,
        FP8: tl.constexpr,
        INT4: tl.constexpr,
        DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        GROUP_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        LIMIT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        e = tl.load(expert_ptr + pid_m)
        if e < 0:
            return  # a block past the padded runs
        a = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # assignment ids
        a_ok = a < A  # not the sentinel
        tok = (a // top_k).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < I
        rk = tl.arange(0, BLOCK_K)
        w_e = w_ptr + e.to(tl.int64) * stride_we
        ws_e = ws_ptr + e.to(tl.int64) * stride_wse
        if FP8:
            gate_srow = tl.load(rows_ptr + rn, mask=n_ok, other=0)
            up_srow = tl.load(rows_ptr + I + rn, mask=n_ok, other=0)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            xa = tl.load(
                x_ptr + tok[:, None] * stride_xt + k[None, :] * stride_xk,
                mask=a_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            wg = _weight_tile(w_e, ws_e, rn, n_ok, k0, K, stride_wn, stride_wk, stride_wsr,
                              stride_wsc, INT4, GROUP_K, BLOCK_N, BLOCK_K)  # gate  # fmt: skip
            wu = _weight_tile(w_e, ws_e, I + rn, n_ok, k0, K, stride_wn, stride_wk, stride_wsr,
                              stride_wsc, INT4, GROUP_K, BLOCK_N, BLOCK_K)  # up  # fmt: skip
            if FP8:
                g = k0 // GROUP_K  # the tile lies in one scale group
                xs = tl.load(xs_ptr + tok * stride_xst + g * stride_xsg, mask=a_ok, other=0.0)
                gs = tl.load(ws_e + gate_srow * stride_wsr + g * stride_wsc, mask=n_ok, other=0.0)
                us = tl.load(ws_e + up_srow * stride_wsr + g * stride_wsc, mask=n_ok, other=0.0)
                gate += tl.dot(xa, tl.trans(wg)) * xs[:, None] * gs[None, :]
                up += tl.dot(xa, tl.trans(wu)) * xs[:, None] * us[None, :]
            else:
                gate += tl.dot(xa.to(DOT), tl.trans(wg.to(DOT)), input_precision=PRECISION)
                up += tl.dot(xa.to(DOT), tl.trans(wu.to(DOT)), input_precision=PRECISION)
        act = _swiglu(gate, up, LIMIT)  # fp32
        tl.store(
            act_ptr + a.to(tl.int64)[:, None] * stride_aa + rn[None, :] * stride_ai,
            act.to(act_ptr.dtype.element_ty),
            mask=a_ok[:, None] & n_ok[None, :],
        )

    @triton.jit
    def _down_kernel(
        act_ptr,  # [A, K] run dtype, or float8 e4m3 (FP8); K = I
        as_ptr,  # [A, ceil(K / GROUP_K)] float32 (FP8 only)
        w_ptr,  # [E, N, K]; N = hidden; INT4: int32 words [E, N, ceil(K / 8)]; FP4: int8
        ws_ptr,  # [E, R, C] float32 (FP8); INT4 / FP4: [E, N, ceil(K / GROUP_K)]
        rows_ptr,  # [N] int32 (FP8 only)
        topw_ptr,  # [A] routing weights
        out_ptr,  # [A, N] run dtype
        sorted_ptr,
        expert_ptr,
        A,
        N,
        K,
        stride_aa,
        stride_ak,
        stride_asa,
        stride_asg,
        stride_we,
        stride_wn,
        stride_wk,
        stride_wse,
        stride_wsr,
        stride_wsc,
        stride_oa,
        stride_on,
        FP8: tl.constexpr,
        INT4: tl.constexpr,
        DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        GROUP_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        e = tl.load(expert_ptr + pid_m)
        if e < 0:
            return
        a = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # assignment ids
        a_ok = a < A  # not the sentinel
        a64 = a.to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_K)
        w_e = w_ptr + e.to(tl.int64) * stride_we
        ws_e = ws_ptr + e.to(tl.int64) * stride_wse
        if FP8:
            srow = tl.load(rows_ptr + rn, mask=n_ok, other=0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            h = tl.load(
                act_ptr + a64[:, None] * stride_aa + k[None, :] * stride_ak,
                mask=a_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = _weight_tile(w_e, ws_e, rn, n_ok, k0, K, stride_wn, stride_wk, stride_wsr,
                             stride_wsc, INT4, GROUP_K, BLOCK_N, BLOCK_K)  # fmt: skip
            if FP8:
                g = k0 // GROUP_K
                hs = tl.load(as_ptr + a64 * stride_asa + g * stride_asg, mask=a_ok, other=0.0)
                s = tl.load(ws_e + srow * stride_wsr + g * stride_wsc, mask=n_ok, other=0.0)
                acc += tl.dot(h, tl.trans(w)) * hs[:, None] * s[None, :]
            else:
                acc += tl.dot(h.to(DOT), tl.trans(w.to(DOT)), input_precision=PRECISION)
        topw = tl.load(topw_ptr + a, mask=a_ok, other=0.0).to(tl.float32)
        acc = acc * topw[:, None]
        tl.store(
            out_ptr + a64[:, None] * stride_oa + rn[None, :] * stride_on,
            acc.to(out_ptr.dtype.element_ty),
            mask=a_ok[:, None] & n_ok[None, :],
        )


# ---- the launcher ------------------------------------------------------------------------------


def fused_moe_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: Weight,
    w2: Weight,
    first_expert: int,
    *,
    block_m: int | None = None,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """The contract above as align_by_expert + the two kernels. `block_m`: rows per
    program (a power of two >= 16); default `default_block_m`. `swiglu_limit` > 0
    (DeepSeek-V4): gate clamped to at most it and up to [-limit, limit] before silu."""
    check_launch(_gate_up_kernel if triton else None, x.device, "fused_moe_triton")
    kind = _check_shapes(x, weights, ids, w13, w2)
    fp8 = kind == "fp8"
    T, top_k = ids.shape
    n_local, two_i, hidden = w13.shape
    inter, A = two_i // 2, T * top_k
    if A == 0:
        return x.new_zeros(T, hidden)
    # Results in x.dtype; fp32 under the interpreter for bf16 (fp8_gemm.store_dtype).
    out_dtype = store_dtype(x.dtype, _gate_up_kernel)
    out_a = torch.zeros(A, hidden, dtype=out_dtype, device=x.device)
    block_m = block_m or default_block_m(A, n_local)
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"fused_moe_triton: block_m={block_m}; need a power of two >= 16")
    sorted_ids, expert_of_block, _ = align_by_expert(ids, n_local, first_expert, block_m)
    act = torch.empty(A, inter, dtype=out_dtype, device=x.device)
    blocks = expert_of_block.numel()
    dot = dot_dtype(x.dtype, _gate_up_kernel)
    # float32 operands multiply in full precision (not TF32), so float32 runs match torch
    precision = "ieee" if dot == tl.float32 else None
    common = dict(FP8=fp8, INT4=kind == "int4", DOT=dot, PRECISION=precision, BLOCK_M=block_m)

    xin, xs, w, ws, rows, group = _operands(x, w13)
    block_n, block_k = 64, (block_k_for(group) if fp8 else 64)
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        xin, xs, w, ws, rows, act, sorted_ids, expert_of_block,
        A, inter, hidden, top_k,
        *xin.stride(), *xs.stride(), *w.stride(), *ws.stride(), *act.stride(),
        GROUP_K=group, BLOCK_N=block_n, BLOCK_K=block_k, LIMIT=float(swiglu_limit), **common,
        num_warps=4, num_stages=3,
    )  # fmt: skip

    hin, hs, w, ws, rows, group = _operands(act.to(x.dtype), w2)
    block_n, block_k = 128, (block_k_for(group) if fp8 else 64)
    topw = weights.reshape(-1)
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        hin, hs, w, ws, rows, topw, out_a, sorted_ids, expert_of_block,
        A, hidden, inter,
        *hin.stride(), *hs.stride(), *w.stride(), *ws.stride(), *out_a.stride(),
        GROUP_K=group, BLOCK_N=block_n, BLOCK_K=block_k, **common, num_warps=4, num_stages=3,
    )  # fmt: skip
    return out_a.to(x.dtype).view(T, top_k, hidden).sum(dim=1)


def _operands(a: torch.Tensor, w: Weight) -> tuple:
    """(input, its scales, weight data, weight scales, weight scale rows, group) for one
    GEMM; the arguments a form does not use are placeholders the kernel never reads."""
    if isinstance(w, Fp8Weight):
        aq, scale = per_token_group_quant(a, w.block[1])
        return aq, scale, w.data, w.scale, w.rows, w.block[1]
    none = a.new_empty(1, 1)
    no_rows = a.new_empty(1, dtype=torch.int32)
    if isinstance(w, Int4Weight):  # a scale per weight row: no row map
        return a, none, w.packed, w.scale, no_rows, w.group_size
    if isinstance(w, Fp4Weight):  # the same; the ue8m0 scales as their exponent bytes
        return a, none, w.packed, w.scale.view(torch.uint8), no_rows, fp4.BLOCK
    return a, none, w, a.new_empty(1, 1, 1), no_rows, 128


def _check_shapes(x, weights, ids, w13: Weight, w2: Weight) -> str | None:
    """The experts' form: "fp8", "int4", "fp4" or None (run dtype); ValueError on a
    contract violation."""
    forms = {Fp8Weight: "fp8", Int4Weight: "int4", Fp4Weight: "fp4"}
    kinds = [forms.get(type(w)) for w in (w13, w2)]
    if kinds[0] != kinds[1]:
        raise ValueError(
            f"fused_moe_triton: w13 is {kinds[0] or 'a tensor'} but w2 is "
            f"{kinds[1] or 'a tensor'}; both must be held alike"
        )
    fp8, quantized = kinds[0] == "fp8", kinds[0] is not None
    T, hidden = x.shape
    n_local, two_i, k13 = w13.shape
    ok = (
        x.dtype in FLOAT_DTYPES
        and ids.shape == weights.shape
        and ids.shape[0] == T
        and k13 == hidden
        and two_i % 2 == 0
        and tuple(w2.shape) == (n_local, hidden, two_i // 2)
        and (quantized or (w13.dtype == x.dtype and w2.dtype == x.dtype))
    )
    if not ok:
        raise ValueError(
            f"fused_moe_triton: x {tuple(x.shape)} {x.dtype}, weights {tuple(weights.shape)}, "
            f"ids {tuple(ids.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}: need x "
            "[T, hidden] in bf16/fp16/fp32, weights and ids [T, top_k], w13 [E, 2*I, hidden] "
            "and w2 [E, hidden, I], run-dtype weights in x.dtype"
        )
    if fp8:
        check_fp8_weight(w13, "fused_moe_triton (w13)")
        check_fp8_weight(w2, "fused_moe_triton (w2)")
    return kinds[0]
