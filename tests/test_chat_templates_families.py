"""Chat templates of the served families render as HF transformers renders them.

The templates (tests/fixtures/chat_templates/) are written for these tests from what
each model's published template renders: DeepSeek-V3 / R1 (`deepseek_v3.jinja`, the
V3-0324 layout), DeepSeek-V3.1 with its hybrid thinking (`deepseek_v31.jinja`),
Kimi-K2-Instruct (`kimi_k2.jinja`) and Kimi-K2-Thinking (`kimi_k2_thinking.jinja`).
Each is served from a checkpoint directory laid out as its family ships it: DeepSeek's
template in tokenizer_config.json, Kimi's in chat_template.jinja.

- Our renderer (engine/tokenizer.py) equals HF's `apply_chat_template` on every
  template, over conversations with system prompts, several turns, tool calls (with and
  without text before them), tool results, reasoning given as a field or inline,
  tools declared or not, each with and without the generation prompt and with V3.1's
  `thinking` / `enable_thinking` on and off; template errors are the same errors.
- Golden strings, written by hand from the published formats, pin each template.
- The V3 template agrees with DeepSeek-V3's and R1's own template text
  (tests/fixtures/*_chat_template.jinja) on plain chats.
- Round trip: an assistant turn with calls, as the template writes it after the
  generation prompt, parses back (tool_parser.py under `deepseek_v3`, `deepseek_v31`,
  `kimi_k2`) into the same calls, and those calls, sent back as the next request's
  history, render the same text; Kimi's `functions.NAME:IDX` ids survive as the call ids
  and as the tool results' `tool_call_id`; Kimi-K2-Thinking's reasoning comes back
  through the reasoning split.
- Where HF finds a template and which one: chat_template.jinja over the config's,
  named templates ("tool_use" with tools, else "default"), HF's `{% generation %}` tag
  and its namespace that refuses `_` attributes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from xllm_py.assets import BUNDLED_MODEL_DIR
from xllm_py.engine.tokenizer import ChatTemplateRefused, Tokenizer
from xllm_py.formats import reasoning
from xllm_py.formats.tool_parser import parse

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TEMPLATES = FIXTURES / "chat_templates"

DEEPSEEK_TOKENS = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
KIMI_TOKENS = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]"}
# template -> (special tokens, where the family ships its template, tool-call parser)
FAMILIES = {
    "deepseek_v3": (DEEPSEEK_TOKENS, "config", "deepseek_v3"),
    "deepseek_v31": (DEEPSEEK_TOKENS, "config", "deepseek_v31"),
    "kimi_k2": (KIMI_TOKENS, "file", "kimi_k2"),
    "kimi_k2_thinking": (KIMI_TOKENS, "file", "kimi_k2"),
}
DEEPSEEK = ("deepseek_v3", "deepseek_v31")


def checkpoint(root: Path, special: dict, template: str | None = None, **files: str) -> Path:
    """A tokenizer directory: the bundled tokenizer.json, a config with `special` tokens
    (and `template` as its chat_template), and `files` ({relative path: text})."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(BUNDLED_MODEL_DIR / "tokenizer.json", root / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    if template is not None:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    """name -> (our tokenizer, HF's), both loaded from the same directory."""
    out = {}
    for name, (special, where, _) in FAMILIES.items():
        text = (TEMPLATES / f"{name}.jinja").read_text()
        root = tmp_path_factory.mktemp(name)
        if where == "config":
            path = checkpoint(root, special, text)
        else:
            path = checkpoint(root, special, **{"chat_template.jinja": text})
        out[name] = (Tokenizer.from_dir(path), hf_tokenizer(path))
    return out


def render(tok, conv, gen=True, tools=None, **kw) -> str:
    return tok.apply_chat_template(conv, add_generation_prompt=gen, tools=tools, **kw)


def hf_render(hf, conv, gen=True, tools=None, **kw) -> str:
    return hf.apply_chat_template(
        conv, tools=tools, tokenize=False, add_generation_prompt=gen, **kw
    )


def rendered_or_error(fn, *args, **kw) -> str:
    try:
        return fn(*args, **kw)
    except Exception as e:  # the template's own error: the same type and text for both
        return f"error {type(e).__name__}: {e}"


# ---- conversations ---------------------------------------------------------------------------


def call(call_id: str, name: str, args: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


WEATHER_ARGS, TIME_ARGS = '{"city": "Paris"}', '{"timezone": "CET"}'
# Kimi-K2's own ids; DeepSeek's templates do not render ids
CALL_A = call("functions.get_weather:0", "get_weather", WEATHER_ARGS)
CALL_B = call("functions.get_time:1", "get_time", TIME_ARGS)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a timezone, e.g. 'CET' or \"UTC\"",
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
        },
    },
]
SYSTEM = {"role": "system", "content": "Be brief."}
QUESTION = {"role": "user", "content": "Weather in Paris, and the time?"}
CALLS_TURN = {"role": "assistant", "content": "", "tool_calls": [CALL_A, CALL_B]}
RESULTS = [
    {"role": "tool", "tool_call_id": CALL_A["id"], "content": "21 C, sunny"},
    {"role": "tool", "tool_call_id": CALL_B["id"], "content": "14:05"},
]
ANSWER = {"role": "assistant", "content": "21 C and sunny; it is 14:05."}
CONVERSATIONS = {
    "one user turn": [QUESTION],
    "two system prompts": [SYSTEM, {"role": "system", "content": "Be kind."}, QUESTION],
    "several turns": [
        SYSTEM,
        {"role": "user", "content": "Hi <there> & {{ you }}"},
        {"role": "assistant", "content": "Hello."},
        QUESTION,
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ],
    "calls": [QUESTION, CALLS_TURN],
    "text before a call": [
        QUESTION,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL_A]},
    ],
    "results last": [QUESTION, CALLS_TURN, *RESULTS],
    "whole exchange": [SYSTEM, QUESTION, CALLS_TURN, *RESULTS, ANSWER, QUESTION],
    "result named after its function": [
        QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [CALL_A]},
        {**RESULTS[0], "name": "get_weather"},
    ],
    "arguments as an object": [
        QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    **CALL_A,
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Paris", "days": [1, 2]},
                    },
                }
            ],
        },
    ],
    "reasoning as a field": [
        QUESTION,
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
        {"role": "user", "content": "And the time?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL_B], "reasoning": "Call."},
        RESULTS[1],
    ],
    "reasoning inline": [
        QUESTION,
        {"role": "assistant", "content": "<think>Look it up.</think>Sunny."},
        {"role": "user", "content": "Thanks"},
    ],
    "a prefix to continue": [QUESTION, {"role": "assistant", "content": "Su", "prefix": True}],
    "calls without content": [
        QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [CALL_A]},
    ],
    "content in parts": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
}
TEMPLATE_KWARGS = [{}, {"thinking": True}, {"thinking": False}, {"enable_thinking": True}]


