"""DeepSeek-V4 served through the engine (the offline `LLM`), on the tiny checkpoints that HF
transformers saves in test_deepseek_v4.py (sliding / CSA / HCA layers, hash- and
score-routed MoE, hc_mult 2 and 4, compression rates 4 and 8, a window of 8, the indexer
keeping 3), float32, greedy, four ragged prompts long enough that every compressor emits
entries and the indexer chooses among more than it keeps:

- batched (a cold run, no prefix cache): every generated token is HF's greedy one and its
  logprob HF's within 1e-4. HF runs prompt + output once, teacher-forced: equal argmaxes at
  every position are HF's own greedy continuation;
- a prefix-cache hit that ends mid-window (block size 2: the hits end where neither rate
  divides) gives the cold run's tokens, so the compressor state (pending tokens, CSA's
  overlap series, entries) comes back with the cached rows;
- preemption under a tiny KV budget (recomputed, partly from its own cached blocks) and
  chunked prefill (a 7-token budget: chunks end mid-window, prefill chunks share steps
  with decodes) give the cold run's tokens.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.test_deepseek_v4 import CONFIGS, hf_checkpoint
from xllm_py import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
BASE = [[(7 * i + 3 * j) % 90 + 3 for j in range(n)] for i, n in enumerate((5, 29, 17, 40))]
# after BASE in one engine: a repeat (hits 14 blocks of 2 = 28 tokens: mid HCA window) and
# BASE[3]'s first 22 tokens with another tail (hits 22 tokens: mid CSA and HCA windows)
SHARED = [BASE[1], BASE[3][:22] + [5, 6, 7, 8, 9]]


def generate(path, prompts, **kw) -> list:
    llm = LLM(model=str(path), dtype="float32", **{"block_size": 4} | kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks  # nothing leaked
    return llm, [o.outputs[0] for o in outs]


def tokens(outs) -> list[list[int]]:
    return [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, hf_checkpoint(request.param, path)


@pytest.fixture(scope="module")
def cold(checkpoint):
    """BASE then SHARED, one batch, prefix cache off."""
    _, path, _ = checkpoint
    return generate(path, BASE + SHARED, enable_prefix_cache=False)[1]


def test_a_ragged_batch_gives_hf_greedy_tokens_and_logprobs(checkpoint, cold):
    _, _, hf = checkpoint
    for prompt, out in zip(BASE + SHARED, cold):
        ids = list(out.token_ids)
        with torch.no_grad():
            want = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        want = want.log_softmax(dim=-1)
        assert ids == want.argmax(dim=-1).tolist()
        got = torch.tensor([entry[t] for entry, t in zip(out.logprobs, ids)])
        expected = want.gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()


def test_a_prefix_cache_hit_mid_window_gives_the_cold_tokens(checkpoint, cold):
    _, path, _ = checkpoint
    llm, first = generate(path, BASE, block_size=2)
    hits = llm.engine.core.blocks.prefix_hits
    outs = llm.generate([{"prompt_token_ids": p} for p in SHARED], GREEDY)
    assert llm.engine.core.blocks.prefix_hits - hits == 28 + 22
    assert tokens(first) + tokens(o.outputs[0] for o in outs) == tokens(cold)


def test_preemption_gives_the_cold_tokens(checkpoint, cold):
    _, path, _ = checkpoint
    probe = LLM(model=str(path), dtype="float32", block_size=4)
    per_block = probe.engine.core.executor.worker.bytes_per_block
    llm, outs = generate(path, BASE + SHARED, max_cache_size=16 * per_block)
    assert llm.get_stats().num_preemptions > 0
    assert tokens(outs) == tokens(cold)


def test_chunked_prefill_gives_the_cold_tokens(checkpoint, cold):
    _, path, _ = checkpoint
    _, outs = generate(path, BASE + SHARED, enable_chunked_prefill=True, max_tokens_per_batch=7)
    assert tokens(outs) == tokens(cold)


def test_the_checkpoints_draft_module_is_left_unloaded(tmp_path):
    """A V4 release carries its draft module (MTP layers, or the 0731 releases' DSpark
    drafter) as `mtp.*` tensors beside the target's: served without drafts, the target
    loads without them and gives the tokens it gives without the file."""
    name = next(iter(CONFIGS))
    hf_checkpoint(name, tmp_path)
    want = tokens(generate(tmp_path, BASE[:2])[1])
    drafts = {"mtp.0.e_proj.weight": torch.randn(8, 8), "mtp.2.markov_head.markov_w1.weight":
              torch.randn(8, 8), "mtp.0.ffn.experts.0.w1.weight": torch.randn(8, 8)}  # fmt: skip
    save_file(drafts, tmp_path / "model-mtp.safetensors")
    assert tokens(generate(tmp_path, BASE[:2])[1]) == want
