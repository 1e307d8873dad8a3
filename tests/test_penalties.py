"""Penalties and logit bias (vLLM's meanings), alone and under MTP.

Against a reference written here from the definitions (presence/frequency over the
output so far, repetition over prompt and output, bias added to the raw logits) on
hand-made logits; then on the bundled model: greedy tokens with each penalty and with a
logit bias are identical for k = 0, 1 and 3 on 16 held-out ShareGPT prompts (the verify
rows must see the drafts before them as output), and they differ from unpenalised
output (the penalties act). The sampled distribution under a penalty is compared,
speculative against plain, in tests/test_spec_sampling_distribution.py."""

from __future__ import annotations

import pytest
import torch

from tests.test_bundled_model import held_out_user_turns
from xllm_py import LLM, SamplingParams
from xllm_py.worker.sampler import LogitAdjust

NUM_PROMPTS = 16  # 24 tokens each: presence and frequency act on 13 of them, the others on all
CASES = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 1.0},
    "repetition": {"repetition_penalty": 1.6},
    "logit_bias": {"logit_bias": {11: 8.0, 13: -100.0, 40: 5.0}},
}


def reference(logits, prompt, outputs, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    x = list(logits)
    for t, b in (bias or {}).items():
        x[t] += b
    for t in range(len(x)):
        if t in prompt or t in outputs:
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
        c = outputs.count(t)
        x[t] -= frequency * c + presence * (c > 0)
    return x


def test_logit_adjust_matches_the_definitions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=g) * 3
    prompt, outputs = [1, 2, 2], [[], [3, 3, 5], [2, 7]]
    params = [(0.5, 0.3, 1.4, {4: 2.0}), (1.0, 0.0, 1.0, None), (0.0, 1.5, 0.7, {3: -1.0})]
    counts = torch.zeros(3, 12)
    for a, o in enumerate(outputs):
        for t in o:
            counts[a, t] += 1
    seen = counts > 0
    seen[:, prompt] = True
    bias = torch.zeros(3, 12)
    for a, (_, _, _, b) in enumerate(params):
        for t, v in (b or {}).items():
            bias[a, t] = v
    adjust = LogitAdjust(
        torch.arange(3), counts, seen,
        torch.tensor([[p[0]] for p in params]), torch.tensor([[p[1]] for p in params]),
        torch.tensor([[p[2]] for p in params]), bias,
    )  # fmt: skip
    got = logits.clone()
    adjust.apply(got)
    for a, (pres, freq, rep, b) in enumerate(params):
        want = reference(logits[a].tolist(), prompt, outputs[a], pres, freq, rep, b)
        assert got[a].tolist() == pytest.approx(want, abs=1e-5)


@pytest.fixture(scope="module")
def engines():
    # a 64 MiB KV cache, 150 blocks: over four times what the 16 prompts hold (left to the
    # engine, each would zero room for 16 full-length requests)
    return {k: LLM(dtype="float32", num_speculative_tokens=k, max_seqs_per_batch=NUM_PROMPTS,
                   max_cache_size=64 << 20) for k in (0, 1, 3)}  # fmt: skip


@pytest.fixture(scope="module")
def prompts(engines):
    tok = engines[0].get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": p}])
            for p in held_out_user_turns(NUM_PROMPTS)]  # fmt: skip


def _tokens(llm, prompts, **kw):
    params = SamplingParams(max_tokens=24, temperature=0.0, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def unpenalised(engines, prompts):
    return _tokens(engines[0], prompts)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_with_penalties_is_identical_for_k_0_1_3(engines, prompts, unpenalised, case):
    plain = _tokens(engines[0], prompts, **CASES[case])
    assert plain != unpenalised, "the penalty changed nothing"
    for k in (1, 3):
        assert _tokens(engines[k], prompts, **CASES[case]) == plain, f"k={k}"
    stats = engines[3].get_metrics()
    assert stats.accepted_tokens > 0  # drafts were accepted, so verify rows saw them
