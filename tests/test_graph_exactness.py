"""Graph mode's exactness bar at scale (marked `slow`: `make test-slow`): greedy tokens and
logprobs with graphs on vs off, 100 held-out ShareGPT prompts x 24 tokens, float32, the
bundled model with its MTP draft, at batch 1, 8 and 64 with k = 0, 1 and 3 (about 30 min
on 2 cores, most of it compiling the batch-64 graphs; one case takes 1-5 min).

For each case two engines with at most `batch` requests per step: eager, and graph mode
with the one bucket `batch` (so steps with fewer requests left run padded). Every prompt
must give the same tokens, and logprobs within 1e-5, except one known routing tie
(docs/graph_mode.md, "How exact it is"): held-out prompt #49 reaches two expert groups
whose float32 scores are exactly equal at its 17th generated token, and a last-bit
difference in the layer's input can send the tie either way. That prompt must still agree
up to there. The committed run of the script this replaced is
perf/results/graph_exactness.json."""

from __future__ import annotations

import pytest

from xllm_py import LLM, SamplingParams
from xllm_py.sharegpt import held_out_user_turns

PROMPTS, MAX_TOKENS, TOLERANCE = 100, 24, 1e-5
KNOWN_TIES = {49: 16}  # prompt index -> generated tokens that must agree before the tie

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    tok = LLM(dtype="float32").get_tokenizer()
    texts = held_out_user_turns(PROMPTS, 20, 600)
    assert len(texts) == PROMPTS
    return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def decode(llm: LLM, prompts: list[str]) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return [o.token_ids for o in outs], [
        [lp[t] for lp, t in zip(o.logprobs, o.token_ids)] for o in outs
    ]


def graph_steps(llm: LLM) -> int:
    runner = llm.engine.core.executor.worker.runner
    return sum(runner.graphs.steps.values())


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_graph_mode_decodes_what_eager_mode_decodes(prompts, batch, k):
    common = dict(dtype="float32", block_size=16, max_seqs_per_batch=batch)
    eager_tokens, eager_lp = decode(LLM(num_speculative_tokens=k, **common), prompts)
    llm = LLM(num_speculative_tokens=k, enable_graph=True, graph_batch_sizes=[batch], **common)
    tokens, lp = decode(llm, prompts)
    assert graph_steps(llm) > 0
    for i in range(PROMPTS):
        same = KNOWN_TIES.get(i, MAX_TOKENS)
        assert tokens[i][:same] == eager_tokens[i][:same], f"prompt {i}"
        diff = max((abs(a - b) for a, b in zip(lp[i][:same], eager_lp[i][:same])), default=0)
        assert diff <= TOLERANCE, f"prompt {i}: logprobs differ by {diff:.2e}"