# ---- our renderer against HF's -----------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_renders_as_transformers_renders_it(families, name):
    ours, hf = families[name]
    results = {}
    for label, conv in CONVERSATIONS.items():
        for gen in (True, False):
            for tools in (None, TOOLS):
                for kw in TEMPLATE_KWARGS:
                    want = rendered_or_error(hf_render, hf, conv, gen, tools, **kw)
                    got = rendered_or_error(render, ours, conv, gen, tools, **kw)
                    assert got == want, (name, label, gen, tools is not None, kw)
                    results[label, gen, tools is not None, json.dumps(kw)] = want
    failed = {label for (label, *_), r in results.items() if r.startswith("error")}
    if name in DEEPSEEK:
        # their text is joined with `+`: a turn of calls with no content (transformers
        # drops a content of None), content in parts and arguments that are not a string
        # are errors, in HF's and ours
        assert failed == {"calls without content", "content in parts", "arguments as an object"}
    else:
        assert failed == set()
    assert len(set(results.values())) >= len(CONVERSATIONS)  # the cases render differently


def test_v31_thinking_switches_as_published(families):
    ours, _ = families["deepseek_v31"]
    conv = CONVERSATIONS["several turns"]
    off = render(ours, conv)
    assert off.endswith("<｜User｜>Thanks<｜Assistant｜></think>")
    for on in ({"thinking": True}, {"enable_thinking": True}, {"thinking": 1}):
        assert render(ours, conv, **on) == off.removesuffix("</think>") + "<think>"
    assert render(ours, conv, thinking=False, enable_thinking=True) == off  # thinking wins
    # earlier turns are rendered as answers without thinking either way
    assert "<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜>" in render(ours, conv, thinking=True)
    # `tools` are not part of V3.1's template (the model card has them described in the
    # system prompt by the caller)
    assert render(ours, conv, tools=TOOLS) == off


