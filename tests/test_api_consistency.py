"""One conversation, three APIs: for 8 held-out ShareGPT prompts (with a system prompt),
greedy output through OpenAI's Responses API and Anthropic's Messages API is token for
token chat completions' (the tokens and their logprobs for Responses, the text and token
count for Messages, which has no logprobs), with MTP off (k = 0) and on (k = 1), and the
k = 1 answers are the k = 0 ones (speculation is lossless through every API)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server_utils import Server
from xllm_py.sharegpt import held_out_user_turns

SYSTEM = "You are a helpful assistant."
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return list(held_out_user_turns(8, 10, 300))


def answers(url: str, prompts: list[str]) -> list[tuple[list[str], str]]:
    """Per prompt: chat's tokens and text, after checking Responses and Messages give the
    same."""
    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    an = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    model = oa.models.list().data[0].id
    out = []
    for p in prompts:
        c = oa.chat.completions.create(
            model=model, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}],
        )  # fmt: skip
        chat_tokens = [t.token for t in c.choices[0].logprobs.content]
        text = c.choices[0].message.content
        r = oa.responses.create(
            model=model, instructions=SYSTEM, input=p, max_output_tokens=MAX_TOKENS,
            temperature=0, include=["message.output_text.logprobs"],
        )  # fmt: skip
        ours = [t.token for item in r.output if item.type == "message"
                for part in item.content for t in part.logprobs]  # fmt: skip
        assert ours == chat_tokens and r.output_text == text, p
        m = an.messages.create(
            model=model, system=SYSTEM, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": p}], extra_body={"temperature": 0},
        )  # fmt: skip
        said = "".join(b.text for b in m.content if b.type == "text")
        assert said == text and m.usage.output_tokens == c.usage.completion_tokens, p
        out.append((chat_tokens, text))
    return out


def test_responses_and_messages_are_chat_token_for_token_with_and_without_mtp(prompts):
    runs = {}
    for k in (0, 1):
        with Server("--dtype=float32", f"--num_speculative_tokens={k}") as s:
            runs[k] = answers(s.url, prompts)
    assert runs[1] == runs[0]
