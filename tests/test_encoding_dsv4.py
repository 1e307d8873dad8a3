"""DeepSeek-V4's chat format: its prompts (`--chat_template=deepseek_v4`,
xllm_py/formats/encoding_dsv4.py), its DSML tool calls (`--tool_call_parser=deepseek_v4`)
and the grammar of `tool_choice` required.

- Prompts against fixtures written by hand from the rules DeepSeek publishes with V4
  (`encoding/README.md` and `encoding_dsv4.py` in the model's repository), spelled here
  independently of the code: tools declared after the system text; reasoning kept with
  tools and dropped before the last user turn without them (developer turns there left
  out); tool results as `<tool_result>` blocks of a user turn, put in the order of the
  calls they answer, with the user text after them in the same turn; consecutive user
  messages one turn; the model's turn opened only before an assistant turn or at the end;
  chat mode; `add_generation_prompt` false; the maximum reasoning effort's instruction;
  a role V4 has not is an error naming it. `--chat_template=auto` picks V4's rules for a
  checkpoint of model_type deepseek_v4 without a template of its own.
- The reader: calls in V4's `tool_calls` section read whole and streamed a character at a
  time alike; V3.2's `function_calls` section is text to it (and V4's to V3.2's reader);
  the calls the encoder writes into a prompt read back to the same arguments.
- The grammar of `tool_choice` required gives the same verdict as xgrammar's own
  `deepseek_v4` structural tag (an independent description of the format) on calls that
  are well formed, cut, undeclared, schema-breaking, in V3.2's section or after text.
"""

from __future__ import annotations

import json

import pytest

from tests import grammar_utils
from tests.test_tool_calls import TOOLS
from xllm_py.formats import encoding_dsv4, encodings, tool_parser
from xllm_py.formats.tool_parser import parse, stream_for
from xllm_py.sampling_params import StructuredOutput

D = "｜DSML｜"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"


def p(key: str, value: str, string: bool = True) -> str:
    return f'<{D}parameter name="{key}" string="{str(string).lower()}">{value}</{D}parameter>'


def invoke(name: str, *params: str) -> str:
    return "\n".join([f'<{D}invoke name="{name}">', *params, f"</{D}invoke>"])


def block(*invokes: str, name: str = "tool_calls") -> str:
    return "\n\n" + "\n".join([f"<{D}{name}>", *invokes, f"</{D}{name}>"])


def call(i: str, name: str, args: dict) -> dict:
    return {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


WEATHER = invoke("get_weather", p("city", "Paris"), p("unit", "celsius"))
TIME = invoke("get_time", p("timezone", "CET"))
SCHEMAS = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in TOOLS)
TOOLS_END = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"  # noqa: E501


# ---- prompts -----------------------------------------------------------------------------------


