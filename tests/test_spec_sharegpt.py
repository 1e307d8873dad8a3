"""The acceptance bar for MTP speculation on the bundled model: greedy, float32,
100 held-out ShareGPT prompts in batches of 8 and 64 (the first 16 of them one at a
time, batch 1), each of k = 1, 2, 3 and each batch size covered (k = 1 and 3 at batch 1
and 64, k = 2 at batch 8; the hot-vocabulary and adaptive k = 2 at all three): every
prompt's tokens identical to decoding without drafts. The real MTP draft is used (it
agrees with the target ~66% of the time), so accepted runs, rejections and stops inside
runs all occur. The prefix cache is on in the speculative runs, off in the baseline;
second turns of conversations hit the first turns' blocks."""

from __future__ import annotations

import pytest

from tests.test_bundled_model import held_out_user_turns
from tests.test_engine import cached_prefix_tokens, chosen_logprobs
from xllm_py import LLM, SamplingParams

NUM_PROMPTS = 100
# Batch 1 runs the first BATCH_1_PROMPTS only: one request at a time is the slowest form
# (suite time), and its rows are the same whatever the number of prompts.
BATCH_1_PROMPTS = 16
PARAMS = SamplingParams(max_tokens=20, temperature=0.0)  # EOS may land inside an accepted run


@pytest.fixture(scope="module")
def plain():
    """The engine without drafts or prefix cache, shared by the references below."""
    return LLM(dtype="float32", block_size=16, max_seqs_per_batch=64, enable_prefix_cache=False)


@pytest.fixture(scope="module")
def prompts(plain):
    tok = plain.get_tokenizer()
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}])
        for p in held_out_user_turns(NUM_PROMPTS)
    ]
    assert len(texts) == NUM_PROMPTS
    return texts


@pytest.fixture(scope="module")
def baseline(plain, prompts):
    return [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS)]


NUM_CONVERSATIONS = 8
WITH_LOGPROBS = SamplingParams(max_tokens=20, temperature=0.0, logprobs=0)


@pytest.fixture(scope="module")
def second_turns(plain, prompts, baseline):
    """Second turns of NUM_CONVERSATIONS conversations, as token ids: the first turn, its
    reply, EOS, then the user turn of prompt 50 + j. The conversations are the first
    seven prompts and the first whose prompt and reply fill whole blocks (so the block
    holding the reply's last token, which is never computed, is full). Returns the
    conversations, the second turns, and their tokens and logprobs without the prefix cache."""
    llm = plain
    tok = llm.get_tokenizer()
    (eos,) = llm.engine.config.model.eos_token_ids
    bos = tok.config["bos_token"]
    ids = [tok.encode(p) for p in prompts]
    n = NUM_CONVERSATIONS - 1
    aligned = next(i for i in range(n, 50) if (len(ids[i]) + len(baseline[i])) % 16 == 0)
    convs = list(range(n)) + [aligned]
    turns = []
    for j, i in enumerate(convs):
        reply = baseline[i] if baseline[i][-1:] == [eos] else baseline[i] + [eos]
        nxt = "\n" + prompts[50 + j].removeprefix(bos)
        turns.append(ids[i] + reply + tok.encode(nxt, add_special_tokens=False))
    outs = [
        o.outputs[0] for o in llm.generate([{"prompt_token_ids": t} for t in turns], WITH_LOGPROBS)
    ]
    return convs, turns, [o.token_ids for o in outs], [chosen_logprobs(o) for o in outs]


def generate_identical(llm: LLM, prompts, baseline, batch: int) -> None:
    """`llm` (at most `batch` requests a step) decodes the prompts (the first
    BATCH_1_PROMPTS at batch 1) as the baseline does, token for token."""
    n = BATCH_1_PROMPTS if batch == 1 else NUM_PROMPTS
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts[:n], PARAMS)]
    assert len(tokens) == n
    mismatched = [i for i, (a, b) in enumerate(zip(tokens, baseline)) if a != b]
    assert not mismatched, f"{len(mismatched)} of {n} differ, e.g. #{mismatched[0]}"


