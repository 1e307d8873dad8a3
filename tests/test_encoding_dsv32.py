"""DeepSeek-V3.2's prompts (xllm_py/formats/encoding_dsv32.py: `--chat_template`).

- Fixtures: expected prompt strings written by hand from DeepSeek's published rules
  (`encoding/encoding_dsv32.py` of DeepSeek-V3.2: BOS first; `<｜User｜>TEXT<｜Assistant｜>`
  then `</think>`, or `<think>` after the last user turn in thinking mode; an assistant
  turn's text, its calls in DSML after `\\n\\n`, `<｜end▁of▁sentence｜>`; reasoning only
  after the last user turn in thinking mode; tool results in `<function_results>`; the
  tools' declaration after the system text), for chat and thinking mode, tools with and
  without a system message, several turns with earlier reasoning dropped, tool results
  (several calls, in order), typed and raw arguments, a developer turn,
  add_generation_prompt false.
- Messages these rules cannot render are a ValueError naming the message.
- Thinking mode comes from chat_template_kwargs (`thinking` / `enable_thinking`) exactly
  as `--reasoning_parser=deepseek_v3` reads them.
- `--chat_template`: which checkpoints use the encoding under `auto`; a value `xllm` does
  not know is refused naming it, on the command line and in EngineArgs.
"""

from __future__ import annotations

import pytest

from xllm_py.args import EngineArgs
from xllm_py.formats import reasoning
from xllm_py.formats.encoding_dsv32 import encode_messages, render
from xllm_py.formats.encodings import encoder

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"

WEATHER_FN = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER_FN}]
# The declaration DeepSeek-V3.2 reads its tools in, as the encoder writes it for TOOLS
DECLARATION = (
    "## Tools\n\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    f'You can invoke functions by writing a "<{D}function_calls>" block like the following '
    "as part of your reply to the user:\n"
    f"<{D}function_calls>\n"
    f'<{D}invoke name="$FUNCTION_NAME">\n'
    f'<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{D}parameter>\n"
    "...\n"
    f"</{D}invoke>\n"
    f'<{D}invoke name="$FUNCTION_NAME2">\n'
    "...\n"
    f"</{D}invoke>\n"
    f"</{D}function_calls>\n\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, "
    'while lists and objects should use JSON format. The "string" attribute should be set '
    'to "true" for string type parameters and "false" for other types (numbers, booleans, '
    "arrays, objects).\n\n"
    "If the thinking_mode is enabled, then after function results you should strongly "
    "consider outputting a thinking block. Here is an example:\n\n"
    f"<{D}function_calls>\n...\n</{D}function_calls>\n\n"
    "<function_results>\n...\n</function_results>\n\n"
    "<think>...thinking about results</think>\n\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n"
    '{"name": "get_weather", "description": "The weather in a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": '
    '"integer"}}, "required": ["city"]}}\n'
    "</functions>\n"
)