# ---- golden strings ----------------------------------------------------------------------------

BOS, EOS = DEEPSEEK_TOKENS["bos_token"], DEEPSEEK_TOKENS["eos_token"]
KIMI_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"  # noqa: E501
V3_WEATHER = (
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜>'
)
V3_TIME = (
    '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"timezone": "CET"}\n'
    "```<｜tool▁call▁end｜>"
)
V31_CALLS = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
    '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"timezone": "CET"}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
KIMI_CALLS = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_call_begin|>functions.get_time:1"
    '<|tool_call_argument_begin|>{"timezone": "CET"}<|tool_call_end|><|tool_calls_section_end|>'
)
KIMI_RESULTS = (
    "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n21 C, sunny<|im_end|>"
    "<|im_system|>tool<|im_middle|>## Return of functions.get_time:1\n14:05<|im_end|>"
)
Q = "Weather in Paris, and the time?"

# (template, conversation, add_generation_prompt, template kwargs, with TOOLS, rendered)
GOLDEN = [
    (
        "deepseek_v3", "several turns", True, {}, False,
        f"{BOS}Be brief.<｜User｜>Hi <there> & {{{{ you }}}}<｜Assistant｜>Hello.{EOS}"
        f"<｜User｜>{Q}<｜Assistant｜>Sunny.{EOS}<｜User｜>Thanks<｜Assistant｜>",
    ),
    (
        "deepseek_v3", "two system prompts", True, {}, True,
        f"{BOS}Be brief.\n\nBe kind.<｜User｜>{Q}<｜Assistant｜>",
    ),
    (
        "deepseek_v3", "whole exchange", False, {}, False,
        f"{BOS}Be brief.<｜User｜>{Q}<｜Assistant｜><｜tool▁calls▁begin｜>{V3_WEATHER}\n{V3_TIME}"
        f"<｜tool▁calls▁end｜>{EOS}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>21 C, sunny"
        "<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>14:05<｜tool▁output▁end｜>"
        f"<｜tool▁outputs▁end｜>21 C and sunny; it is 14:05.{EOS}<｜User｜>{Q}<｜Assistant｜>",
    ),
    (   # after tool results the answer follows them directly: no generation prompt
        "deepseek_v3", "results last", True, {}, False,
        f"{BOS}<｜User｜>{Q}<｜Assistant｜><｜tool▁calls▁begin｜>{V3_WEATHER}\n{V3_TIME}"
        f"<｜tool▁calls▁end｜>{EOS}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>21 C, sunny"
        "<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>14:05<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>",
    ),
    (
        "deepseek_v3", "text before a call", False, {}, False,
        f"{BOS}<｜User｜>{Q}<｜Assistant｜>Let me look.<｜tool▁calls▁begin｜>{V3_WEATHER}"
        f"<｜tool▁calls▁end｜>{EOS}",
    ),
    (
        "deepseek_v31", "several turns", True, {}, False,
        f"{BOS}Be brief.<｜User｜>Hi <there> & {{{{ you }}}}<｜Assistant｜></think>Hello.{EOS}"
        f"<｜User｜>{Q}<｜Assistant｜></think>Sunny.{EOS}<｜User｜>Thanks<｜Assistant｜></think>",
    ),
    (
        "deepseek_v31", "reasoning inline", True, {"thinking": True}, False,
        f"{BOS}<｜User｜>{Q}<｜Assistant｜></think>Sunny.{EOS}<｜User｜>Thanks<｜Assistant｜><think>",
    ),
    (
        "deepseek_v31", "whole exchange", True, {"thinking": True}, True,
        f"{BOS}Be brief.<｜User｜>{Q}<｜Assistant｜></think>{V31_CALLS}{EOS}"
        "<｜tool▁output▁begin｜>21 C, sunny<｜tool▁output▁end｜>"
        "<｜tool▁output▁begin｜>14:05<｜tool▁output▁end｜>"
        f"21 C and sunny; it is 14:05.{EOS}<｜User｜>{Q}<｜Assistant｜><think>",
    ),
    (
        "deepseek_v31", "results last", True, {"thinking": True}, False,
        f"{BOS}<｜User｜>{Q}<｜Assistant｜></think>{V31_CALLS}{EOS}"
        "<｜tool▁output▁begin｜>21 C, sunny<｜tool▁output▁end｜>"
        "<｜tool▁output▁begin｜>14:05<｜tool▁output▁end｜>",
    ),
    (
        "deepseek_v31", "a prefix to continue", False, {"thinking": True}, False,
        f"{BOS}<｜User｜>{Q}<｜Assistant｜><think>Su{EOS}",
    ),
    (
        "kimi_k2", "one user turn", True, {}, False,
        f"{KIMI_SYSTEM}<|im_user|>user<|im_middle|>{Q}<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>",
    ),
    (
        "kimi_k2", "whole exchange", True, {}, True,
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":'
        '"get_weather","description":"Weather in a city","parameters":{"type":"object",'
        '"properties":{"city":{"type":"string"}},"required":["city"]}}},{"type":"function",'
        '"function":{"name":"get_time","description":"Time in a timezone, e.g. \'CET\' or '
        '\\"UTC\\"","parameters":{"type":"object","properties":{"timezone":{"type":"string"}}}}}]'
        "<|im_end|><|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        f"<|im_user|>user<|im_middle|>{Q}<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|>{KIMI_CALLS}<|im_end|>{KIMI_RESULTS}"
        "<|im_assistant|>assistant<|im_middle|>21 C and sunny; it is 14:05.<|im_end|>"
        f"<|im_user|>user<|im_middle|>{Q}<|im_end|><|im_assistant|>assistant<|im_middle|>",
    ),
    (
        "kimi_k2", "result named after its function", False, {}, False,
        f"{KIMI_SYSTEM}<|im_user|>user<|im_middle|>{Q}<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n"
        "21 C, sunny<|im_end|>",
    ),
    (
        "kimi_k2", "arguments as an object", False, {}, False,
        f"{KIMI_SYSTEM}<|im_user|>user<|im_middle|>{Q}<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": [1, 2]}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
    ),
    (   # thinking kept only after the last answer without calls
        "kimi_k2_thinking", "reasoning as a field", True, {}, False,
        f"{KIMI_SYSTEM}<|im_user|>user<|im_middle|>{Q}<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Sunny.<|im_end|>"
        "<|im_user|>user<|im_middle|>And the time?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Call.</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:1"
        '<|tool_call_argument_begin|>{"timezone": "CET"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_time:1\n14:05<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>",
    ),
    (
        "kimi_k2_thinking", "whole exchange", False, {}, False,
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        f"<|im_user|>user<|im_middle|>{Q}<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|><think></think>{KIMI_CALLS}<|im_end|>"
        f"{KIMI_RESULTS}<|im_assistant|>assistant<|im_middle|><think></think>"
        f"21 C and sunny; it is 14:05.<|im_end|><|im_user|>user<|im_middle|>{Q}<|im_end|>",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, label, gen, kw, tools, want", GOLDEN, ids=[f"{g[0]}: {g[1]}" for g in GOLDEN]
)
def test_golden(families, name, label, gen, kw, tools, want):
    ours, _ = families[name]
    got = render(ours, CONVERSATIONS[label], gen, TOOLS if tools else None, **kw)
    assert got == want