def test_tools_tool_calls_and_results_in_thinking_mode():
    """With tools nothing is dropped: every assistant turn keeps its reasoning, every user
    turn (a tool result's too) opens the model's turn with <think>."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
         "tool_calls": [call("c1", "get_weather", {"city": "Paris", "unit": "celsius"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 25C"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Done."},
        {"role": "user", "content": "Thanks!"},
    ]  # fmt: skip
    prompt = encoding_dsv4.encode_messages(messages, TOOLS, thinking=True)
    head, tail = prompt.split(SCHEMAS + TOOLS_END)
    assert head.startswith(BOS + "You are a helpful assistant.\n\n## Tools\n\nYou have access")
    assert f'writing a "<{D}tool_calls>" block like the following' in head
    assert head.endswith("### Available Tool Schemas\n\n")
    assert tail == (
        f"{U}Weather in Paris?{A}<think>Use the tool.</think>" + block(WEATHER) + EOS
        + f"{U}<tool_result>Sunny, 25C</tool_result>{A}<think>Done.</think>It is sunny.{EOS}"
        + f"{U}Thanks!{A}<think>"
    )  # fmt: skip
    # no system message: an empty one carries the tools
    bare = encoding_dsv4.encode_messages(messages[1:2], TOOLS, thinking=True)
    assert bare.startswith(BOS + "\n\n## Tools\n\n")
    assert bare.endswith(TOOLS_END + f"{U}Weather in Paris?{A}<think>")


def test_without_tools_thinking_before_the_last_user_turn_is_dropped():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "developer", "content": "d1"},
        {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a3", "reasoning_content": "r3"},
    ]
    prompt = encoding_dsv4.encode_messages(messages, thinking=True)
    assert prompt == BOS + f"S{U}u1{A}</think>a1{EOS}a2{EOS}{U}u2{A}<think>r3</think>a3{EOS}"
    # chat mode: no reasoning anywhere, </think> opens every model turn
    chat = encoding_dsv4.encode_messages(messages[:6], thinking=False)
    assert chat == BOS + f"S{U}u1{A}</think>a1{EOS}{U}d1{A}</think>a2{EOS}{U}u2{A}</think>"


def test_results_go_in_call_order_and_user_messages_share_their_turn():
    calls = [call("c1", "get_weather", {"city": "Paris", "unit": "celsius"}),
             call("c2", "get_time", {"timezone": "CET"})]  # fmt: skip
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "On it.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c2", "content": "R2"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "R1"}]},
        {"role": "user", "content": "and?"},
    ]
    prompt = encoding_dsv4.encode_messages(messages)
    assert prompt == (
        f"{BOS}{U}q{A}</think>On it." + block(WEATHER, TIME) + EOS
        + f"{U}<tool_result>R1</tool_result>\n\n<tool_result>R2</tool_result>\n\nand?{A}</think>"
    )  # fmt: skip
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert encoding_dsv4.encode_messages(two) == f"{BOS}{U}a\n\nb{A}</think>"
    assert encoding_dsv4.encode_messages(two, add_generation_prompt=False) == f"{BOS}{U}a\n\nb"


def test_maximum_reasoning_effort_and_errors():
    prompt = encoding_dsv4.render(
        [{"role": "user", "content": "hi"}], None, {"thinking": True, "reasoning_effort": "max"}
    )
    assert prompt.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts")
    assert prompt.endswith(f"left unchecked.\n\n{U}hi{A}<think>")
    assert encoding_dsv4.render([{"role": "user", "content": "hi"}], None, {"thinking": True}) == (
        f"{BOS}{U}hi{A}<think>"
    )
    with pytest.raises(ValueError, match=r"messages\[1\]\.role: 'function' is not a role"):
        encoding_dsv4.encode_messages([{"role": "user", "content": "x"}, {"role": "function"}])
    with pytest.raises(ValueError, match=r"messages\[0\]: a developer message needs content"):
        encoding_dsv4.encode_messages([{"role": "developer", "content": ""}])


def test_auto_picks_the_rules_of_the_checkpoints_model_type():
    assert encodings.encoder("auto", {"model_type": "deepseek_v4"}, False) is encoding_dsv4.render
    assert encodings.encoder("auto", {"model_type": "deepseek_v4"}, True) is None  # its own
    assert encodings.encoder("deepseek_v4", {"model_type": "deepseek_v3"}, True) is not None
    with pytest.raises(ValueError, match="--chat_template='v4': must be one of auto, deepseek_v32"):
        encodings.encoder("v4", {}, False)


# ---- the reader --------------------------------------------------------------------------------


def test_v4_calls_read_whole_and_streamed_and_v32_sections_are_text():
    text = "Let me check." + block(WEATHER, TIME)
    content, calls = parse(text, parser="deepseek_v4")
    want = [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"timezone": "CET"}),
    ]
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    s = stream_for("deepseek_v4")
    for ch in text:
        s.feed(ch)
    s.feed("", final=True)
    assert [(c.name, json.loads(c.arguments)) for c in s.calls] == want
    v32 = block(WEATHER, name="function_calls")
    assert parse(v32, parser="deepseek_v4") == (v32, [])
    assert parse(block(WEATHER), parser="deepseek_v32") == (block(WEATHER), [])


def test_calls_the_encoder_writes_read_back():
    args = {"q": "a\nb", "n": 3, "f": [1.5, {"x": None}], "ok": False}
    calls = [call("c", "search", args)]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": calls}]
    turn = encoding_dsv4.encode_messages(messages).split(f"{A}</think>")[1].removesuffix(EOS)
    content, got = parse(turn, parser="deepseek_v4")
    assert (content, [(c.name, json.loads(c.arguments)) for c in got]) == (None, [("search", args)])


# ---- the grammar -------------------------------------------------------------------------------


def test_the_required_grammar_agrees_with_xgrammars_deepseek_v4_tag():
    xgr = pytest.importorskip("xgrammar.builtin_structural_tag")
    ours = tool_parser.tool_call_grammar(TOOLS, None, True, "deepseek_v4")
    theirs = xgr.get_model_structural_tag(
        "deepseek_v4", tools=TOOLS, tool_choice="required", reasoning=False, max_whitespace_cnt=1
    ).model_dump_json()
    candidates = {
        block(WEATHER): True,
        block(WEATHER, TIME): True,
        block(invoke("get_weather", p("city", "São Paulo"), p("unit", "fahrenheit"))): True,
        block(): False,  # at least one call
        "Sure." + block(WEATHER): False,
        block(WEATHER).removeprefix("\n\n"): False,
        block(WEATHER, name="function_calls"): False,  # V3.2's section
        block(invoke("rm_rf", p("path", "/"))): False,
        block(invoke("get_weather", p("city", "Paris"))): False,  # a required one missing
        block(invoke("get_weather", p("city", "Paris"), p("unit", "kelvin"))): False,
        block(invoke("get_time", p("timezone", '"CET"', False))): False,  # a string
        block(TIME)[:-5]: False,  # cut short
    }
    for text, admitted in candidates.items():
        for spec in (ours, theirs):
            got = grammar_utils.follows(StructuredOutput("structural_tag", spec), text)
            assert got == admitted, (spec is ours, text)
