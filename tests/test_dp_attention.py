"""DP attention with expert-parallel all-to-all (`--enable_dp_attention`, docs/design.md
section 2) across real processes joined by torch.distributed (gloo).

Each rank is its own engine (scheduler, paged latent cache, MTP drafts) over its share of
32 held-out ShareGPT prompts; the routed experts are partitioned over the ranks and every
MoE layer exchanges tokens with all-to-all. Each rank steps while any rank has work
(the lockstep the master's engine core keeps in a cluster), so a rank with no requests
joins every exchange with no tokens. Against one process on conftest.py's shallow copy
of the bundled model (2 decoder layers; the check holds for any weights), greedy,
32 tokens each: the same tokens, logprobs within 1e-4, on 2 and 4 ranks (k = 0 and 1 on 2
ranks only: 4 ranks' exchanges take the same shapes with k = 2, and more of them):
- MTP k = 0, 1 and 2, the prompts spread evenly;
- unevenly: one rank with none at all (it runs every step idle), one with a single prompt
  that finishes early, chained drafts of different lengths meeting in one step;
- under preemption (a KV cache too small for the rank's batch) with the prefix cache;
- near the context end (vLLM's DP + EP + MTP hang's shape): with a 96-token context and
  k = 2, one rank's requests all reach it (their draft chains stop short of it) while the
  other ranks' requests go on decoding.
Each rank also checks the exchange's transport (uneven all-to-all of bf16 rows, bit for
bit) and the lockstep's max all-reduce. Graph mode on 2 ranks (slow: `make test-slow`)
gives one eager process's tokens. Sampled decoding under DP attention is in
tests/test_spec_sampling_distribution.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.conftest import SHALLOW_LAYERS
from tests.ranks import lockstep_generate, run_ranks, use_parallel_workers
from tests.test_bundled_model import held_out_user_turns
from tests.test_tensor_parallel import assert_same_logprobs
from xllm_py import LLM, SamplingParams
from xllm_py.parallel.context import ParallelContext

N_PROMPTS, NEW_TOKENS = 32, 32
ENGINE = dict(dtype="float32", block_size=16)
CONTEXT_END = 96  # the context_end job's max_model_len: prompts over 32 tokens reach it
# a block of the shallow model's cache: its layers and the MTP layer, latent 64 + rope 32
BLOCK_BYTES = (SHALLOW_LAYERS + 1) * 16 * (64 + 32) * 4
ROOMY = dict(max_cache_size=512 * BLOCK_BYTES)
# 24 blocks: fewer than the 16 prompts of one rank (each 2-3 blocks) need together
TIGHT = dict(max_cache_size=24 * BLOCK_BYTES, enable_prefix_cache=True)


@pytest.fixture(scope="module")
def prompts(shallow_model) -> list[list[int]]:
    tok = LLM(model=shallow_model, **ENGINE, **ROOMY, max_model_len=1024).get_tokenizer()
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
        for t in held_out_user_turns(N_PROMPTS)
    ]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)


def generate(
    llm: LLM,
    prompts: dict[int, list[int]],
    params: SamplingParams,
    parallel: ParallelContext | None = None,
):
    """{prompt index: (tokens, logprobs)}: one process's generate, or (`parallel`) this
    rank's requests stepped in lockstep until no rank has work (and the step count)."""
    if parallel is not None:
        return lockstep_generate(llm, prompts, params, parallel)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], params)
    return {i: (o.outputs[0].token_ids, o.outputs[0].logprobs) for i, o in zip(prompts, outs)}


def spread(n_ranks: int, how: str, prompts: list[list[int]]) -> list[list[int]]:
    """Prompt indices per rank."""
    idx = list(range(N_PROMPTS))
    if how == "even":
        return [idx[r::n_ranks] for r in range(n_ranks)]
    if how == "long_on_rank_0":  # the prompts that reach the context end on rank 0
        short = [i for i in idx if len(prompts[i]) <= CONTEXT_END - 64]
        return [
            [i for i in idx if i not in short],
            *(short[r :: n_ranks - 1] for r in range(n_ranks - 1)),
        ]
    # uneven: rank 1 has none; on more ranks, the last one prompt; rank 0 the rest
    if n_ranks == 2:
        return [idx, []]
    return [idx[:-1], *([[]] * (n_ranks - 2)), [idx[-1]]]


# (name, k, spread, cache options, max_model_len, max_tokens); the reference is one
# process with the same k, context and max_tokens
JOBS = [
    ("k0", 0, "even", ROOMY, 1024, NEW_TOKENS),
    ("k1", 1, "even", ROOMY, 1024, NEW_TOKENS),
    ("k2", 2, "even", ROOMY, 1024, NEW_TOKENS),
    ("k2_uneven", 2, "uneven", ROOMY, 1024, NEW_TOKENS),
    ("k2_preempted", 2, "even", TIGHT, 1024, NEW_TOKENS),
    ("k2_context_end", 2, "long_on_rank_0", ROOMY, CONTEXT_END, 64),
]


# On 4 ranks (4 processes on a 2-core machine), the jobs that 2 ranks cannot show: ranks
# with nothing to run (`uneven`) and one rank reaching the context's end alone
FOUR_RANK_JOBS = ("k2_uneven", "k2_context_end")


