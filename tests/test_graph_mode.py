"""Graph mode (`--enable_graph`, worker/graph_runner.py): uniform decode and verification
steps run as compiled graphs with `fullgraph=True`, so a graph break (a host sync, a
data-dependent Python branch) fails the engine's start here. With graphs on, greedy tokens
equal eager decoding's and logprobs agree within 1e-5, for plain decoding and with MTP
drafts, on batches that need padding (3 and 1 requests in a bucket of 4); with MTP drafts
sampled from the draft's distribution, the sampled tokens keep plain eager decoding's
distribution (tests/test_spec_sampling_distribution.py's comparison).

Compiling is most of this file's time, so the k = 2 engine is compiled once, for its
greedy and its sampled test; plain decoding (k = 0) is compiled once, by the background
warm-up test, which holds the same exactness bar once its graphs are in. The model is
conftest.py's `shallow_model`, the bundled model's shapes with 2 decoder layers (one dense,
one MoE) instead of 8: Inductor compiles each layer's kernels, and what graph mode must
get right is the same for every layer."""

from __future__ import annotations

import pytest
import torch

import tests.test_spec_sampling_distribution as dist
from tests.test_bundled_model import held_out_user_turns
from xllm_py import LLM, SamplingParams
from xllm_py.models.layers import moe

# Different lengths: the batch shrinks from 3 to 1 as requests finish.
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=0) for n in (24, 12, 6)]
# The one batch size compiled; the sampled test's requests come in waves of this size.
BUCKET = 4
# Single-row steps of the model (top-2 of 8 experts, as in the bundled one) make 8 (token,
# expert) assignments at BUCKET, verification of k = 2 drafts 24. With graphs gathering
# the chosen experts' weights up to 16 assignments (models/layers/moe.py; the daemon's
# limit is higher), the first take the gathered form in the graph and the second the
# grouped one, so both run here.
GATHER_LIMIT = 16
# At most BUCKET requests per step, so on CPU every engine here sizes its KV cache for that
# many full-length requests, 128 blocks (by default it would zero room for 256).
OPTIONS = dict(dtype="float32", block_size=16, max_model_len=512, max_seqs_per_batch=BUCKET)
K = 2  # draft tokens of the MTP engine
# Continuations of the graph-mode sampling test, against plain's 2,000 (suite time: each
# wave of 4 is a few steps; the chi-square test takes unequal arms)
GRAPH_SAMPLES = 1000


@pytest.fixture(scope="module", autouse=True)
def both_moe_forms():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "GRAPH_GATHER_ASSIGNMENTS", GATHER_LIMIT)
        yield


@pytest.fixture(scope="module")
def eager_llm(shallow_model):
    return LLM(model=shallow_model, **OPTIONS)


@pytest.fixture(scope="module")
def prompts(eager_llm):
    tok = eager_llm.get_tokenizer()
    return [
        tok.apply_chat_template([{"role": "user", "content": t}]) for t in held_out_user_turns(3)
    ]


