"""Tool calls, turned into OpenAI's `tool_calls` whole or streamed, in the format of the
model named by `--tool_call_parser`. Each writes its calls after any text it wants to
say first, in one section of calls:

    deepseek_v3   text<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                  ```json
                  {"arg": 1}
                  ```<｜tool▁call▁end｜>
                  <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME2 ...
                  <｜tool▁call▁end｜><｜tool▁calls▁end｜>
    deepseek_v31  text<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>
                  {"arg": 1}<｜tool▁call▁end｜>
                  <｜tool▁call▁begin｜>NAME2 ... <｜tool▁call▁end｜><｜tool▁calls▁end｜>
    kimi_k2       text<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
                  <|tool_call_argument_begin|>{"arg": 1}<|tool_call_end|>
                  <|tool_call_begin|>functions.NAME2:1 ...
                  <|tool_call_end|><|tool_calls_section_end|>
    deepseek_v32  DeepSeek-V3.2's DSML: XML-ish parameters (dsml.py)
    deepseek_v4   DeepSeek-V4's DSML: V3.2's, its section named `tool_calls` (dsml.py)

(only V3's fences hold line breaks: the others here are this page's, not the model's).
A `ToolCallFormat` holds what differs: the four markers; a call's header, from its begin
marker to its arguments; what V3 writes between the arguments and the call's end (the
closing fence); and the header's pieces in the grammar. Kimi-K2 names each call
`functions.NAME:IDX`: that is the OpenAI tool_call id, unchanged, so the tool result a
client sends back with that `tool_call_id` renders as the model wrote it (an id without
`functions.` names its function too). The DeepSeek formats carry no id; one is made
(`call_...`).

The markers are tokens of the model's tokenizer (the bundled model has DeepSeek-V3's too:
see tools/add_special_tokens.py); the parser works on the decoded text, so it also reads a
marker that arrives spelled out in several tokens.
`ToolCallStream` reads the text as it streams: content until the calls begin (a possible
partial marker held back), then for each call first its id and name, then its arguments
in fragments as they arrive (a possible start of what closes them held back), as OpenAI
streams them. `parse` is the same reader over a whole output, so a streamed answer and a
whole one always agree.

Text after the end of the section is dropped; a call whose header does not parse is
skipped up to its end marker; an output cut short inside a call keeps what arrived of its
arguments.

DeepSeek-V3.2's DSML does not fit a `ToolCallFormat` (its arguments are XML-ish
parameters): `dsml.py` reads it, with the same contract.

`tool_call_grammar` is the structural tag that makes the model's output a well-formed
call when `tool_choice` is "required" or names a function (structured/ compiles it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from xllm_py.formats.dsml import V4_CALLS, V32_CALLS, DsmlStream, dsml_section
from xllm_py.formats.reasoning import held_back
from xllm_py.formats.stream_reader import FN_NAME, StreamReader, ToolCall, const, new_call_id
from xllm_py.structured import json_schema_grammar

__all__ = ["PARSERS", "ToolCall", "new_call_id", "parse", "stream_for", "tool_call_grammar"]

# DeepSeek-V3's markers (V3.1 keeps them)
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN = "```json\n"
FENCE_CLOSE = "\n```"
# Kimi-K2's
KIMI_CALLS_BEGIN = "<|tool_calls_section_begin|>"
KIMI_CALLS_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
KIMI_ARGS_BEGIN = "<|tool_call_argument_begin|>"


def _token(text: str) -> dict:
    """A marker in the grammar: the token itself, not its spelling in pieces."""
    return {"type": "token", "token": text}


@dataclass(frozen=True)
class ToolCallFormat:
    """One model family's tool calls. `header` matches a call's start, from after its begin
    marker up to its arguments, with a group "name" and optionally "id" (the call's id as
    the model wrote it). It must match as soon as the whole header has arrived and then
    never differently as more text comes (no greedy tail), so that streamed and whole
    outputs read the same; a header without a match once the call ends is malformed."""

    calls_begin: str
    calls_end: str
    call_begin: str
    call_end: str
    header: re.Pattern
    grammar_header: Callable[[str], list[dict]]  # NAME -> what precedes the arguments
    args_end: str = ""  # between the arguments and call_end, not part of them
    separator: str = ""  # between calls, in the grammar (the reader skips whitespace)


FORMATS = {
    "deepseek_v3": ToolCallFormat(
        CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END,
        re.compile(r"[^<\n]*" + re.escape(SEP) + r"(?P<name>[^\n]*)\n```(?:json)?\n"),
        lambda name: [const("function"), _token(SEP), const(name + "\n" + FENCE_OPEN)],
        args_end=FENCE_CLOSE, separator="\n",
    ),
    "deepseek_v31": ToolCallFormat(
        CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END,
        re.compile(r"\s*(?P<name>" + FN_NAME + r")\s*" + re.escape(SEP)),
        lambda name: [const(name), _token(SEP)],
    ),
    "kimi_k2": ToolCallFormat(
        KIMI_CALLS_BEGIN, KIMI_CALLS_END, KIMI_CALL_BEGIN, KIMI_CALL_END,
        re.compile(r"\s*(?P<id>(?:functions\.)?(?P<name>" + FN_NAME + r"):\d+)\s*"
                   + re.escape(KIMI_ARGS_BEGIN)),
        # IDX counts the calls of the conversation; four digits bound a runaway
        lambda name: [const(f"functions.{name}:"), {"type": "regex", "pattern": "[0-9]{1,4}"},
                      _token(KIMI_ARGS_BEGIN)],
    ),
}  # fmt: skip
DSML_PARSERS = {"deepseek_v32": V32_CALLS, "deepseek_v4": V4_CALLS}  # their section's tag
PARSERS = (*FORMATS, *DSML_PARSERS)


@dataclass
class ToolCallStream(StreamReader):
    """Reads one choice's streamed text; `feed` returns OpenAI delta fields for it."""

    parallel: bool = True  # False: only the first call is kept (parallel_tool_calls=false)
    fmt: ToolCallFormat = FORMATS["deepseek_v3"]
    text: str = ""
    pos: int = 0  # text before pos is handled
    state: str = "content"  # content | calls | header | arguments | skip | done
    calls: list[ToolCall] = field(default_factory=list)
    sent_args: int = 0  # characters of the current call's arguments already handed out

    def _steps(self, final: bool, content: list[str], calls: list[dict]) -> dict:
        return {
            "content": lambda rest: self._content(rest, final, content),
            "calls": lambda rest: self._between_calls(rest, final),
            "header": lambda rest: self._header(rest, final, calls),
            "arguments": lambda rest: self._arguments(rest, final, calls),
            "skip": lambda rest: self._arguments(rest, final, calls),
        }

    def _content(self, rest: str, final: bool, content: list[str]) -> bool:
        """Text before the calls begin (a possible partial marker held back)."""
        begin = self.fmt.calls_begin
        i = rest.find(begin)
        if i >= 0:
            content.append(rest[:i])
            self.pos += i + len(begin)
            self.state = "calls"
            return True
        keep = 0 if final else held_back(rest, begin)
        content.append(rest[: len(rest) - keep])
        self.pos += len(rest) - keep
        return False

    def _between_calls(self, rest: str, final: bool) -> bool:
        """After the calls began or a call ended: the next call, or the end of the calls."""
        begin, end = self.fmt.call_begin, self.fmt.calls_end
        stripped = rest.lstrip()
        if stripped.startswith(begin):
            self.pos += len(rest) - len(stripped) + len(begin)
            self.state = "header"
            return True
        if stripped.startswith(end) or (
            final or not (begin.startswith(stripped) or end.startswith(stripped))
        ):
            self.state = "done"  # the calls ended (or something else began)
        return False

    def _header(self, rest: str, final: bool, calls: list[dict]) -> bool:
        """The call's header: a new call (or one skipped)."""
        m = self.fmt.header.match(rest)
        if m:
            self.pos += m.end()
            if not (self.parallel or not self.calls):
                self.state = "skip"
                return True
            call = ToolCall(m.groupdict().get("id") or new_call_id(), m.group("name").strip())
            self._new_call(call, calls)
            self.state, self.sent_args = "arguments", 0
            return True
        return self._skip_malformed(rest, final, self.fmt.call_end)

    def _arguments(self, rest: str, final: bool, calls: list[dict]) -> bool:
        """The current call's arguments as they arrive (a possible start of what closes
        them held back); in state "skip" (a call not kept) they are read and dropped."""
        close, call_end = self.fmt.args_end, self.fmt.call_end
        end = rest.find(call_end)
        if end >= 0:
            args = rest[:end]
            if close and args.endswith(close):
                args = args[: -len(close)]
            self.pos += end + len(call_end)
        else:
            keep = 0 if final else held_back(rest, close + call_end)
            args = rest[: len(rest) - keep]
        if self.state == "arguments" and len(args) > self.sent_args:
            fragment = args[self.sent_args :]
            self.calls[-1].arguments += fragment
            calls.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})
            self.sent_args = len(args)
        if end >= 0:
            self.state = "calls"
            return True
        if final:
            self.state = "done"
        return False