# each k and each batch size, not every pair: one request at a time (the slowest) and in
# batches of 64 for k = 1 and 3; k = 2 in batches of 8 (and at 1, 8 and 64 with the hot
# vocabulary and adaptively, below)
@pytest.mark.parametrize("k, batch", [(1, 1), (1, 64), (2, 8), (3, 1), (3, 64)])
def test_speculative_output_identical_on_sharegpt(prompts, baseline, batch, k):
    llm = LLM(dtype="float32", block_size=16, max_seqs_per_batch=batch, num_speculative_tokens=k)
    generate_identical(llm, prompts, baseline, batch)
    m = llm.get_metrics()
    assert m.drafts > 0 and 0.3 < m.acceptance_rate <= 1.0  # the MTP head really predicts
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def blocks_at_admission(turns: list[list[int]], k: int) -> int:
    """Blocks of 16 that `turns` take when all are admitted: prompt and k look-ahead slots."""
    return sum(-(-(len(t) + k) // 16) for t in turns)


@pytest.mark.parametrize("variant", ["chunked-prefill", "prefix-cache", "preemption"])
def test_speculative_output_identical_under_batching_variants(
    prompts, baseline, second_turns, variant
):
    """Two waves in one engine, prefix cache on: first turns of conversations, then their
    second turns, which find the first turns' blocks (prompt and reply) in the cache."""
    k = 2
    convs, turns, expected, expected_logprobs = second_turns
    kw = {}
    if variant == "chunked-prefill":
        kw = dict(enable_chunked_prefill=True, max_tokens_per_batch=64)
    elif variant == "preemption":
        # Exactly the blocks the second turns take at admission: the first wave fits (nothing
        # evicted), all second turns are admitted with their hits, then growing preempts.
        num_blocks = blocks_at_admission(turns, k)
        kw = dict(max_cache_size=num_blocks * 9 * 16 * 96 * 4)  # 9 cache layers, float32
    llm = LLM(
        dtype="float32",
        block_size=16,
        max_seqs_per_batch=16,
        num_speculative_tokens=k,
        enable_prefix_cache=True,
        **kw,
    )
    outs = llm.generate([prompts[i] for i in convs], PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == [baseline[i] for i in convs]
    tok = llm.get_tokenizer()
    # all but the last token of each went through the model
    computed = [tok.encode(prompts[i]) + baseline[i][:-1] for i in convs]
    expected_hits = sum(cached_prefix_tokens(t, computed) for t in turns)
    assert expected_hits >= 3 * 16 * len(convs)  # several blocks per conversation
    before = llm.get_stats()
    outs = [
        o.outputs[0] for o in llm.generate([{"prompt_token_ids": t} for t in turns], WITH_LOGPROBS)
    ]
    after = llm.get_stats()
    assert [o.token_ids for o in outs] == expected
    for o, lps in zip(outs, expected_logprobs):
        assert chosen_logprobs(o) == pytest.approx(lps, abs=1e-4)
    assert after.prefix_cache_hits - before.prefix_cache_hits >= expected_hits
    if variant == "preemption":
        assert llm.engine.core.blocks.num_blocks == num_blocks
        assert after.num_preemptions > before.num_preemptions
    m = llm.get_metrics()
    assert m.drafts > 0 and 0.3 < m.acceptance_rate < 1.0  # accepted runs and rejections
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


HOT_VOCAB = 512  # of 8192: the restricted draft head proposes only these tokens


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_hot_vocabulary_drafts_are_lossless_on_sharegpt(prompts, baseline, batch):
    """--speculative_draft_vocab_size: drafts from the bundled token map's 512 most frequent
    target tokens only (speculative/hot_vocab.py); k = 2. Every draft is a hot token, and the
    output is still plain decoding's."""
    llm = LLM(
        dtype="float32",
        block_size=16,
        max_seqs_per_batch=batch,
        num_speculative_tokens=2,
        speculative_draft_vocab_size=HOT_VOCAB,
    )
    proposer = llm.engine.core.executor.worker.runner.proposer
    hot = set(proposer.hot.token_ids.tolist())
    drafted = []
    propose = proposer.propose
    proposer.propose = lambda *a: drafted.append(propose(*a)) or drafted[-1]
    generate_identical(llm, prompts, baseline, batch)
    flat = [t for drafts, _ in drafted for d in drafts for t in d]
    assert len(hot) == HOT_VOCAB and flat and set(flat) <= hot
    assert 0.3 < llm.get_metrics().acceptance_rate < 1.0


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_adaptive_speculation_is_lossless_on_sharegpt(prompts, baseline, batch):
    """--speculative_adaptive with up to 2 hot-vocabulary drafts: each step carries the k
    the controller picked (every k is tried at every batch size it sees), and the output
    is still plain decoding's."""
    llm = LLM(
        dtype="float32",
        block_size=16,
        max_seqs_per_batch=batch,
        num_speculative_tokens=2,
        speculative_draft_vocab_size=HOT_VOCAB,
        speculative_adaptive=True,
    )
    generate_identical(llm, prompts, baseline, batch)
    spec = llm.get_stats().spec
    assert all(n > 0 for n in spec.steps_by_k), spec.steps_by_k  # k = 0, 1 and 2 all ran
    assert 0.3 < llm.get_metrics().acceptance_rate < 1.0


SEEDED = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def seeded_plain(prompts):
    """The first 16 prompts, sampled as SEEDED without drafts (8 a step): texts and tokens."""
    texts = prompts[:16]
    plain = LLM(dtype="float32", block_size=16, max_seqs_per_batch=8)
    return texts, [o.outputs[0].token_ids for o in plain.generate(texts, SEEDED)]


@pytest.mark.parametrize("kw", [{"num_speculative_tokens": 1}, {"num_speculative_tokens": 3},
                                {"num_speculative_tokens": 2, "speculative_adaptive": True}],
                         ids=["k1", "k3", "adaptive"])  # fmt: skip
def test_seeded_sampling_emits_what_plain_sampling_emits(seeded_plain, kw):
    """A seeded sampled request gives the same tokens with drafts as without: verification
    couples each draft with the token plain sampling draws from the same noise
    (worker/rejection_sampler.py), so neither k nor adaptive changes of k show."""
    texts, expected = seeded_plain
    llm = LLM(dtype="float32", block_size=16, max_seqs_per_batch=8, **kw)
    tokens = [o.outputs[0].token_ids for o in llm.generate(texts, SEEDED)]
    assert tokens == expected
    m = llm.get_metrics()
    assert m.accepted_tokens > 0 and m.accepted_tokens < m.draft_tokens  # kept and missed drafts
