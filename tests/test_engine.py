"""The engine gives the same tokens whatever the batching: prefix cache on/off,
chunked prefill on/off, one sequence per step or many, and under preemption.
Finished and aborted requests give every block back."""

from __future__ import annotations

import pytest

from tests.hf_reference import random_prompts
from xllm_py import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(vocab_size):
    base = random_prompts(vocab_size, [5, 19, 33, 48, 70, 12, 2, 40], seed=7)
    shared = base[3][:32]  # several prompts share a 2-block prefix (block_size 16)
    return base + [shared + p for p in random_prompts(vocab_size, [3, 9, 17], seed=8)]


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


def test_prefix_cache_gives_same_tokens_and_hits(tiny_model_dir, prompts, baseline):
    tokens, llm = run(tiny_model_dir, prompts, enable_prefix_cache=True)
    assert tokens == baseline
    # run the shared-prefix prompts again: their full blocks come from the cache
    llm.generate([{"prompt_token_ids": p} for p in prompts[-3:]], GREEDY)
    assert llm.get_stats().prefix_cache_hits > 0


def test_chunked_prefill_gives_same_tokens(tiny_model_dir, prompts, baseline):
    tokens, _ = run(tiny_model_dir, prompts, enable_chunked_prefill=True, max_tokens_per_batch=16)
    assert tokens == baseline


def test_without_chunked_prefill(tiny_model_dir, prompts, baseline):
    tokens, _ = run(tiny_model_dir, prompts, enable_chunked_prefill=False, max_tokens_per_batch=128)
    assert tokens == baseline


@pytest.mark.parametrize("max_seqs", [1, 64])
def test_max_seqs_per_batch(tiny_model_dir, prompts, baseline, max_seqs):
    tokens, _ = run(tiny_model_dir, prompts, max_seqs_per_batch=max_seqs)
    assert tokens == baseline


def test_forced_preemption_finishes_all_with_same_tokens(tiny_model_dir, prompts, baseline):
    # 12 blocks of 16 tokens: the longest request needs 6, the batch needs far more.
    from xllm_py.config import ModelConfig

    m = ModelConfig.from_pretrained(tiny_model_dir)
    block_bytes = m.num_hidden_layers * 16 * m.kv_cache_dim * 4
    tokens, llm = run(tiny_model_dir, prompts, max_cache_size=12 * block_bytes)
    assert llm.engine.core.blocks.num_blocks == 12
    assert llm.get_stats().num_preemptions > 0
    assert tokens == baseline


def test_absorbed_and_expanded_attention_agree(tiny_model_dir, prompts, monkeypatch):
    from xllm_py.worker import attention_layout

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
