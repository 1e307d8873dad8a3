"""DeepSeek-R1's reasoning split (`--reasoning_parser=deepseek_r1`): fixtures written from
R1's documented output (`<think>\\n...\\n</think>\\n\\nanswer`, the opening tag in the
prompt from R1-0528 on), whole and streamed in every way the text can be cut; and the
daemon's chat answers, streamed and not."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server_utils import Server
from xllm_py.entrypoints.reasoning import StreamSplitter, split

FIXTURES = [
    # (output text, reasoning_content, content)
    ("<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "\n\nHello!"),
    ("Let me add 2 and 2: 4.\n</think>\n\nThe answer is 4.", "Let me add 2 and 2: 4.\n",
     "\n\nThe answer is 4."),  # the template opened <think> in the prompt
    ("<think>\nStill thinking when max_tokens ran out", "\nStill thinking when max_tokens ran out",
     None),
    ("<think></think>Direct answer.", "", "Direct answer."),
    ("x < y and a </ b, then </think>done", "x < y and a </ b, then ", "done"),
    ("Thinking only.</think>", "Thinking only.", None),
    ("<thin", "<thin", None),  # not the tag: ends as it is
]  # fmt: skip


@pytest.mark.parametrize("text, reasoning, content", FIXTURES)
def test_whole_output_splits(text, reasoning, content):
    assert split(text) == (reasoning, content)


def stream(pieces: list[str]) -> tuple[str, str]:
    s, r, c = StreamSplitter(), "", ""
    for n, piece in enumerate(pieces):
        dr, dc = s.feed(piece, final=n == len(pieces) - 1)
        r, c = r + dr, c + dc
    return r, c


@pytest.mark.parametrize("text, reasoning, content", FIXTURES)
def test_streamed_output_splits_the_same_however_it_is_cut(text, reasoning, content):
    want = (reasoning or "", content or "")
    assert stream([text]) == want
    assert stream(list(text)) == want  # one character at a time: tags split everywhere
    for cut in range(1, len(text)):
        assert stream([text[:cut], text[cut:]]) == want, cut
    assert stream(list(text) + [""]) == want  # a last, empty delta (a finish chunk)


def test_nothing_is_held_back_once_it_cannot_be_a_tag():
    s = StreamSplitter()
    assert s.feed("<thi") == ("", "")  # could still be <think>
    assert s.feed("s is") == ("<this is", "")
    assert s.feed(" fine </th") == (" fine ", "")  # could still be </think>
    assert s.feed("ink>ok") == ("", "ok")
    assert s.feed(" more") == ("", " more")


@pytest.fixture(scope="module")
def server():
    with Server(
        "--dtype=float32", "--num_speculative_tokens=1", "--reasoning_parser=deepseek_r1"
    ) as s:
        yield s


def test_chat_answers_carry_reasoning_content(server):
    """The bundled model never closes a <think>, so its whole answer is reasoning: the
    text it gives without the parser, in reasoning_content, and no content."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    text = httpx.post(
        server.url + "/v1/completions",
        json={
            "prompt": httpx.post(server.url + "/tokenize", json={"messages": body["messages"]},
                                 timeout=60).json()["tokens"],
            "max_tokens": 12, "temperature": 0,
        },
        timeout=60,
    ).json()["choices"][0]["text"]  # fmt: skip
    message = r["choices"][0]["message"]
    assert message["reasoning_content"] == text and message["content"] is None
    streamed = httpx.post(
        server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    )
    deltas = [
        json.loads(line[6:])["choices"][0]["delta"]
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == text
    assert not any(d.get("content") for d in deltas)
    # a response_format applies to the answer only: the reasoning is what it was without
    constrained = httpx.post(
        server.url + "/v1/chat/completions",
        json={**body, "response_format": {"type": "json_object"}},
        timeout=60,
    ).json()["choices"][0]["message"]
    assert constrained["reasoning_content"] == text and constrained["content"] is None
