"""Graph mode (`--enable_graph`, worker/graph_runner.py): uniform decode and verification
steps run as compiled graphs with `fullgraph=True`, so a graph break (a host sync, a
data-dependent Python branch) fails the engine's start here. With graphs on, greedy tokens
equal eager decoding's and logprobs agree within 1e-5, for plain decoding and with MTP
drafts, on batches that need padding (3 and 1 requests in a bucket of 4)."""

from __future__ import annotations

import pytest
import torch

from tests.test_bundled_model import held_out_user_turns
from xllm_py import LLM, SamplingParams

# Different lengths: the batch shrinks from 3 to 1 as requests finish.
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=0) for n in (24, 12, 6)]
OPTIONS = dict(dtype="float32", block_size=16, max_model_len=512)


@pytest.fixture(scope="module")
def prompts():
    llm = LLM(**OPTIONS)
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template([{"role": "user", "content": t}]) for t in held_out_user_turns(3)
    ]


def decode(llm, prompts):
    outs = [o.outputs[0] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    return [o.token_ids for o in outs], [
        [lp[t] for lp, t in zip(o.logprobs, o.token_ids)] for o in outs
    ]


@pytest.fixture(scope="module")
def eager(prompts):
    return decode(LLM(**OPTIONS), prompts)


@pytest.mark.parametrize("k", [0, 2])
def test_graph_mode_gives_eager_tokens_and_logprobs(prompts, eager, k):
    torch._dynamo.utils.counters.clear()
    llm = LLM(enable_graph=True, graph_batch_sizes=[4], num_speculative_tokens=k, **OPTIONS)
    runner = llm.engine.core.executor.worker.runner
    assert runner.graphs is not None and not torch._dynamo.utils.counters["graph_break"]
    eager_steps = []
    inner = runner._forward
    runner._forward = lambda *args: eager_steps.append(args) or inner(*args)
    tokens, logprobs = decode(llm, prompts)
    assert tokens == eager[0]
    for got, want in zip(logprobs, eager[1]):
        assert got == pytest.approx(want, abs=1e-5)
    # Only the prefill ran eager; every later step in a graph: decode steps (k = 0), or
    # verification of up to k drafts (k = 2; fewer as max_tokens nears, padded in the graph)
    assert len(eager_steps) == 1
    graph_steps = sum(runner.graphs.steps.values())
    assert graph_steps >= (max(p.max_tokens for p in PARAMS) - 1) // (1 + k)
    if k:  # and after each, the MTP passes over the verified rows and the chained drafts
        assert sum(runner.proposer.graphs[0].steps.values()) >= 2 * graph_steps
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_background_warm_up_serves_eager_at_once_then_swaps_the_graphs_in(prompts, eager):
    """--graph_warm_up=background (the daemon's default): the engine answers while its
    graphs compile on another thread (eager's tokens meanwhile, no step waits for the
    compiler), and once they are compiled the decode steps run in them."""
    llm = LLM(enable_graph=True, graph_batch_sizes=[4], graph_warm_up="background", **OPTIONS)
    worker = llm.engine.core.executor.worker
    graphs = worker.runner.graphs
    assert decode(llm, prompts)[0] == eager[0]  # while compiling (or just after)
    worker._compiler.join(900)
    assert graphs.warm and graphs.fast_guards
    before = sum(graphs.steps.values())
    tokens, logprobs = decode(llm, prompts)
    assert tokens == eager[0]
    for got, want in zip(logprobs, eager[1]):
        assert got == pytest.approx(want, abs=1e-5)
    assert sum(graphs.steps.values()) - before >= max(p.max_tokens for p in PARAMS) - 1


def test_graph_mode_flags_are_checked():
    with pytest.raises(ValueError, match="graph_batch_sizes=\\[0\\]"):
        LLM(enable_graph=True, graph_batch_sizes=[0], **OPTIONS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("k", [0, 2])
def test_graph_mode_on_cuda_gives_eager_tokens(prompts, k):
    """The same graphs (Inductor) on a CUDA device: eager's tokens, logprobs within 1e-4
    (GPU kernels round differently from one another)."""
    opts = dict(OPTIONS, device="cuda:0", num_speculative_tokens=k, max_cache_size=2**30)
    eager_tokens, eager_logprobs = decode(LLM(**opts), prompts)
    tokens, logprobs = decode(LLM(enable_graph=True, graph_batch_sizes=[4], **opts), prompts)
    assert tokens == eager_tokens
    for got, want in zip(logprobs, eager_logprobs):
        assert got == pytest.approx(want, abs=1e-4)
