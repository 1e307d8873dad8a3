"""The engine gives the same tokens whatever the batching: prefix cache on/off (hits
counted in the very run compared with the cache-off tokens), chunked prefill on/off,
one sequence per step or many, and under preemption. Finished and aborted requests give
every block back."""

from __future__ import annotations

import itertools

import pytest

from tests.hf_reference import random_prompts
from xllm_py import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def prompts(vocab_size):
    base = random_prompts(vocab_size, [5, 19, 33, 48, 72, 12, 2, 40], seed=7)
    shared = base[4][:48]  # three prompts share base[4]'s first 3 blocks (block_size 16)
    return base + [shared + p for p in random_prompts(vocab_size, [3, 9, 17], seed=8)]


def cached_prefix_tokens(prompt: list[int], computed: list[list[int]], block_size: int = 16) -> int:
    """Tokens of `prompt` the prefix cache can serve once the sequences `computed` went
    through the engine: the full blocks of its longest common prefix with one of them, short
    of the prompt's last token, which is always computed."""
    common = max(
        sum(1 for _ in itertools.takewhile(lambda ab: ab[0] == ab[1], zip(prompt, c)))
        for c in computed
    )
    return min(common, len(prompt) - 1) // block_size * block_size


def block_bytes(model_dir) -> int:
    from xllm_py.config import ModelConfig

    m = ModelConfig.from_pretrained(model_dir)
    return m.num_hidden_layers * 16 * m.kv_cache_dim * 4  # one block of 16, float32


def run(model_dir, prompts, **kw):
    llm = LLM(model=str(model_dir), dtype="float32", block_size=16, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert llm.engine.core.blocks.num_free_blocks == llm.engine.core.blocks.num_blocks
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def baseline(tiny_model_dir, prompts):
    tokens, _ = run(tiny_model_dir, prompts, enable_prefix_cache=False)
    assert all(len(t) == 24 for t in tokens)
    return tokens


def chosen_logprobs(completion) -> list[float]:
    return [lp[t] for lp, t in zip(completion.logprobs, completion.token_ids)]


@pytest.fixture(scope="module")
def follow_up(tiny_model_dir, vocab_size, prompts, baseline):
    """A second turn: base[4], its reply and new tokens. Its tokens and their logprobs
    without the prefix cache."""
    prompt = prompts[4] + baseline[4] + random_prompts(vocab_size, [6], seed=9)[0]
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=16, enable_prefix_cache=False)
    out = llm.generate({"prompt_token_ids": prompt}, WITH_LOGPROBS)[0].outputs[0]
    return prompt, out.token_ids, chosen_logprobs(out)


@pytest.mark.parametrize("preempt", [False, True], ids=["prefix-cache", "prefix-cache-preemption"])
def test_prefix_cache_hits_give_the_same_tokens(
    tiny_model_dir, prompts, baseline, follow_up, preempt
):
    """Two waves in one engine: base[4] alone, then the rest, which find base[4]'s blocks in
    the cache (prompt and reply: the follow-up turn reuses blocks written while decoding)."""
    # 12 blocks: the second wave's cache-hitting prompts take 11 at admission, then grow.
    kw = dict(max_cache_size=12 * block_bytes(tiny_model_dir)) if preempt else {}
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=16, **kw)

    def generate(ps, params=GREEDY):
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]

    assert generate([prompts[4]])[0].token_ids == baseline[4]
    # Second wave: the follow-up turn and the three prompts sharing base[4]'s first 3 blocks
    # come first, so they are admitted before anything else can evict those blocks.
    order = [8, 9, 10, 0, 1, 2, 3, 5, 6, 7]
    wave = [follow_up[0]] + [prompts[i] for i in order]
    computed = [prompts[4] + baseline[4][:-1]]  # all but the last token went through the model
    expected_hits = sum(cached_prefix_tokens(p, computed) for p in wave)
    assert expected_hits == (5 + 3 * 3) * 16  # (72 + 23) // 16 blocks, 3 blocks for 3 prompts
    before = llm.get_stats()
    outs = generate(wave, [WITH_LOGPROBS] + [GREEDY] * len(order))
    after = llm.get_stats()
    assert [o.token_ids for o in outs] == [follow_up[1]] + [baseline[i] for i in order]
    # base[4] + reply is 96 tokens, 6 blocks, but its last token was never computed: a cached
    # 6th block would serve the follow-up a missing entry, which logprobs show.
    assert chosen_logprobs(outs[0]) == pytest.approx(follow_up[2], abs=1e-4)
    assert after.prefix_cache_hits - before.prefix_cache_hits >= expected_hits
    if preempt:
        assert llm.engine.core.blocks.num_blocks == 12
        assert after.num_preemptions > before.num_preemptions
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_chunked_prefill_gives_same_tokens(tiny_model_dir, prompts, baseline):
    tokens, _ = run(tiny_model_dir, prompts, enable_chunked_prefill=True, max_tokens_per_batch=16)
    assert tokens == baseline


def test_chunked_prefill_of_a_lone_long_prompt(tiny_model_dir, prompts, baseline):
    """The 72-token prompt alone, 16 tokens a step: the first steps sample no row at all."""
    tokens, _ = run(
        tiny_model_dir, [prompts[4]], enable_chunked_prefill=True, max_tokens_per_batch=16
    )
    assert tokens == [baseline[4]]


def test_without_chunked_prefill(tiny_model_dir, prompts, baseline):
    tokens, _ = run(tiny_model_dir, prompts, enable_chunked_prefill=False, max_tokens_per_batch=128)
    assert tokens == baseline


@pytest.mark.parametrize("max_seqs", [1, 64])
def test_max_seqs_per_batch(tiny_model_dir, prompts, baseline, max_seqs):
    tokens, _ = run(tiny_model_dir, prompts, max_seqs_per_batch=max_seqs)
    assert tokens == baseline


def test_forced_preemption_finishes_all_with_same_tokens(tiny_model_dir, prompts, baseline):
    # 12 blocks of 16 tokens: the longest request needs 6, the batch needs far more. No prefix
    # cache: a preempted request recomputes everything (with it: the test above).
    tokens, llm = run(
        tiny_model_dir,
        prompts,
        max_cache_size=12 * block_bytes(tiny_model_dir),
        enable_prefix_cache=False,
    )
    assert llm.engine.core.blocks.num_blocks == 12
    assert llm.get_stats().num_preemptions > 0
    assert tokens == baseline


def test_absorbed_and_expanded_attention_agree(tiny_model_dir, prompts, monkeypatch):
    from xllm_py.models import attention_layout

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    results = []
    for limit in (0, 10_000):  # everything expanded / everything absorbed (prefill too)
        monkeypatch.setattr(attention_layout, "ABSORB_MAX_Q", limit)
        llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=16)
        results.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
    for a, b in zip(*results):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert la[t] == pytest.approx(lb[t], abs=1e-4)


def test_abort_frees_blocks(tiny_model_dir, prompts):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=16)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.core.blocks.num_free_blocks < engine.core.blocks.num_blocks
    for i in range(len(prompts)):
        engine.abort_request(str(i))
    assert not engine.has_unfinished()
    assert engine.core.blocks.num_free_blocks == engine.core.blocks.num_blocks
    # the engine still serves after aborts, and the worker forgot the aborted requests
    out = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)
    assert len(out[0].outputs[0].token_ids) == 24
    engine.step()  # delivers the finished ids to the worker
    assert engine.core.executor.worker.runner.requests == {}
