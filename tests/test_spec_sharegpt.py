"""The acceptance bar for MTP speculation on the bundled model: greedy, float32,
100 held-out ShareGPT prompts, batch sizes 1, 8 and 64, k = 1, 2, 3: every
prompt's tokens identical to decoding without drafts. The real MTP draft is used
(it agrees with the target ~66% of the time), so accepted runs, rejections and
stops inside runs all occur."""

from __future__ import annotations

import pytest

from tests.test_bundled_model import held_out_user_turns
from xllm_py import LLM, SamplingParams

NUM_PROMPTS = 100
PARAMS = SamplingParams(max_tokens=20, temperature=0.0)  # EOS may land inside an accepted run


@pytest.fixture(scope="module")
def prompts():
    llm = LLM(dtype="float32", block_size=16)
    tok = llm.get_tokenizer()
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}])
        for p in held_out_user_turns(NUM_PROMPTS)
    ]
    assert len(texts) == NUM_PROMPTS
    return texts


@pytest.fixture(scope="module")
def baseline(prompts):
    llm = LLM(dtype="float32", block_size=16, max_seqs_per_batch=64)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_output_identical_on_sharegpt(prompts, baseline, batch, k):
    llm = LLM(dtype="float32", block_size=16, max_seqs_per_batch=batch, num_speculative_tokens=k)
    outs = llm.generate(prompts, PARAMS)
    tokens = [o.outputs[0].token_ids for o in outs]
    mismatched = [i for i, (a, b) in enumerate(zip(tokens, baseline)) if a != b]
    assert not mismatched, (
        f"{len(mismatched)} of {NUM_PROMPTS} prompts differ, e.g. #{mismatched[0]}"
    )
    m = llm.get_metrics()
    assert m.drafts > 0 and 0.3 < m.acceptance_rate <= 1.0  # the MTP head really predicts
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


@pytest.mark.parametrize(
    "kw",
    [
        dict(enable_chunked_prefill=True, max_tokens_per_batch=64),
        dict(enable_prefix_cache=True),
        dict(max_cache_size=40 * 9 * 16 * 96 * 4),  # 40 blocks of 16 for 9 cache layers
    ],
    ids=["chunked-prefill", "prefix-cache", "preemption"],
)
def test_speculative_output_identical_under_batching_variants(prompts, baseline, kw):
    n = 24  # shared chat-template prefix: prefix-cache hits happen
    llm = LLM(dtype="float32", block_size=16, max_seqs_per_batch=16, num_speculative_tokens=2, **kw)
    for _ in range(2 if kw.get("enable_prefix_cache") else 1):  # 2nd pass: cached prompts
        outs = llm.generate(prompts[:n], PARAMS)
        assert [o.outputs[0].token_ids for o in outs] == baseline[:n]
    st = llm.get_stats()
    if "max_cache_size" in kw:
        assert st.num_preemptions > 0
    if kw.get("enable_prefix_cache"):
        assert st.prefix_cache_hits > 0
