"""DeepSeek-V3.2's prompts (`--chat_template=deepseek_v32`, or `auto` on a checkpoint whose
config.json says `model_type: deepseek_v32` and that ships no chat template of its own).

DeepSeek-V3.2 has no Jinja chat template: DeepSeek publishes its prompt rules as Python
(`encoding/encoding_dsv32.py` in the model's repository, `encode_messages`), and this
module renders an OpenAI chat request by those rules. One conversation, in chat mode:

    <｜begin▁of▁sentence｜>SYSTEM\\n\\n## Tools\\n\\n ... <functions>\\n{FN}\\n{FN2}
    \\n</functions>\\n
    <｜User｜>QUESTION<｜Assistant｜></think>TEXT\\n\\n<｜DSML｜function_calls>\\n ... calls
    ... </｜DSML｜function_calls><｜end▁of▁sentence｜>
    \\n\\n<function_results>\\n<result>R1</result>\\n<result>R2</result>\\n</function_results>
    \\n\\n</think>ANSWER<｜end▁of▁sentence｜>
    <｜User｜>NEXT<｜Assistant｜></think>                      <- the model writes from here

(line breaks here are this page's, except the `\\n` written out). The rules:

- The prompt starts with the BOS text. The tools (`tools`: each function's JSON, one a
  line, inside DeepSeek's declaration of the DSML call format) follow the first message
  when it is a system message, after its text and `\\n\\n`; otherwise they come first, as
  the text of an empty system message. System text is written as it is.
- A user turn is `<｜User｜>TEXT<｜Assistant｜>` and then the thinking mode's mark:
  `<think>` in thinking mode after the *last* user turn (the model thinks now),
  `</think>` everywhere else (chat mode, and every earlier turn: no thinking there).
  A developer turn is a user turn whose text is `\\n\\n# The user's message is: TEXT`.
- An assistant turn is its text, its tool calls as a DSML block (`\\n\\n` before it:
  `string="true"` parameters for string arguments, raw; `string="false"` with JSON for
  the rest) and `<｜end▁of▁sentence｜>`. Its reasoning (`reasoning_content`) is written,
  then `</think>`, only in thinking mode and only after the last user turn (the rounds
  of tool calls the model is still in); every earlier turn's reasoning is dropped.
  (DeepSeek's encoder refuses such a turn without reasoning or tool calls; here its
  reasoning is empty: the API does not carry an earlier answer's reasoning back.)
- Tool results follow the calls they answer, in order: the first opens
  `\\n\\n<function_results>`, each is `\\n<result>TEXT</result>`, and the one answering
  the turn's last call closes the block with `\\n</function_results>` and `\\n\\n` plus the
  thinking mode's mark (`<think>` only in thinking mode after the last user turn).

Thinking mode comes from the request's chat_template_kwargs, `thinking` or
`enable_thinking` true (default: chat), read by `reasoning.thinks` as
`--reasoning_parser=deepseek_v3` reads it, so the split agrees with the prompt.
`add_generation_prompt` false leaves out what opens the model's turn after the last
message (`<｜Assistant｜>` and the mark after a user turn, `\\n\\n` and the mark after the
results). A message these rules cannot render is a ValueError naming it.
"""

from __future__ import annotations

import json
from typing import Any

from xllm_py.formats import reasoning
from xllm_py.formats.dsml import (
    DSML,
    DSML_INVOKE,
    DSML_INVOKE_END,
    DSML_LEAD,
    DSML_PARAM,
    DSML_PARAM_END,
    V32_CALLS,
    calls_tags,
)

NAME = "deepseek_v32"  # --chat_template (formats/encodings.py)
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START, THINK_END = reasoning.START, reasoning.END
RESULTS_BEGIN, RESULTS_END = "<function_results>", "</function_results>"
RESULT_BEGIN, RESULT_END = "<result>", "</result>"
DEVELOPER_LEAD = "\n\n# The user's message is: "

# The model's declaration of the tools: DeepSeek's text, word for word (it is what the
# model was trained on); {d} is the DSML marker, {fns} the functions' JSON, one a line.
TOOLS_TEXT = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{d}function_calls>" block like the following as part of your reply to the user:
<{d}function_calls>
<{d}invoke name="$FUNCTION_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$FUNCTION_NAME2">
...
</{d}invoke>
</{d}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{d}function_calls>
...
</{d}function_calls>

<function_results>
...
</function_results>

{think}...thinking about results{end_think}

