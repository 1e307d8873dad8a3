"""DeepSeek-V4's prompts (`--chat_template=deepseek_v4`, or `auto` on a checkpoint whose
config.json says `model_type: deepseek_v4` and that ships no chat template of its own).

Like V3.2, V4 has no Jinja template: DeepSeek publishes its rules as Python
(`encoding/encoding_dsv4.py` in the model's repository). They are V3.2's
(encoding_dsv32.py) with these differences, rendered here from an OpenAI chat request:

- Tool calls are DSML whose section is `<｜DSML｜tool_calls>` (V3.2: `function_calls`),
  and the tools' declaration after the first system message (or an empty one) is V4's
  own text (`TOOLS_TEXT`: DeepSeek's words, what the model was trained on).
- V4 has no tool role. Tool results become a user turn: `<｜User｜>` and each result as
  `<tool_result>TEXT</tool_result>`, the blocks joined by `\\n\\n`; consecutive results
  and a user message right after them share that turn (its text a block after theirs).
  The results are put in the order of the calls of the assistant turn before them (by
  `tool_call_id`; results without a known id keep their place at the front).
- A user (or developer) turn opens the model's turn only when an assistant turn follows
  or the conversation ends there (`<｜Assistant｜>` and the mark); before another user
  turn it opens nothing.
- Thinking is dropped (in thinking mode) only from a conversation without tools: then
  assistant turns before the last user turn lose their reasoning and developer turns
  before it are left out, and the mark after a user turn is `<think>` only from the last
  user turn on. With tools nothing is dropped: every assistant turn keeps its reasoning
  and `</think>`, and every user turn opens with `<think>`.
- An assistant turn is reasoning + `</think>` (in thinking mode, where not dropped), its
  text, `\\n\\n` and the calls' section when it calls, and `<｜end▁of▁sentence｜>`.
- `reasoning_effort: "max"` in chat_template_kwargs puts DeepSeek's maximum-effort
  instruction (`REASONING_EFFORT_MAX`) before everything, in thinking mode.

Thinking mode comes from chat_template_kwargs `thinking` / `enable_thinking`, as for V3.2,
and `--reasoning_parser=deepseek_v3` reads the answers; `--tool_call_parser=deepseek_v4`
reads the calls (dsml.py). An earlier assistant turn's reasoning is read from
`reasoning_content` (the API's field) or `reasoning`. A message these rules cannot render
is a ValueError naming it.
"""

from __future__ import annotations

import copy

from xllm_py.formats import reasoning
from xllm_py.formats.dsml import DSML, DSML_LEAD, V4_CALLS
from xllm_py.formats.encoding_dsv32 import (
    ASSISTANT,
    BOS,
    EOS,
    USER,
    dsml_calls,
    text_of,
    tool_schemas,
)

NAME = "deepseek_v4"  # --chat_template
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START, THINK_END = reasoning.START, reasoning.END
RESULT_BEGIN, RESULT_END = "<tool_result>", "</tool_result>"
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)

# The model's declaration of the tools: DeepSeek's text, word for word; {d} is the DSML
# marker, {fns} the functions' JSON, one a line.
TOOLS_TEXT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{d}tool_calls>" block like the following:

