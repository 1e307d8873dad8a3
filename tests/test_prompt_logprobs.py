"""Prompt logprobs (vLLM's `prompt_logprobs`, what `echo` with `logprobs` and lm-eval's
loglikelihood tasks read) against HF transformers' own forward, computed in chunks, under
chunked prefill, prefix-cache hits, preemption and MTP; and `max_tokens=0`, which scores
a prompt as long as the whole context."""

from __future__ import annotations

import pytest
import torch

from tests.hf_reference import random_prompts
from tests.test_engine import block_bytes
from tools.make_random_checkpoint import make_random_checkpoint
from xllm_py import LLM, SamplingParams
from xllm_py.worker import model_runner

TOP = 3
SCORE = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=TOP)


def hf_prompt_logprobs(model_dir, prompts) -> list[torch.Tensor]:
    """log_softmax of HF's logits at every prompt position: [len - 1, vocab] per prompt
    (row p scores token p + 1)."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    with torch.inference_mode():
        return [
            torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), dim=-1)
            for p in prompts
        ]


def score(model_dir, prompts, params=SCORE, **kw):
    llm = LLM(model=str(model_dir), dtype="float32", block_size=16, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks  # nothing leaked
    return outs, llm


@pytest.fixture(scope="module")
def prompts(vocab_size):
    return random_prompts(vocab_size, [1, 2, 17, 40, 75, 33], seed=11)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts):
    return hf_prompt_logprobs(tiny_model_dir, prompts)


def check_against(outs, prompts, reference, top=TOP):
    for out, p, ref in zip(outs, prompts, reference):
        lps, ranks = out.prompt_logprobs, out.prompt_ranks
        assert len(lps) == len(p) and lps[0] is None
        assert len(ranks) == len(p) - 1
        for pos in range(1, len(p)):
            entry, row, token = lps[pos], ref[pos - 1], p[pos]
            assert list(entry)[0] == token  # the prompt's own token first
            assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
            assert ranks[pos - 1] == 1 + int((row > row[token]).sum())
            top_ids = row.topk(top).indices.tolist()
            assert set(entry) == {token, *top_ids}
            for t in top_ids:
                assert entry[t] == pytest.approx(row[t].item(), abs=1e-4)


def test_prompt_logprobs_equal_hf_in_chunks(tiny_model_dir, prompts, reference, monkeypatch):
    """Prompts split over steps (chunked prefill, 24 tokens a step) and each step's rows
    scored 5 at a time: every position against HF's full forward."""
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 5)
    outs, _ = score(tiny_model_dir, prompts, max_tokens_per_batch=24)
    for out in outs:
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    check_against(outs, prompts, reference)


def test_prompt_logprobs_beside_generation(tiny_model_dir, prompts, reference):
    """Scoring the prompt changes nothing about the output; requests that did not ask get
    none."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain, _ = score(tiny_model_dir, prompts, greedy)
    both = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    outs, _ = score(tiny_model_dir, prompts, both)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)
    check_against(outs, prompts, reference)


def test_prefix_cache_hits_do_not_skip_positions(tiny_model_dir, prompts, reference):
    """The second identical prompt could take its first blocks from the prefix cache; with
    prompt_logprobs it computes them, so no position is missing."""
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=16)
    long = prompts[4]  # 75 tokens: 4 full blocks
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": long}], plain)
    hits = llm.get_stats().prefix_cache_hits
    first = llm.generate([{"prompt_token_ids": long}], SCORE)[0]
    assert llm.get_stats().prefix_cache_hits == hits  # it did not use the cached blocks
    check_against([first], [long], [reference[4]])
    llm.generate([{"prompt_token_ids": long}], plain)
    assert llm.get_stats().prefix_cache_hits > hits  # while the cache serves others


def test_preemption_recomputes_without_repeating(tiny_model_dir, prompts, reference):
    """A 12-block cache preempts requests mid-prompt and mid-output; positions a
    recomputation scores again are not handed out twice."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    outs, llm = score(
        tiny_model_dir,
        prompts * 2,
        params,
        max_cache_size=12 * block_bytes(tiny_model_dir),
        max_tokens_per_batch=24,
    )
    assert llm.get_stats().num_preemptions > 0
    check_against(outs, prompts * 2, reference * 2)


def test_max_tokens_zero_scores_a_prompt_of_the_whole_context(tiny_model_dir, vocab_size):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=16, max_model_len=64)
    full, over = random_prompts(vocab_size, [64, 65], seed=5)
    out = llm.generate([{"prompt_token_ids": full}], SCORE)[0]
    assert len(out.prompt_logprobs) == 64 and out.outputs[0].token_ids == []
    with pytest.raises(ValueError, match="prompt: 65 tokens exceed the model's context of 64"):
        llm.generate([{"prompt_token_ids": over}], SCORE)
    with pytest.raises(ValueError, match="prompt: 64 tokens leave no room"):
        llm.generate([{"prompt_token_ids": full}], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="prompt_logprobs=-1: must be >= 0"):
        SamplingParams(prompt_logprobs=-1)


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("mtp"), seed=1)


def test_identical_with_mtp_on_and_off(mtp_ckpt):
    """The draft never touches the target's prompt rows: prompt logprobs, and the output
    beside them, are the same for k = 0, 1 and 3, including a prompt of the whole context
    (the MTP layer then runs at the context's last position)."""
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 56, 9, 2, 33)] + [
        [(7 * i) % 300 + 2 for i in range(64)]
    ]
    params = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=TOP)
    runs = {}
    for k in (0, 1, 3):
        outs, _ = score(mtp_ckpt, prompts, params, num_speculative_tokens=k, max_model_len=64)
        runs[k] = [(o.prompt_logprobs, o.prompt_ranks) for o in outs]
        assert [len(o.prompt_logprobs) for o in outs] == [len(p) for p in prompts]
    assert runs[1] == runs[0] and runs[3] == runs[0]