def jobs_for(world: int) -> list[tuple]:
    """JOBS run on `world` ranks: all on 2, FOUR_RANK_JOBS on 4."""
    return [job for job in JOBS if world == 2 or job[0] in FOUR_RANK_JOBS]


def _rank_jobs(model: str, prompts, parallel: ParallelContext) -> dict:
    use_parallel_workers(parallel)
    # the exchange's transport: rank r sends r + 1 rows to each rank, in bf16, and gets
    # them back in rank order, bit for bit
    n, r = parallel.dp_size, parallel.dp_rank
    rows = torch.arange(n * (r + 1), dtype=torch.bfloat16).view(-1, 1) + 10 * r  # exact
    got = parallel.all_to_all(rows, [r + 1] * n, list(range(1, n + 1)))
    want = torch.cat([torch.arange(r * (s + 1), (r + 1) * (s + 1)) + 10 * s for s in range(n)])
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(-1).float(), want.float())
    assert parallel.max_over_dp([r, -r], torch.device("cpu")) == [n - 1, 0]
    out = {}
    for name, k, how, cache, max_len, max_tokens in jobs_for(parallel.dp_size):
        llm = LLM(model=model, **ENGINE, **cache, max_model_len=max_len, num_speculative_tokens=k)
        mine = spread(parallel.dp_size, how, prompts)[parallel.dp_rank]
        done, steps = generate(llm, {i: prompts[i] for i in mine}, greedy(max_tokens), parallel)
        out[name] = (done, steps, llm.engine.core.stats().num_preemptions)
        del llm
    return out


@pytest.fixture(scope="module")
def single(shallow_model, prompts):
    out = {}
    for k, max_len, max_tokens in {(k, m, t) for _, k, _, _, m, t in JOBS}:
        llm = LLM(
            model=shallow_model, **ENGINE, **ROOMY, max_model_len=max_len, num_speculative_tokens=k
        )
        out[k, max_len] = generate(llm, dict(enumerate(prompts)), greedy(max_tokens))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_dp_attention_ranks_generate_like_one_process(
    shallow_model, prompts, single, world, tmp_path
):
    jobs = functools.partial(_rank_jobs, shallow_model, prompts)
    ranks = run_ranks(world, jobs, tmp_path, world=world, dp_attention=True)
    for name, k, how, _, max_len, _ in jobs_for(world):
        merged, steps = {}, set()
        for r, rank in enumerate(ranks):
            done, n_steps, preemptions = rank[name]
            assert sorted(done) == sorted(spread(world, how, prompts)[r]), f"{name} rank {r}"
            merged |= done
            steps.add(n_steps)
        assert len(steps) == 1, f"{name}: the ranks ran different step counts {steps}"
        for i, (tokens, logprobs) in single[k, max_len].items():
            where = f"{name} on {world} ranks, prompt {i}"
            assert merged[i][0] == tokens, where
            assert_same_logprobs(merged[i][1], logprobs, where)
    # the tight cache did preempt on some rank (else the test would not test it), and
    # rank 0's requests stopped at the context end, short of their 64 tokens
    assert world != 2 or any(rank["k2_preempted"][2] > 0 for rank in ranks)
    ends = ranks[0]["k2_context_end"][0]
    assert ends and all(len(prompts[i]) + len(t) == CONTEXT_END for i, (t, _) in ends.items())


def _rank_graphs(model: str, prompts, parallel: ParallelContext) -> dict:
    use_parallel_workers(parallel)
    llm = LLM(model=model, **ENGINE, **ROOMY, max_model_len=1024, num_speculative_tokens=1,
              enable_graph=True, graph_batch_sizes=[4])  # fmt: skip
    mine = range(8) if parallel.dp_rank == 0 else []
    done, _ = generate(llm, {i: prompts[i] for i in mine}, greedy(16), parallel)
    runner = llm.engine.core.executor.worker.runner
    return done, dict(runner.graphs.steps)


# Slow (compiling on both ranks): `make test-slow`.
@pytest.mark.slow
def test_dp_attention_in_graph_mode_generates_like_one_eager_process(
    shallow_model, prompts, tmp_path
):
    """Graph mode on 2 DP-attention ranks, MTP k = 1, buckets of 4: the exchange is one op
    in the graphs, so a rank decoding in a graph meets one that is idle (rank 1 has no
    requests) or eager; the tokens and logprobs of one eager process."""
    want = generate(
        LLM(model=shallow_model, **ENGINE, **ROOMY, max_model_len=1024, num_speculative_tokens=1),
        dict(enumerate(prompts[:8])),
        greedy(16),
    )
    ranks = run_ranks(
        2,
        functools.partial(_rank_graphs, shallow_model, prompts),
        tmp_path,
        world=2,
        dp_attention=True,
    )
    (done, steps), (idle, _) = ranks
    assert not idle and sum(steps.values()) > 0, steps  # rank 0 decoded in its graphs
    for i, (tokens, logprobs) in want.items():
        assert done[i][0] == tokens, f"prompt {i}"
        assert_same_logprobs(done[i][1], logprobs, f"prompt {i}")
