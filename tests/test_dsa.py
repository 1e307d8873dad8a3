"""DeepSeek-V3.2's sparse attention (DSA) under MTP, batching and cache management.

HF transformers' DeepseekV32ForCausalLM is the reference for the model itself
(test_hf_reference.py, configs `v32_sparse` and `v32_dense_topk`). Here, on a random V3.2
checkpoint with an MTP layer (whose own attention has an indexer) and index_topk 12, so
that every prompt but the shortest attends sparsely:
- the top-k choice matters: the same weights with index_topk above every context give
  other tokens;
- MTP k = 1, 2, 3 give plain decoding's tokens at batch 8 under chunked prefill with the
  prefix cache on (the shared prefixes hit), k = 3 at batch 1, and k = 2 under preemption
  (the indexer keys are recomputed with the latents);
- sampled drafts keep the distribution at T = 1 (chi-square against plain sampling);
- graph mode is refused with V3.2, naming both.
"""

from __future__ import annotations

import json

import pytest

from tests.test_spec_sampling_distribution import assert_same_distribution, draw, engine
from tools.make_random_checkpoint import make_random_checkpoint
from xllm_py import LLM, SamplingParams

DSA = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
       "index_topk": 12, "index_head_dim": 24, "index_n_heads": 4}  # fmt: skip
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
BASE = [list(range(5, 5 + n)) for n in (3, 17, 56, 9, 33, 70)]
PROMPTS = BASE + [BASE[2][:48] + [7, 8, 9], BASE[5][:64] + [300]]  # 3 and 4 shared blocks


def tokens(path, **kw) -> list[list[int]]:
    llm = LLM(model=str(path), dtype="float32", block_size=16, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks  # nothing leaked
    if "max_cache_size" in kw:
        assert llm.get_stats().num_preemptions > 0
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("v32"), overrides=DSA, seed=2)


@pytest.fixture(scope="module")
def baseline(ckpt):
    return tokens(ckpt, enable_prefix_cache=False, max_seqs_per_batch=1)


def test_the_top_k_choice_matters(ckpt, baseline, tmp_path):
    dense = tmp_path / "dense"
    dense.mkdir()
    for f in ckpt.iterdir():
        (dense / f.name).symlink_to(f)
    (dense / "config.json").unlink()
    cfg = json.loads((ckpt / "config.json").read_text()) | {"index_topk": 4096}
    (dense / "config.json").write_text(json.dumps(cfg))
    got = tokens(dense, enable_prefix_cache=False)
    # a query that sees at most 12 tokens attends to all of them either way: the first
    # prompt's first 10 tokens (contexts of 3..12) agree, and then the choice tells
    assert got[0][:10] == baseline[0][:10]
    assert got != baseline


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_is_lossless_at_batch_8_with_chunked_prefill_and_prefix_cache(ckpt, baseline, k):
    got = tokens(ckpt, num_speculative_tokens=k, enable_chunked_prefill=True,
                 max_tokens_per_batch=32)  # fmt: skip
    assert got == baseline


def test_mtp_is_lossless_at_batch_1(ckpt, baseline):
    assert tokens(ckpt, num_speculative_tokens=3, max_seqs_per_batch=1) == baseline


def test_mtp_is_lossless_under_preemption(ckpt, baseline):
    cfg = json.loads((ckpt / "config.json").read_text())
    per_block = 4 * 16 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + DSA["index_head_dim"]) * 4
    assert tokens(ckpt, num_speculative_tokens=2, max_cache_size=14 * per_block) == baseline


def test_graph_mode_is_refused_naming_both(ckpt):
    with pytest.raises(ValueError, match="enable_graph=True with DeepSeek-V3.2's sparse attention"):
        LLM(model=str(ckpt), dtype="float32", enable_graph=True)


def test_sampled_drafts_keep_the_distribution(ckpt):
    """T = 1 with sampled drafts (k = 2) against plain sampling, 2,000 continuations each,
    chi-square per position (test_spec_sampling_distribution.py's test), on a prompt past
    index_topk: the indexer's choice is in every verification row."""
    ids = list(range(5, 38))  # 2 blocks + 1: the other requests prefill one token
    plain = draw(engine(0, seed=1, model=str(ckpt)), ids, "t1.0")
    llm = engine(2, seed=12, model=str(ckpt))
    spec = draw(llm, ids, "t1.0")
    m = llm.get_metrics()
    assert 0 < m.accepted_tokens < m.draft_tokens  # drafts accepted and rejected
    assert_same_distribution(plain, spec, "DeepSeek-V3.2, k=2 vs plain, t1.0")