def stream_for(parser: str, parallel: bool = True) -> StreamReader:
    """The reader of `parser`'s format (a name in PARSERS: --tool_call_parser)."""
    if parser in DSML_PARSERS:
        return DsmlStream(parallel, DSML_PARSERS[parser])
    return ToolCallStream(parallel, FORMATS[parser])


def parse(
    text: str, parallel: bool = True, parser: str = "deepseek_v3"
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; content None when there is none."""
    stream = stream_for(parser, parallel)
    content = stream.feed(text, final=True).get("content")
    return content, stream.calls


def tool_call_grammar(
    tools: list[dict], only: str | None, parallel: bool, parser: str = "deepseek_v3"
) -> str:
    """xgrammar structural tag (JSON text): the output is a section of calls in `parser`'s
    format, one or more calls (only to `only` when a function is named, just one when
    not `parallel` or when named), each to a declared function with arguments that follow
    its `parameters` schema. The markers must be the tokens themselves, not their
    spelling in pieces (a tokenizer without them cannot compile it); DSML's are text
    (dsml.py's `dsml_section`)."""
    fns = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    single = only is not None or not parallel
    if parser in DSML_PARSERS:
        section = dsml_section(fns, single, DSML_PARSERS[parser])
        return json.dumps({"type": "structural_tag", "format": section}, ensure_ascii=False)
    fmt = FORMATS[parser]

    def call(fn: dict) -> dict:
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        arguments = {"type": "grammar", "grammar": json_schema_grammar(json.dumps(schema), True)}
        elements = [*fmt.grammar_header(fn["name"]), arguments]
        if fmt.args_end:
            elements.append(const(fmt.args_end))
        return {
            "type": "tag",
            "begin": _token(fmt.call_begin),
            "content": {"type": "sequence", "elements": elements},
            "end": _token(fmt.call_end),
        }

    body = {
        "type": "tags_with_separator",
        "tags": [call(fn) for fn in fns],
        "separator": fmt.separator,
        "at_least_one": True,
        "stop_after_first": single,
    }
    section = {
        "type": "tag",
        "begin": _token(fmt.calls_begin),
        "content": body,
        "end": _token(fmt.calls_end),
    }
    return json.dumps({"type": "structural_tag", "format": section}, ensure_ascii=False)
