"""The kernel backends end to end: the engine with the Triton paged-MLA and fused-MoE
kernels (run here by Triton's interpreter, as conftest.py sets it up without a GPU) gives
the tokens and logprobs the torch backends give, with and without MTP drafts; and a
backend that cannot run is refused at start-up, naming the flag and what is missing."""

from __future__ import annotations

import pytest
import torch

from tests.test_engine import chosen_logprobs
from tools.make_random_checkpoint import make_random_checkpoint
from xllm_py import LLM, SamplingParams
from xllm_py.config import DeviceConfig
from xllm_py.ops.backends import select_kernels

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
# Ragged prompts; with block_size 16 some contexts end inside a block, some span 4 blocks.
PROMPT_LENS = (3, 17, 40, 9, 2, 33, 16, 50)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("kernels"), seed=3)


def run(ckpt, dtype="float32", **kw) -> tuple[list[list[int]], list[list[float]]]:
    llm = LLM(model=str(ckpt), dtype=dtype, block_size=16, **kw)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in PROMPT_LENS]
    outs = [o.outputs[0] for o in llm.generate(prompts, PARAMS)]
    return [o.token_ids for o in outs], [chosen_logprobs(o) for o in outs]


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "mtp_k2"])
def test_triton_backends_give_the_torch_backends_tokens(ckpt, k):
    spec = dict(num_speculative_tokens=k, speculative_confidence="off") if k else {}
    tokens, logprobs = run(ckpt, attention_backend="torch", moe_backend="torch", **spec)
    t_tokens, t_logprobs = run(ckpt, attention_backend="triton", moe_backend="triton", **spec)
    assert t_tokens == tokens
    worst = max(abs(a - b) for x, y in zip(logprobs, t_logprobs) for a, b in zip(x, y))
    assert worst <= 1e-4


def test_a_backend_that_cannot_run_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend=triton.*TRITON_INTERPRET=1"):
        select_kernels(DeviceConfig(attention_backend="triton"))
    with pytest.raises(ValueError, match="moe_backend=triton.*TRITON_INTERPRET=1"):
        select_kernels(DeviceConfig(moe_backend="triton"))
    with pytest.raises(ValueError, match="attention_backend=flashinfer needs a CUDA device"):
        select_kernels(DeviceConfig(attention_backend="flashinfer"))
    with pytest.raises(ValueError, match="attention_backend='flash'.*torch, triton"):
        DeviceConfig(attention_backend="flash")
    auto = select_kernels(DeviceConfig())
    assert (auto.attention, auto.moe) == ("torch", "torch")  # auto on CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("k", [0, 2], ids=["plain", "mtp_k2"])
def test_triton_backends_on_cuda_give_the_torch_backends_tokens(ckpt, k):
    """The compiled kernels on a GPU, float32 (so that greedy ties cannot flip) and the
    auto choice, which is Triton on CUDA."""
    spec = dict(num_speculative_tokens=k, speculative_confidence="off") if k else {}
    cuda = dict(device="cuda:0", **spec)
    tokens, logprobs = run(ckpt, attention_backend="torch", moe_backend="torch", **cuda)
    t_tokens, t_logprobs = run(ckpt, **cuda)
    assert t_tokens == tokens
    worst = max(abs(a - b) for x, y in zip(logprobs, t_logprobs) for a, b in zip(x, y))
    assert worst <= 1e-3  # GPU kernels sum in different orders from one another


def test_kernel_benchmark_shows_block_wise_attention_holds_a_chunk_not_the_context(tmp_path):
    """perf/kernels.py on CPU: a row per op and backend, and the memory figure the issue
    asked for: at batch 8 x 1,024-token contexts the gather form holds every context at
    once, the block-wise form (4,096 rows a chunk) half of them."""
    from perf import kernels

    out = tmp_path / "k.json"
    argv = ["--device", "cpu", "--batch", "8", "--context", "1024", "--iters", "1", "--memory"]
    result = kernels.main(argv + ["--out", str(out)])
    rows = {(r["op"], r["backend"]): r for r in result["rows"]}
    assert set(rows) == {
        ("paged_mla", "gather"),
        ("paged_mla", "torch"),
        ("fused_moe", "torch"),
        ("fp8_gemm", "torch"),
    }
    context_mib = 8 * 1024 * (512 + 64) * 4 / 2**20  # 18 MiB of float32 latents
    assert rows["paged_mla", "gather"]["peak_extra_mib"] >= context_mib
    assert rows["paged_mla", "torch"]["peak_extra_mib"] <= 0.75 * context_mib
    assert out.is_file() and all(r["ms"] > 0 for r in result["rows"])