@pytest.mark.parametrize("real", ["deepseek_v3", "deepseek_r1"])
def test_v3_template_agrees_with_deepseeks_own_text_on_plain_chats(families, tmp_path, real):
    """V3's and R1's first templates put <｜Assistant｜> before the answer, V3-0324's after
    the question: the same text, except after a last user turn without the prompt."""
    text = (FIXTURES / f"{real}_chat_template.jinja").read_text()
    theirs = Tokenizer.from_dir(checkpoint(tmp_path, DEEPSEEK_TOKENS, text))
    ours, _ = families["deepseek_v3"]
    plain = ["one user turn", "two system prompts", "several turns"]
    convs = [CONVERSATIONS[label] for label in plain]
    convs += [conv[:n] for conv in convs for n in range(1, len(conv))]
    compared = 0
    for conv in convs:
        for gen in (True, False):
            if conv[-1]["role"] == "user" and not gen:
                continue
            assert render(ours, conv, gen) == render(theirs, conv, gen), (conv, gen)
            compared += 1
    assert compared >= 12


# ---- round trip through the parsers ------------------------------------------------------------

# V3.1 thinking is left out: its prompt ends in <think>, but the template writes earlier
# answers without their thinking (</think>, see GOLDEN), so the prompt is no prefix of them
ROUND_TRIPS = [
    ("deepseek_v3", {}),
    ("deepseek_v31", {}),
    ("deepseek_v31", {"thinking": False}),
    ("kimi_k2", {}),
    ("kimi_k2_thinking", {}),
]


