"""xllm_py/ops/paged_mla.py: the block-wise torch path and the Triton kernels (run on CPU by
Triton's interpreter, see conftest.py) against the dense reference.

Every case hides huge values (GARBAGE) in the cache where no query may look: the table's
padding entries point at a block full of them, and so do the rows past ctx_len in each
request's last block. A key that leaks swamps the softmax and the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from xllm_py.ops import paged_mla as pm
from xllm_py.ops.paged_mla import paged_mla_reference, paged_mla_torch, paged_mla_triton

# Relative error of the output type, plus probabilities rounded to it before the value sum in
# the Triton kernel (the reference keeps them fp32).
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}
GARBAGE = 1e4  # fits fp16; scores of ~1e4 x sqrt(D) would own any softmax they reached
KV_LORA, ROPE = 32, 16


@dataclass(frozen=True)
class Case:
    ctx_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    block_size: int = 16
    heads: int = 2
    # Non-causal windows: even requests a tree (rows 0..3: a root, two children, a
    # grandchild), odd ones a random mask with its diagonal set (it may look ahead).
    window: bool = False
    int32: bool = False  # block table and lengths as int32 (the engine may pass either)


CASES = {
    "ctx1": Case((1,), (1,)),
    "partial-block": Case((23,), (1,), heads=4),
    "blocks-1-2-17": Case((16, 32, 272), (1, 1, 1), int32=True),
    "q2-partial": Case((21, 40), (2, 2)),
    "ragged-b5-q4": Case((4, 19, 50, 33, 7), (4, 1, 3, 2, 4), heads=3),
    "ragged-q3-int32": Case((48, 9, 3), (3, 1, 2), int32=True),
    "bs128": Case((130, 300), (2, 1), block_size=128),
    "window": Case((20, 4, 37), (4, 4, 3), window=True),
}
# The torch path leaves out the mask on chunks every row sees whole (keys before the
# smallest prefix, +1 under the causal default); here that edge is a block edge, where
# chunks of one block end.
EDGE_CASES = {
    "q2-edge": Case((16, 40), (2, 1)),
    "window-edge": Case((30, 17), (1, 2), window=True),
}
TREE_PARENTS = (-1, 0, 0, 1)  # row 2 sees the root but not its sibling, row 1


def window_masks(B: int, Q: int, gen: torch.Generator) -> torch.Tensor:
    tree = torch.eye(Q, dtype=torch.bool)
    for i, parent in enumerate(TREE_PARENTS[:Q]):
        if parent >= 0:
            tree[i] |= tree[parent]
    masks = torch.rand(B, Q, Q, generator=gen) < 0.5
    masks |= torch.eye(Q, dtype=torch.bool)
    masks[::2] = tree
    return masks


def make_inputs(case: Case, dtype=torch.float32, seed=0, pad=2) -> dict:
    """Kwargs for the contract; blocks scattered over the cache, `pad` more table entries."""
    gen = torch.Generator().manual_seed(seed)
    bs, B, Q = case.block_size, len(case.ctx_lens), max(case.q_lens)
    needed = [-(-n // bs) for n in case.ctx_lens]
    width = max(needed) + pad
    num_blocks = sum(needed) + 1
    cache = torch.randn(num_blocks, bs, KV_LORA + ROPE, generator=gen)
    ids = torch.randperm(num_blocks - 1, generator=gen)
    trash = num_blocks - 1  # every padding entry points here
    cache[trash] = GARBAGE
    table = torch.full((B, width), trash)
    used = 0
    for b, (n, blocks) in enumerate(zip(case.ctx_lens, needed)):
        table[b, :blocks] = ids[used : used + blocks]
        used += blocks
        cache[table[b, blocks - 1], (n - 1) % bs + 1 :] = GARBAGE  # past ctx_len
    q = torch.randn(B, Q, case.heads, KV_LORA + ROPE, generator=gen)
    index = torch.int32 if case.int32 else torch.int64
    window = window_masks(B, Q, gen) if case.window else None
    return dict(
        q=q.to(dtype),
        cache=cache.to(dtype),
        block_table=table.to(index),
        ctx_lens=torch.tensor(case.ctx_lens, dtype=index),
        q_lens=torch.tensor(case.q_lens, dtype=index),
        scale=0.3,
        kv_lora_rank=KV_LORA,
        window_mask=window,
    )


def check(out: torch.Tensor, inputs: dict) -> None:
    want = paged_mla_reference(**inputs)
    assert out.shape == want.shape and out.dtype == want.dtype
    torch.testing.assert_close(out, want, **TOLERANCE[out.dtype])
    for b, n in enumerate(inputs["q_lens"].tolist()):
        assert out[b, n:].eq(0).all(), "padding query rows must be zero"
    assert want.abs().max() < 10, "the reference itself saw garbage"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def test_reference_against_direct_softmax():
    """The oracle checked by hand, row by row over the keys each may see: a tree window
    after 34 tokens of context (request 2), a look-ahead window with no context (request 1)."""
    inputs = make_inputs(CASES["window"])
    out = paged_mla_reference(**inputs)
    assert inputs["window_mask"][1].triu(1).any(), "request 1 should look ahead"
    for b, (n, m) in enumerate(zip(CASES["window"].ctx_lens, CASES["window"].q_lens)):
        kv = inputs["cache"][inputs["block_table"][b]].reshape(-1, KV_LORA + ROPE)
        prefix, window = n - m, inputs["window_mask"][b]
        for i in range(m):
            keys = list(range(prefix)) + [prefix + j for j in range(m) if window[i, j]]
            probs = (inputs["q"][b, i] @ kv[keys].T * 0.3).softmax(-1)  # [H, keys]
            want = probs @ kv[keys, :KV_LORA]
            torch.testing.assert_close(out[b, i], want, **TOLERANCE[torch.float32])
        assert out[b, m:].eq(0).all()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", [*CASES, *EDGE_CASES])
def test_torch_matches_reference(name, dtype):
    inputs = make_inputs({**CASES, **EDGE_CASES}[name], dtype)
    check(paged_mla_torch(**inputs), inputs)


# kv_chunk_rows -> blocks per step for B = 3, block_size 16: 1, 2 and 5 (17 = 5 + 5 + 5 + 2).
@pytest.mark.parametrize("rows", [1, 96, 240], ids=["1-block", "2-blocks", "5-blocks"])
@pytest.mark.parametrize("name", ["blocks-1-2-17", "ragged-q3-int32", "window", *EDGE_CASES])
def test_torch_chunked_matches_reference(name, rows):
    inputs = make_inputs({**CASES, **EDGE_CASES}[name])
    check(paged_mla_torch(**inputs, kv_chunk_rows=rows), inputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_torch_chunked_low_precision(dtype):
    inputs = make_inputs(CASES["ragged-b5-q4"], dtype)
    check(paged_mla_torch(**inputs, kv_chunk_rows=16), inputs)


SPLITS = {"no-split": 1, "2-splits": 2, "3-splits": 3, "more-splits-than-blocks": 8}
# Without a GPU the kernels run on CPU tensors through Triton's interpreter (conftest sets
# TRITON_INTERPRET=1 there); with one, on the GPU.
needs_triton = pytest.mark.skipif(pm.triton is None, reason="triton is not installed")
TRITON_DEVICE = "cpu" if pm.triton is None or pm.interpreted(pm._split_kernel) else "cuda"


def on_triton_device(inputs: dict) -> dict:
    return {k: v.to(TRITON_DEVICE) if torch.is_tensor(v) else v for k, v in inputs.items()}


@needs_triton
@pytest.mark.parametrize("splits", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("name", CASES)
def test_triton_matches_reference(name, splits):
    inputs = on_triton_device(make_inputs(CASES[name]))
    check(paged_mla_triton(**inputs, num_splits=splits), inputs)


@needs_triton
@pytest.mark.parametrize("splits", [1, 3], ids=["no-split", "3-splits"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_low_precision(dtype, splits):
    inputs = on_triton_device(make_inputs(CASES["ragged-b5-q4"], dtype))
    check(paged_mla_triton(**inputs, num_splits=splits), inputs)


@needs_triton
def test_triton_chooses_splits():
    inputs = on_triton_device(make_inputs(CASES["q2-partial"]))
    check(paged_mla_triton(**inputs), inputs)
    assert pm.auto_num_splits(programs=4, max_keys=3000, units=132) == 12  # by length
    assert pm.auto_num_splits(programs=8, max_keys=100_000, units=132) == 17  # by filling
    assert pm.auto_num_splits(programs=264, max_keys=100_000, units=132) == 1  # full already
    assert pm.auto_num_splits(programs=1, max_keys=10**6, units=132) == pm.MAX_SPLITS


@needs_triton
def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(pm, "_split_kernel", object())  # as if compiled for a GPU
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        paged_mla_triton(**make_inputs(CASES["ctx1"]))


def test_triton_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(pm, "triton", None)
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        paged_mla_triton(**make_inputs(CASES["ctx1"]))


@pytest.mark.parametrize("name", ["paged_mla", "paged_mla_triton"])
def test_each_backend_is_one_node_under_fullgraph_compile(name):
    """Graph mode compiles with the table width W dynamic: each backend must trace as one
    opaque node, with one graph serving every W. The Triton one too: traced into, Inductor
    passes its scale as fp64 and autotunes it on a copy of the KV cache (both seen on an
    H200)."""
    fn = paged_mla_torch if name == "paged_mla" else paged_mla_triton
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(fullgraph=True, backend=backend)
    def attend(q, cache, table, ctx_lens, q_lens):
        return fn(q, cache, table, ctx_lens, q_lens, 0.3, KV_LORA) * 2

    torch.compiler.reset()
    for pad in (1, 4):
        inputs = make_inputs(CASES["q2-partial"], pad=pad)
        torch._dynamo.mark_dynamic(inputs["block_table"], 1)
        args = [inputs[k] for k in ("q", "cache", "block_table", "ctx_lens", "q_lens")]
        torch.testing.assert_close(attend(*args), 2 * paged_mla_reference(**inputs))
    torch.compiler.reset()
    assert len(graphs) == 1
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert getattr(torch.ops.xllm, name).default in ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("splits", [None, 1], ids=["auto-splits", "no-split"])
def test_triton_on_cuda_at_v3_shapes(splits):
    """DeepSeek-V3 per-rank geometry at TP8: 16 heads, kv_lora 512, rope 64, bf16."""
    gen = torch.Generator().manual_seed(0)
    B, Q, H, R, P, bs = 4, 2, 16, 512, 64, 64
    ctx_lens = torch.tensor([3000, 2877, 3137, 65])
    q_lens = torch.tensor([2, 1, 2, 2])
    width = -(-int(ctx_lens.max()) // bs)
    num_blocks = B * width + 1
    cache = torch.randn(num_blocks, bs, R + P, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[: B * width].view(B, width)
    q = torch.randn(B, Q, H, R + P, generator=gen)
    inputs = dict(
        q=q.to("cuda", torch.bfloat16),
        cache=cache.to("cuda", torch.bfloat16),
        block_table=table.to("cuda", torch.int32),
        ctx_lens=ctx_lens.cuda(),
        q_lens=q_lens.cuda(),
        scale=192**-0.5,
        kv_lora_rank=R,
    )
    out = paged_mla_triton(**inputs, num_splits=splits)
    check(out, inputs)
    # Outputs here average ~3000 values (|out| ~ 0.1), so the elementwise bf16 tolerance is
    # loose: the error as a whole must also be small.
    want = paged_mla_reference(**inputs).float()
    assert (out.float() - want).norm() < 1e-2 * want.norm()