<{d}tool_calls>
<{d}invoke name="$TOOL_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$TOOL_NAME2">
...
</{d}invoke>
</{d}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside {think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{fns}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501


def render(
    messages: list[dict],
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """An OpenAI chat request's prompt (as encoding_dsv32.render, by V4's rules)."""
    thinking = reasoning.thinks("deepseek_v3", template_kwargs)
    effort = (template_kwargs or {}).get("reasoning_effort")
    return encode_messages(messages, tools, thinking, add_generation_prompt, effort)


def encode_messages(
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    add_generation_prompt: bool = True,
    reasoning_effort: str | None = None,
) -> str:
    """The prompt of `messages` by DeepSeek-V4's rules (module docstring)."""
    turns = _merge_tool_results(messages)
    drop = thinking and not tools
    if drop:
        turns = _drop_thinking(turns)
    last_user = max((i for i, m in enumerate(turns) if m["role"] in ("user", "developer")),
                    default=-1)  # fmt: skip
    tools_text = _tools_text(tools) if tools else ""
    parts = [BOS]
    if thinking and reasoning_effort == "max":
        parts.append(REASONING_EFFORT_MAX)
    if tools_text and not (turns and turns[0]["role"] == "system"):
        parts.append(DSML_LEAD + tools_text)  # an empty system message carries them
    for i, m in enumerate(turns):
        parts.append(_message(i, m, thinking and (not drop or i > last_user)))
        if i == 0 and tools_text and m["role"] == "system":
            parts.append(DSML_LEAD + tools_text)
        follows = turns[i + 1]["role"] if i + 1 < len(turns) else None
        opening = follows in ("assistant", "latest_reminder") or (
            follows is None and add_generation_prompt
        )
        if m["role"] in ("user", "developer") and opening:
            think = thinking and (not drop or i >= last_user)
            parts.append(ASSISTANT + (THINK_START if think else THINK_END))
    return "".join(parts)


def _message(i: int, m: dict, keeps_thinking: bool) -> str:
    """One turn's own text; `keeps_thinking`: an assistant turn writes its reasoning."""
    role, text = m["role"], text_of(m.get("content"))
    if role == "system":
        return text
    if role == "latest_reminder":
        return LATEST_REMINDER + text
    if role == "developer":
        if not text:
            raise ValueError(f"messages[{m['at']}]: a developer message needs content")
        return USER + text
    if role == "user":
        return USER + "\n\n".join(m["blocks"])
    if role == "assistant":
        thought = ""
        if keeps_thinking:
            thought = (m.get("reasoning_content") or m.get("reasoning") or "") + THINK_END
        calls = m.get("tool_calls") or []
        block = DSML_LEAD + dsml_calls(m["at"], calls, V4_CALLS) if calls else ""
        return thought + text + block + EOS
    raise ValueError(f"messages[{m['at']}].role: {role!r} is not a role DeepSeek-V4's prompt has")


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """The turns V4 renders: each message (its index as `at`), with consecutive user
    messages and tool results merged into one user turn (`blocks`, in order: text, or a
    result as `<tool_result>`), the results among themselves in the order of the calls
    of the last assistant turn that made calls (a result whose id is not among them sorts
    with the first call's, stably)."""
    turns: list[dict] = []
    order: dict[str, int] = {}
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("user", "tool"):
            if role == "tool":
                key = order.get(m.get("tool_call_id") or "", 0)
                block = (key, RESULT_BEGIN + _result_text(m.get("content")) + RESULT_END)
            else:
                block = (None, text_of(m.get("content")))
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "at": i, "blocks": [block]})
            continue
        if role == "assistant" and m.get("tool_calls"):
            order = {c.get("id"): j for j, c in enumerate(m["tool_calls"]) if c.get("id")}
        turns.append({**m, "at": i})
    for t in turns:
        if t["role"] == "user":
            results = iter(sorted((b for b in t["blocks"] if b[0] is not None), key=lambda b: b[0]))
            t["blocks"] = [(next(results) if b[0] is not None else b)[1] for b in t["blocks"]]
    return turns


def _result_text(content) -> str:
    """A tool result's text: its text parts joined by blank lines, as DeepSeek's encoder
    joins them."""
    if isinstance(content, list):
        parts = [p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]"
                 for p in content if isinstance(p, dict)]  # fmt: skip
        return "\n\n".join(parts)
    return text_of(content)


def _drop_thinking(turns: list[dict]) -> list[dict]:
    """Thinking mode without tools: before the last user turn, assistant turns lose their
    reasoning and developer turns are left out."""
    last_user = max((i for i, m in enumerate(turns) if m["role"] in ("user", "developer")),
                    default=-1)  # fmt: skip
    kept = []
    for i, m in enumerate(turns):
        if i < last_user and m["role"] == "developer":
            continue
        if i < last_user and m["role"] == "assistant":
            m = copy.copy(m)
            m.pop("reasoning_content", None)
            m.pop("reasoning", None)
        kept.append(m)
    return kept


def _tools_text(tools: list[dict]) -> str:
    return TOOLS_TEXT.format(d=DSML, fns=tool_schemas(tools), think=THINK_START,
                             end_think=THINK_END)  # fmt: skip