def call(cid: str, name: str, arguments: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


PARIS = call("c1", "get_weather", '{"city": "Paris", "days": 2}')
LIMA = call("c2", "get_weather", '{"city": "Lima"}')
PARIS_DSML = (
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
    f"</{D}invoke>"
)
LIMA_DSML = (
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">Lima</{D}parameter>\n'
    f"</{D}invoke>"
)


def calls_block(*invokes: str) -> str:
    return "\n\n" + "\n".join([f"<{D}function_calls>", *invokes, f"</{D}function_calls>"])


def user(text: str) -> dict:
    return {"role": "user", "content": text}


# (messages, tools, thinking, expected prompt)
FIXTURES = {
    "chat, one question": ([user("Hi")], None, False, f"{BOS}{U}Hi{A}</think>"),
    "thinking, one question": ([user("Hi")], None, True, f"{BOS}{U}Hi{A}<think>"),
    "system and several turns, chat": (
        [{"role": "system", "content": "Be brief."}, user("1+1?"),
         {"role": "assistant", "content": "2"}, user("And 2+2?")],
        None, False,
        f"{BOS}Be brief.{U}1+1?{A}</think>2{EOS}{U}And 2+2?{A}</think>",
    ),
    "thinking: earlier turns' reasoning dropped, earlier turns closed": (
        [user("1+1?"), {"role": "assistant", "content": "2", "reasoning_content": "one and one"},
         user("And 2+2?")],
        None, True,
        f"{BOS}{U}1+1?{A}</think>2{EOS}{U}And 2+2?{A}<think>",
    ),
    "tools without a system message: an empty one carries them": (
        [user("Weather in Paris?")], TOOLS, False,
        f"{BOS}\n\n{DECLARATION}{U}Weather in Paris?{A}</think>",
    ),
    "tools after the system text": (
        [{"role": "system", "content": "You help."}, user("Weather in Paris?")], TOOLS, False,
        f"{BOS}You help.\n\n{DECLARATION}{U}Weather in Paris?{A}</think>",
    ),
    "calls and their results, chat": (
        [user("Paris and Lima?"),
         {"role": "assistant", "content": None, "tool_calls": [PARIS, LIMA]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
         {"role": "tool", "tool_call_id": "c2", "content": "foggy"}],
        None, False,
        f"{BOS}{U}Paris and Lima?{A}</think>" + calls_block(PARIS_DSML, LIMA_DSML) + EOS
        + "\n\n<function_results>\n<result>sunny</result>\n<result>foggy</result>\n"
        "</function_results>\n\n</think>",
    ),
    "thinking: the rounds after the last question keep their reasoning": (
        [user("Paris?"),
         {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need data.",
          "tool_calls": [PARIS]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        None, True,
        f"{BOS}{U}Paris?{A}<think>Need data.</think>Let me check." + calls_block(PARIS_DSML)
        + EOS + "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n<think>",
    ),
    "thinking: results before the last question close their thinking": (
        [user("Paris?"), {"role": "assistant", "tool_calls": [PARIS]},
         {"role": "tool", "content": "sunny"},
         {"role": "assistant", "content": "Sunny.", "reasoning_content": "easy"}, user("Lima?")],
        None, True,
        f"{BOS}{U}Paris?{A}</think>" + calls_block(PARIS_DSML) + EOS
        + "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n</think>"
        + f"Sunny.{EOS}{U}Lima?{A}<think>",
    ),
    "a developer turn is a user turn": (
        [{"role": "developer", "content": "Answer in French."}], None, False,
        f"{BOS}{U}\n\n# The user's message is: Answer in French.{A}</think>",
    ),
    "typed and raw arguments": (
        [user("Plan."), {"role": "assistant", "tool_calls": [call(
            "c", "plan", '{"title": "Trip \\"A\\"", "stops": ["Lyon", "Nice"], "n": 1.5, '
            '"opts": {"fast": true, "via": null}, "code": "42"}')]}],
        None, False,
        f"{BOS}{U}Plan.{A}</think>" + calls_block(
            f'<{D}invoke name="plan">\n'
            f'<{D}parameter name="title" string="true">Trip "A"</{D}parameter>\n'
            f'<{D}parameter name="stops" string="false">["Lyon", "Nice"]</{D}parameter>\n'
            f'<{D}parameter name="n" string="false">1.5</{D}parameter>\n'
            f'<{D}parameter name="opts" string="false">{{"fast": true, "via": null}}'
            f"</{D}parameter>\n"
            f'<{D}parameter name="code" string="true">42</{D}parameter>\n'
            f"</{D}invoke>") + EOS,
    ),
    "a call without arguments": (
        [user("Ping."), {"role": "assistant", "tool_calls": [call("c", "ping", "{}")]}],
        None, False,
        f"{BOS}{U}Ping.{A}</think>" + calls_block(f'<{D}invoke name="ping">\n</{D}invoke>') + EOS,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FIXTURES))
def test_prompts_follow_the_published_rules(case):
    messages, tools, thinking, expected = FIXTURES[case]
    assert encode_messages(messages, tools, thinking) == expected


def test_add_generation_prompt_false_leaves_the_models_turn_unopened():
    assert encode_messages([user("Hi")], add_generation_prompt=False) == f"{BOS}{U}Hi"
    messages, tools, thinking, expected = FIXTURES["calls and their results, chat"]
    assert encode_messages(messages, tools, thinking, False) == expected.removesuffix(
        "\n\n</think>"
    )
    # a last assistant turn is whole either way
    done = [user("1+1?"), {"role": "assistant", "content": "2"}]
    assert encode_messages(done, add_generation_prompt=False) == encode_messages(done)


@pytest.mark.parametrize(
    "kwargs,thinks",
    [
        (None, False),
        ({}, False),
        ({"thinking": True}, True),
        ({"enable_thinking": True}, True),
        ({"thinking": False}, False),
        ({"enable_thinking": 0, "other": 1}, False),
    ],
)
def test_thinking_mode_comes_from_the_kwargs_the_reasoning_parser_reads(kwargs, thinks):
    prompt = render([user("Hi")], None, kwargs)
    assert prompt.endswith("<think>" if thinks else "</think>")
    assert reasoning.thinks("deepseek_v3", kwargs) is thinks
    assert reasoning.splitter_for("deepseek_v3", kwargs).done_thinking is not thinks


@pytest.mark.parametrize(
    "messages,named",
    [
        ([{"role": "tool", "content": "x"}], "messages[0]: a tool result with no assistant"),
        ([user("q"), {"role": "tool", "content": "x"}], "messages[1]: a tool result"),
        (
            [user("q"), {"role": "assistant", "tool_calls": [PARIS]}]
            + [{"role": "tool", "content": "x"}] * 2,
            "messages[3]: tool result 2 of an assistant turn (messages[1]) that made 1",
        ),
        (
            [user("q"), {"role": "assistant", "tool_calls": [call("c", "f", "[1, 2]")]}],
            "messages[1].tool_calls[0].function.arguments: not a JSON object: '[1, 2]'",
        ),
        (
            [user("q"), {"role": "assistant", "tool_calls": [PARIS, call("c", "f", "{oops")]}],
            "messages[1].tool_calls[1].function.arguments: not a JSON object: '{oops'",
        ),
        ([{"role": "developer", "content": ""}], "messages[0]: a developer message needs content"),
        ([{"role": "narrator", "content": "x"}], "messages[0].role: 'narrator'"),
    ],
)
def test_messages_the_rules_cannot_render_are_named(messages, named):
    with pytest.raises(ValueError) as e:
        encode_messages(messages)
    assert named in str(e.value)


# ---- --chat_template ----------------------------------------------------------------------------


def test_which_checkpoints_use_the_encoding():
    v32, v3 = {"model_type": "deepseek_v32"}, {"model_type": "deepseek_v3"}
    assert encoder("auto", v32, has_own_template=False) is render
    assert encoder("auto", v32, has_own_template=True) is None  # V3.2-Exp: V3.1's template
    assert encoder("auto", v3, has_own_template=False) is None
    assert encoder("deepseek_v32", v3, has_own_template=True) is render
    with pytest.raises(ValueError, match="--chat_template='jinja'"):
        encoder("jinja", v32, False)


def test_chat_template_on_the_command_line(capsys):
    from xllm_py.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([]).chat_template == "auto"
    assert parser.parse_args(["--chat_template=deepseek_v32"]).chat_template == "deepseek_v32"
    assert parser.parse_args(["--chat_template=deepseek_v4"]).chat_template == "deepseek_v4"
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--chat_template=deepseek_v9"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--chat_template" in err and "'deepseek_v9'" in err and "'deepseek_v32'" in err
    with pytest.raises(ValueError, match="--chat_template=chatml: must be auto, deepseek_v32 or"):
        EngineArgs(chat_template="chatml").check()