@pytest.mark.parametrize("name, kw", ROUND_TRIPS)
@pytest.mark.parametrize("text", ["", "Let me look."])
def test_calls_round_trip_through_the_parser(families, name, kw, text):
    ours, _ = families[name]
    parser = FAMILIES[name][2]
    history = [SYSTEM, QUESTION]
    turn = {"role": "assistant", "content": text, "tool_calls": [CALL_A, CALL_B]}
    if name == "kimi_k2_thinking":
        turn["reasoning_content"] = "Two tools."
    prompt = render(ours, history, True, TOOLS, **kw)
    whole = render(ours, [*history, turn], False, TOOLS, **kw)
    assert whole.startswith(prompt)
    written = whole[len(prompt) :]  # what the model writes after the generation prompt
    if name == "kimi_k2_thinking":
        thought, written = reasoning.split(written, True, reasoning.KIMI_TOOLS)
        assert thought == "Two tools."
    content, calls = parse(written, parser=parser)
    assert content == (text or None)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"timezone": "CET"}),
    ]
    if parser == "kimi_k2":
        assert [c.id for c in calls] == [CALL_A["id"], CALL_B["id"]]
    # the answer, sent back as the next request's history, renders as the model wrote it
    # (DeepSeek's templates need a content: "" for none, see the next test)
    back = {
        "role": "assistant",
        "content": content or "",
        "tool_calls": [c.openai() for c in calls],
    }
    if name == "kimi_k2_thinking":
        back["reasoning_content"] = thought
    results = [
        {"role": "tool", "tool_call_id": c.id, "content": r}
        for c, r in zip(calls, ["21 C", "14:05"])
    ]
    again = render(ours, [*history, back, *results], False, TOOLS, **kw)
    assert again.startswith(whole)
    if parser == "kimi_k2":  # each result names the call it answers
        assert again.endswith(
            "## Return of functions.get_weather:0\n21 C<|im_end|>"
            "<|im_system|>tool<|im_middle|>## Return of functions.get_time:1\n14:05<|im_end|>"
        )


