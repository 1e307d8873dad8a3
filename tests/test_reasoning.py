"""The reasoning split (`--reasoning_parser`): fixtures written from DeepSeek-R1's
documented output (`<think>\\n...\\n</think>\\n\\nanswer`, the opening tag in the prompt
from R1-0528 on), DeepSeek-V3.1's hybrid thinking (`deepseek_v3`: split only when the
request's chat_template_kwargs turn thinking on) and Kimi-K2-Thinking's (`kimi_k2`: like R1,
and a section of tool calls also ends the thinking), each whole and streamed in every way
the text can be cut; which requests think; and the daemon's chat answers, streamed and
not."""

from __future__ import annotations

import json

import pytest

from tests.server_utils import HTTP, Server
from xllm_py.formats.reasoning import (
    KIMI_TOOLS,
    StreamSplitter,
    split,
    splitter_for,
    thinks,
)

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


def stream(pieces: list[str], **kw) -> tuple[str, str]:
    s, r, c = StreamSplitter(**kw), "", ""
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


# ---- DeepSeek-V3.1's hybrid thinking and Kimi-K2-Thinking -------------------------------------

SECTION = KIMI_TOOLS + "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
KIMI_FIXTURES = [
    # (output text, reasoning_content, content): thinking on, Kimi's tool section ends it
    ("<think>The user greets me.</think>Hello!", "The user greets me.", "Hello!"),
    ("<think>I need f." + SECTION, "I need f.", SECTION),  # calls before </think>
    ("<think>I need f.</think>" + SECTION, "I need f.", SECTION),
    (SECTION, "", SECTION),
    ("<think>x <|tool and </thi, then</think>done", "x <|tool and </thi, then", "done"),
    ("<think>cut short", "cut short", None),
    ("<|tool_calls_sec", "<|tool_calls_sec", None),
]
V31_FIXTURES = [  # thinking on: V3.1's template opened <think> in the prompt
    ("The user greets me.</think>Hello!", "The user greets me.", "Hello!"),
    ("Still thinking", "Still thinking", None),
    ("</think>Straight to it.", "", "Straight to it."),
]


@pytest.mark.parametrize(
    "kw, text, reasoning, content",
    [({"tools_begin": KIMI_TOOLS}, *f) for f in KIMI_FIXTURES] + [({}, *f) for f in V31_FIXTURES],
)
def test_thinking_outputs_split_the_same_whole_and_streamed(kw, text, reasoning, content):
    assert split(text, **kw) == (reasoning, content)
    want = (reasoning or "", content or "")
    assert stream(list(text), **kw) == want
    for cut in range(1, len(text)):
        assert stream([text[:cut], text[cut:]], **kw) == want, cut


@pytest.mark.parametrize("text", [t for t, _, _ in FIXTURES + KIMI_FIXTURES + V31_FIXTURES])
def test_an_answer_that_does_not_think_is_all_content(text):
    """V3.1 without thinking (its template closed the thinking in the prompt), or Kimi
    with thinking false: no split, whatever tags the text holds."""
    for kw in ({}, {"tools_begin": KIMI_TOOLS}):
        assert split(text, thinking=False, **kw) == (None, text)
        assert stream(list(text), thinking=False, **kw) == ("", text)


def test_r1_keeps_a_tool_section_in_its_thinking_kimi_does_not():
    """Why kimi_k2 is not an alias of deepseek_r1: Kimi-K2-Thinking may call tools before
    it closes its thinking, and those calls must reach the tool-call reader."""
    text = "<think>I need f." + SECTION
    assert split(text) == ("I need f." + SECTION, None)
    assert split(text, tools_begin=KIMI_TOOLS) == ("I need f.", SECTION)


@pytest.mark.parametrize(
    "kwargs, r1, v3, kimi",
    [
        (None, True, False, True),
        ({}, True, False, True),
        ({"thinking": True}, True, True, True),
        ({"enable_thinking": True}, True, True, True),
        ({"thinking": False}, True, False, False),
        ({"enable_thinking": False}, True, False, False),
        ({"thinking": 1, "other": 0}, True, True, True),
        ({"thinking": True, "enable_thinking": False}, True, True, False),
        ({"other": True}, True, False, True),
    ],
)
def test_which_requests_think(kwargs, r1, v3, kimi):
    """From the request's chat_template_kwargs, as the chat templates read them."""
    assert thinks("deepseek_r1", kwargs) is r1
    assert thinks("deepseek_v3", kwargs) is v3
    assert thinks("kimi_k2", kwargs) is kimi


def test_splitter_for_each_parser():
    text = "<think>a" + SECTION
    for parser, kwargs, want in [
        ("deepseek_r1", None, ("a" + SECTION, "")),
        ("deepseek_v3", None, ("", text)),
        ("deepseek_v3", {"thinking": True}, ("a" + SECTION, "")),
        ("kimi_k2", None, ("a", SECTION)),
        ("kimi_k2", {"thinking": False}, ("", text)),
    ]:
        assert splitter_for(parser, kwargs).feed(text, final=True) == want, (parser, kwargs)


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
    r = HTTP.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    text = HTTP.post(
        server.url + "/v1/completions",
        json={
            "prompt": HTTP.post(server.url + "/tokenize", json={"messages": body["messages"]},
                                 timeout=60).json()["tokens"],
            "max_tokens": 12, "temperature": 0,
        },
        timeout=60,
    ).json()["choices"][0]["text"]  # fmt: skip
    message = r["choices"][0]["message"]
    assert message["reasoning_content"] == text and message["content"] is None
    streamed = HTTP.post(
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
    constrained = HTTP.post(
        server.url + "/v1/chat/completions",
        json={**body, "response_format": {"type": "json_object"}},
        timeout=60,
    ).json()["choices"][0]["message"]
    assert constrained["reasoning_content"] == text and constrained["content"] is None