def decode(llm, prompts):
    outs = [o.outputs[0] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    return [o.token_ids for o in outs], [
        [lp[t] for lp, t in zip(o.logprobs, o.token_ids)] for o in outs
    ]


@pytest.fixture(scope="module")
def eager(eager_llm, prompts):
    return decode(eager_llm, prompts)


@pytest.fixture(scope="module")
def mtp_graphs(shallow_model):
    """Graph mode with MTP k = 2 in one bucket of 4 requests (compiled at start-up, the
    offline default), and the graph breaks dynamo counted while compiling. Every step
    drafts k (confidence scheduling off: its draft lengths follow the measured step
    costs, so which graph a step takes would depend on the machine's load)."""
    torch._dynamo.utils.counters.clear()
    llm = LLM(
        model=shallow_model,
        enable_graph=True,
        graph_batch_sizes=[BUCKET],
        num_speculative_tokens=K,
        speculative_confidence="off",
        seed=31,
        **OPTIONS,
    )
    return llm, dict(torch._dynamo.utils.counters["graph_break"])


def decode_counting_eager_steps(llm, prompts):
    """decode(), and the steps that ran eager meanwhile."""
    runner = llm.engine.core.executor.worker.runner
    eager_steps = []
    inner = runner._forward
    runner._forward = lambda *args: eager_steps.append(args) or inner(*args)
    try:
        return decode(llm, prompts), eager_steps
    finally:
        del runner._forward  # the method again


def steps_in(graphs) -> int:
    """Steps run in `graphs` (a GraphRunner) so far, over all its buckets."""
    return sum(graphs.steps.values())


def assert_eager_results(got, want):
    assert got[0] == want[0]
    for lp, eager_lp in zip(got[1], want[1]):
        assert lp == pytest.approx(eager_lp, abs=1e-5)


def test_graph_mode_with_mtp_gives_eager_tokens_and_logprobs(prompts, eager, mtp_graphs):
    llm, graph_breaks = mtp_graphs
    runner = llm.engine.core.executor.worker.runner
    assert runner.graphs is not None and not graph_breaks
    target, mtp = steps_in(runner.graphs), steps_in(runner.proposer.graphs[0])
    got, eager_steps = decode_counting_eager_steps(llm, prompts)
    assert_eager_results(got, eager)
    # Only the prefill ran eager; every later step in a graph: verification of up to
    # k = 2 drafts (fewer as max_tokens nears, padded in the graph), and after each, the
    # MTP passes over the verified rows and the chained drafts
    assert len(eager_steps) == 1
    graph_steps = steps_in(runner.graphs) - target
    assert graph_steps >= (max(p.max_tokens for p in PARAMS) - 1) // (1 + K)
    assert steps_in(runner.proposer.graphs[0]) - mtp >= 2 * graph_steps
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_graph_mode_speculative_sampling_keeps_the_distribution(shallow_model, mtp_graphs):
    """Verification and drafting in graphs, the drafts sampled from q: GRAPH_SAMPLES
    continuations at temperature 1.2 with min-p 0.05 against plain eager decoding's
    (test_spec_sampling_distribution.py's prompt and chi-square test; the plain arm
    sampled here, from the same model). Requests come in waves of 4, the bucket (a step
    that admits a request mixes its prefill with the others' verification, and runs
    eager); a wave's batch shrinks as its requests finish, padded to the bucket."""
    llm, _ = mtp_graphs
    runner = llm.engine.core.executor.worker.runner
    assert runner.draft_sampler is not None  # sampled drafts
    setting, ids = "t1.2-minp0.05", dist.prompt_ids()
    plain = dist.sample(ids, setting, 0, seed=1, model=shallow_model)[0]
    m0, key = llm.get_metrics(), (BUCKET, 1 + K)
    target, mtp = runner.graphs.steps.get(key, 0), steps_in(runner.proposer.graphs[0])
    spec = dist.draw(llm, ids, setting, wave=BUCKET, samples=GRAPH_SAMPLES)
    m = llm.get_metrics()
    assert 0 < m.accepted_tokens - m0.accepted_tokens < m.draft_tokens - m0.draft_tokens
    # verification and drafting ran in graphs in most waves (the last steps of a wave,
    # where drafts are cut short by max_tokens, are not uniform and run eager; so is the
    # MTP pass over the verified rows when the requests accepted different numbers of
    # drafts, while the chained draft pass, a row each, is uniform)
    waves = GRAPH_SAMPLES // BUCKET
    assert runner.graphs.steps.get(key, 0) - target > waves / 2
    assert steps_in(runner.proposer.graphs[0]) - mtp > waves / 2
    dist.assert_same_distribution(plain, spec, f"graph mode, k=2 vs plain, {setting}")


def test_background_warm_up_serves_eager_at_once_then_swaps_the_graphs_in(
    shallow_model, prompts, eager
):
    """--graph_warm_up=background (the daemon's default), plain decoding: the engine answers
    while its graphs compile on another thread (eager's tokens meanwhile, no step waits for
    the compiler), and once they are compiled every step after the prefill runs in them,
    with eager's tokens and logprobs within 1e-5."""
    torch._dynamo.utils.counters.clear()
    llm = LLM(
        model=shallow_model,
        enable_graph=True,
        graph_batch_sizes=[BUCKET],
        graph_warm_up="background",
        **OPTIONS,
    )
    worker = llm.engine.core.executor.worker
    graphs = worker.runner.graphs
    assert decode(llm, prompts)[0] == eager[0]  # while compiling (or just after)
    worker._compiler.join(900)
    assert graphs.warm and graphs.fast_guards
    assert not torch._dynamo.utils.counters["graph_break"]
    before = steps_in(graphs)
    got, eager_steps = decode_counting_eager_steps(llm, prompts)
    assert_eager_results(got, eager)
    assert len(eager_steps) == 1  # the prefill; every decode step in a graph
    assert steps_in(graphs) - before >= max(p.max_tokens for p in PARAMS) - 1
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_graph_mode_flags_are_checked():
    with pytest.raises(ValueError, match="graph_batch_sizes=\\[0\\]"):
        LLM(enable_graph=True, graph_batch_sizes=[0], **OPTIONS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("k", [0, 2])
def test_graph_mode_on_cuda_gives_eager_tokens(shallow_model, prompts, k):
    """The same graphs (Inductor) on a CUDA device: eager's tokens, logprobs within 1e-4
    (GPU kernels round differently from one another)."""
    opts = dict(
        OPTIONS,
        model=shallow_model,
        device="cuda:0",
        num_speculative_tokens=k,
        max_cache_size=2**30,
    )
    eager_tokens, eager_logprobs = decode(LLM(**opts), prompts)
    tokens, logprobs = decode(LLM(enable_graph=True, graph_batch_sizes=[4], **opts), prompts)
    assert tokens == eager_tokens
    for got, want in zip(logprobs, eager_logprobs):
        assert got == pytest.approx(want, abs=1e-4)