@pytest.mark.parametrize("name", FAMILIES)
def test_a_turn_of_calls_without_content(families, name):
    """An OpenAI client sends back a turn of calls with `content: null`. transformers
    drops None values, and DeepSeek's templates then fail on the missing content, in HF as
    in ours (the daemon answers 400); Kimi's render the calls."""
    ours, hf = families[name]
    conv = CONVERSATIONS["calls without content"]
    want = rendered_or_error(hf_render, hf, conv, False)
    assert rendered_or_error(render, ours, conv, False) == want
    if name in DEEPSEEK:
        assert want.startswith("error UndefinedError")
    else:
        assert want.endswith("<|tool_calls_section_end|><|im_end|>")
        assert "None" not in want


# ---- where HF finds a template, and the sandbox's extras ---------------------------------------


def test_chat_template_jinja_wins_over_the_config_and_named_templates(tmp_path):
    from_file, from_config = "file: {{ messages[0].content }}", "config"
    tool_use = "tools: {{ tools | length }}"
    cases = {
        "file only": ({}, {"chat_template.jinja": from_file}),
        "file over config": ({"template": from_config}, {"chat_template.jinja": from_file}),
        "named files": (
            {"template": from_config},
            {
                "chat_template.jinja": from_file,
                "additional_chat_templates/tool_use.jinja": tool_use,
            },
        ),
        "named in the config": (
            {
                "template": [
                    {"name": "default", "template": from_file},
                    {"name": "tool_use", "template": tool_use},
                ]
            },
            {},
        ),
        "no default": ({}, {"additional_chat_templates/tool_use.jinja": tool_use}),
    }
    conv = [{"role": "user", "content": "hi"}]
    seen = []
    for label, (config, files) in cases.items():
        path = checkpoint(tmp_path / label.replace(" ", "_"), DEEPSEEK_TOKENS, **config, **files)
        ours, hf = Tokenizer.from_dir(path), hf_tokenizer(path)
        for tools in (None, TOOLS):
            want = rendered_or_error(hf_render, hf, conv, True, tools)
            got = rendered_or_error(render, ours, conv, True, tools)
            if want.startswith("error"):  # HF's message names its own argument
                assert got.startswith("error ValueError") and "default" in got, label
            else:
                assert got == want, (label, tools is not None)
            seen.append(want)
    assert seen[:4] == ["file: hi"] * 4
    assert seen[4:8] == ["file: hi", "tools: 2"] * 2
    # without a default, a request without tools has no template
    assert seen[8].startswith("error ValueError") and seen[9] == "tools: 2"


def test_generation_tag_and_namespace_as_in_transformers(families):
    ours, hf = families["deepseek_v3"]
    conv = [{"role": "user", "content": "hi"}]

    def both(template: str) -> tuple[str, str]:
        mine = Tokenizer(ours._tok, {**ours.config, "chat_template": template})
        return (
            rendered_or_error(render, mine, conv),
            rendered_or_error(hf.apply_chat_template, conv, chat_template=template, tokenize=False),
        )

    got, want = both("{% generation %}{{ messages[0].content }}!{% endgeneration %}")
    assert got == want == "hi!"
    got, want = both("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}")
    assert got == want == "2"
    for evil in ("{% set ns = namespace(_n=1) %}", "{% set ns = namespace() %}{% set ns._n = 1 %}"):
        got, want = both(evil)
        assert want.startswith("error SecurityError")
        assert got.startswith(f"error {ChatTemplateRefused.__name__}")
