"""Prefill/decode disaggregation's data plane (xllm_py/pd): prompts prefilled by one
engine, their cache blocks written into another's by Mooncake's transfer engine (TCP on
loopback, peer-to-peer handshake), and the receiving engine decodes exactly as a
colocated one: the same greedy tokens and logprobs (1e-4), and with MTP (k = 2) the same
drafts accepted, so the MTP layer's blocks arrived too. The prefill side prefills in
chunks of 32 tokens (the prompts are longer); the decode side already caches part of one
prompt (a prefix-cache hit: only the rest moves); on a DeepSeek-V3.2 checkpoint the
indexer keys move with the latents. A transfer that never arrived serves nothing; the
compatibility record names what differs."""

from __future__ import annotations

import pytest

from tests.test_dsa import DSA
from tools.make_random_checkpoint import make_random_checkpoint
from xllm_py import LLM, SamplingParams
from xllm_py.pd import transfer
from xllm_py.pd.compat import compat_record, mismatch
from xllm_py.sharegpt import held_out_user_turns

try:
    transfer.transfer_engine_class()
except RuntimeError as e:  # no Mooncake wheel, or no rdma-core (make setup fetches both)
    pytest.skip(str(e), allow_module_level=True)

BLOCK = 16
# Every step drafts k (confidence scheduling off: its choices follow what it has seen, and
# the decode engine here has served a request before the compared ones)
OPTIONS = dict(dtype="float32", block_size=BLOCK, max_cache_size=32 << 20, max_model_len=512,
               speculative_confidence="off")  # fmt: skip
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, ignore_eos=True)
CHUNK = 32  # the prefill side's tokens per step: every prompt here is prefilled in chunks


def engine(k: int = 2, **options) -> LLM:
    return LLM(**(OPTIONS | dict(num_speculative_tokens=k) | options))


def parts(llm: LLM):
    """An offline engine's block manager, worker and KV cache tensors."""
    worker = llm.engine.core.executor.worker
    return llm.engine.core.blocks, worker, worker.runner.kv_caches


def record(llm: LLM):
    _, worker, _ = parts(llm)
    return compat_record(llm.engine.core.config, str(worker.dtype), worker.cache_dims)


def decode(llm: LLM, prompts: list[list[int]]):
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    return [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]


@pytest.fixture(scope="module")
def prompts():
    tok = engine(k=0).get_tokenizer()
    texts = held_out_user_turns(4, 100, 600)  # several blocks of 16 each, and a partial one
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    return str(make_random_checkpoint(tmp_path_factory.mktemp("v32"), overrides=DSA, seed=2))


def move_prompts(prefill: LLM, decode_llm: LLM, prompts) -> tuple[int, int]:
    """What a PD pair does per prompt: the prefill engine computes it (one token), the
    decode engine reserves blocks for its full blocks that it does not cache, the transport
    writes them, the decode engine commits them. Returns (blocks, bytes) moved."""
    src_blocks, _, src_caches = parts(prefill)
    dst_blocks, _, dst_caches = parts(decode_llm)
    a, b = transfer.KVTransport(), transfer.KVTransport()
    a.register(src_caches)
    b.register(dst_caches)
    moved = 0
    try:
        prefill.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1))
        for p in prompts:
            held = dst_blocks.reserve_prefix(src_blocks.prompt_hashes(p))
            assert held is not None
            source = src_blocks.cached_blocks(held.hashes)
            assert source is not None  # still cached on the prefill side
            dst = [t.data_ptr() for t in dst_caches]
            a.write_blocks(b.session_id, src_caches, source, dst, held.block_ids)
            moved += len(held.block_ids)
            dst_blocks.commit_prefix(held)
        return moved, a.bytes_written
    finally:
        a.close()
        b.close()
        assert a.registered_bytes == b.registered_bytes == 0


def check_pd(prompts, k: int, **model):
    colocated = engine(k, **model)
    want = decode(colocated, prompts)
    prefill = engine(k, max_tokens_per_batch=CHUNK, **model)
    decode_llm = engine(k, **model)
    assert mismatch(record(prefill), record(decode_llm)) is None
    manager, worker, _ = parts(decode_llm)
    # the decode side already holds the first prompt's first two blocks
    decode_llm.generate([{"prompt_token_ids": prompts[0][: 2 * BLOCK + 1]}], GREEDY)
    blocks, nbytes = move_prompts(prefill, decode_llm, prompts)
    full = sum((len(p) - 1) // BLOCK for p in prompts)
    assert blocks == full - 2 and nbytes == blocks * worker.bytes_per_block
    hits, before = manager.prefix_hits, decode_llm.get_metrics()
    got = decode(decode_llm, prompts)
    assert manager.prefix_hits - hits == full * BLOCK  # every block found, none recomputed
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-4)
    # the same drafts accepted: the MTP layer's blocks of the prompts arrived too (drafted
    # from zeros instead, the tokens would still be right, the acceptance not)
    m, theirs = decode_llm.get_metrics(), colocated.get_metrics()
    ours = (m.draft_tokens - before.draft_tokens, m.accepted_tokens - before.accepted_tokens)
    assert ours == (theirs.draft_tokens, theirs.accepted_tokens)
    assert ours[1] > 0 or k == 0


@pytest.mark.parametrize("k", [0, 2])
def test_prompts_prefilled_elsewhere_decode_like_colocated(prompts, k):
    check_pd(prompts, k)


def test_deepseek_v32_indexer_keys_move_with_the_latents(v32):
    """index_topk 12: every prompt's later positions attend sparsely, chosen by the moved
    indexer keys (a random checkpoint of 320 tokens: prompts of its own ids)."""
    prompts = [[3 + (7 * i + 11 * j) % 300 for i in range(n)] for j, n in enumerate((41, 58, 75))]
    check_pd(prompts, 2, model=v32)


def test_blocks_that_never_arrived_are_not_served(prompts):
    """A transfer that fails is aborted: its blocks come back unhashed, the prompt is
    computed on the decode side (no prefix-cache hit on garbage)."""
    decode_llm = engine(0)
    manager, _, _ = parts(decode_llm)
    free = manager.num_free_blocks
    held = manager.reserve_prefix(manager.prompt_hashes(prompts[0]))
    assert held is not None and manager.num_free_blocks == free - len(held.block_ids)
    manager.abort_prefix(held)
    assert manager.num_free_blocks == free
    decode(decode_llm, prompts[:1])
    assert manager.prefix_hits == 0


def test_a_mismatch_is_named():
    a, b = record(engine(0)), record(engine(0, block_size=32))
    assert mismatch(a, b) == "block_size: this instance has 16, the peer 32"
    assert mismatch(record(engine(0)), record(engine(1))).startswith(
        "speculative: this instance has 'none', the peer 'mtp'"
    )