Here are the functions available in JSONSchema format:
<functions>
{fns}
</functions>
"""  # noqa: E501


def render(
    messages: list[dict],
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """An OpenAI chat request's prompt (messages as `message_dicts` gives them, `tools` in
    OpenAI's shape, chat_template_kwargs choosing the thinking mode)."""
    thinking = reasoning.thinks("deepseek_v3", template_kwargs)
    return encode_messages(messages, tools, thinking, add_generation_prompt)


def encode_messages(
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt of `messages` by DeepSeek-V3.2's rules (module docstring); `thinking`:
    thinking mode, else chat mode."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "developer")),
                    default=-1)  # fmt: skip
    tools_text = _tools_text(tools) if tools else ""
    parts = [BOS]
    if tools_text and not (messages and messages[0]["role"] == "system"):
        parts.append(DSML_LEAD + tools_text)  # an empty system message carries them
    for i, m in enumerate(messages):
        body, opening = _message(i, messages, last_user, thinking)
        if i == 0 and tools_text and m["role"] == "system":
            body += DSML_LEAD + tools_text
        parts.append(body)
        if i < len(messages) - 1 or add_generation_prompt:
            parts.append(opening)
    return "".join(parts)


def _message(i: int, messages: list[dict], last_user: int, thinking: bool) -> tuple[str, str]:
    """(the message's own text, what opens the model's turn after it: "" for most)."""
    m = messages[i]
    role, text = m["role"], text_of(m.get("content"))
    mark = THINK_START if thinking and i >= last_user else THINK_END
    if role == "system":
        return text, ""
    if role == "user":
        return USER + text, ASSISTANT + mark
    if role == "developer":
        if not text:
            raise ValueError(f"messages[{i}]: a developer message needs content")
        return USER + DEVELOPER_LEAD + text, ASSISTANT + mark
    if role == "assistant":
        reasoning_text = m.get("reasoning_content") or ""
        thought = reasoning_text + THINK_END if thinking and i > last_user else ""
        calls = m.get("tool_calls") or []
        block = DSML_LEAD + dsml_calls(i, calls) if calls else ""
        return thought + text + block + EOS, ""
    if role == "tool":
        return _tool_result(i, messages, text, mark)
    raise ValueError(f"messages[{i}].role: {role!r} is not a role DeepSeek-V3.2's prompt has")


def _tool_result(i: int, messages: list[dict], text: str, mark: str) -> tuple[str, str]:
    """A tool result: its place among the results of the assistant turn before it opens
    or closes the results block."""
    turn = i - 1
    while turn >= 0 and messages[turn]["role"] == "tool":
        turn -= 1
    calls = (messages[turn].get("tool_calls") or []) if turn >= 0 else []
    if turn < 0 or messages[turn]["role"] != "assistant" or not calls:
        raise ValueError(f"messages[{i}]: a tool result with no assistant tool call before it")
    order = i - turn  # 1: answers the turn's first call
    if order > len(calls):
        raise ValueError(
            f"messages[{i}]: tool result {order} of an assistant turn (messages[{turn}]) "
            f"that made {len(calls)} tool call(s)"
        )
    body = (DSML_LEAD + RESULTS_BEGIN if order == 1 else "") + f"\n{RESULT_BEGIN}{text}{RESULT_END}"
    if order < len(calls):
        return body, ""
    return body + "\n" + RESULTS_END, DSML_LEAD + mark


def dsml_calls(i: int, calls: list[dict], block: str = V32_CALLS) -> str:
    """messages[i]'s tool calls as DSML (string arguments raw, the rest JSON), in a
    section named `block`."""
    invokes = []
    for j, call in enumerate(calls):
        fn = call.get("function") or {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise ValueError(
                f"messages[{i}].tool_calls[{j}].function.arguments: not a JSON object: "
                f"{fn.get('arguments')!r}"
            )
        params = [_dsml_param(k, v) for k, v in args.items()]
        header = f'{DSML_INVOKE} name="{fn.get("name")}">'
        invokes.append("\n".join([header, *params, DSML_INVOKE_END]))
    return "\n".join([calls_tags(block)[0], *invokes, calls_tags(block)[1]])


def _dsml_param(key: str, value: Any) -> str:
    string = isinstance(value, str)
    text = value if string else json.dumps(value, ensure_ascii=False)
    return f'{DSML_PARAM} name="{key}" string="{str(string).lower()}">{text}{DSML_PARAM_END}'


def tool_schemas(tools: list[dict]) -> str:
    """The functions' JSON (OpenAI's `tools`, or bare functions), one a line."""
    return "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)


def _tools_text(tools: list[dict]) -> str:
    return TOOLS_TEXT.format(d=DSML, fns=tool_schemas(tools), think=THINK_START,
                             end_think=THINK_END)  # fmt: skip


def text_of(content: Any) -> str:
    """A message's content as text (None: none; OpenAI's text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
