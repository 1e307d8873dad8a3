"""Tool calls in DeepSeek-V3's format (`--tool_call_parser=deepseek_v3`), turned into
OpenAI's `tool_calls`, whole or streamed.

DeepSeek-V3 writes its calls after any text it wants to say first:

    text<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": 1}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME2 ... <｜tool▁call▁end｜><｜tool▁calls▁end｜>

The markers are tokens of its tokenizer (the bundled model has them too: see
tools/add_special_tokens.py); the parser works on the decoded text, so it also reads a
marker that arrives spelled out in several tokens. `ToolCallStream` reads the text as it
streams: content until the calls begin (a possible partial marker held back), then for
each call first its id and name, then its arguments in fragments as they arrive (a
possible start of the closing fence held back), as OpenAI streams them. `parse` is the
same reader over a whole output, so a streamed answer and a whole one always agree.

Text after `<｜tool▁calls▁end｜>` is dropped; a call whose header does not parse is
skipped; an output cut short inside a call keeps what arrived of its arguments.

`tool_call_grammar` is the structural tag that makes the model's output a well-formed
call when `tool_choice` is "required" or names a function (structured/ compiles it).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from xllm_py.entrypoints.reasoning import held_back
from xllm_py.structured import json_schema_grammar

PARSERS = ("deepseek_v3",)
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN = "```json\n"
FENCE_CLOSE = "\n```"
_HEADER = re.compile(r"([^<\n]*)" + re.escape(SEP) + r"([^\n]*)\n```(?:json)?\n")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolCallStream:
    """Reads one choice's streamed text; `feed` returns OpenAI delta fields for it."""

    parallel: bool = True  # False: only the first call is kept (parallel_tool_calls=false)
    text: str = ""
    pos: int = 0  # text before pos is handled
    state: str = "content"  # content | calls | header | arguments | done
    calls: list[ToolCall] = field(default_factory=list)
    sent_args: int = 0  # characters of the current call's arguments already handed out

    def feed(self, delta: str, final: bool = False) -> dict:
        """The delta fields ("content" and/or "tool_calls") that `delta` completes;
        `final` flushes what was held back (the output ended)."""
        self.text += delta
        content: list[str] = []
        calls: list[dict] = []
        step = {
            "content": lambda rest: self._content(rest, final, content),
            "calls": lambda rest: self._between_calls(rest, final),
            "header": lambda rest: self._header(rest, final, calls),
            "arguments": lambda rest: self._arguments(rest, final, calls),
            "skip": lambda rest: self._arguments(rest, final, calls),
        }
        # each step handles what it can of the rest; True: the state changed, go on
        while self.state in step and step[self.state](self.text[self.pos :]):
            pass
        out: dict = {}
        if "".join(content):
            out["content"] = "".join(content)
        if calls:
            out["tool_calls"] = _merge(calls)
        return out

    def _content(self, rest: str, final: bool, content: list[str]) -> bool:
        """Text before the calls begin (a possible partial marker held back)."""
        i = rest.find(CALLS_BEGIN)
        if i >= 0:
            content.append(rest[:i])
            self.pos += i + len(CALLS_BEGIN)
            self.state = "calls"
            return True
        keep = 0 if final else held_back(rest, CALLS_BEGIN)
        content.append(rest[: len(rest) - keep])
        self.pos += len(rest) - keep
        return False

    def _between_calls(self, rest: str, final: bool) -> bool:
        """After the calls began or a call ended: the next call, or the end of the calls."""
        stripped = rest.lstrip("\n")
        if stripped.startswith(CALL_BEGIN):
            self.pos += len(rest) - len(stripped) + len(CALL_BEGIN)
            self.state = "header"
            return True
        if stripped.startswith(CALLS_END) or (
            final or not (CALL_BEGIN.startswith(stripped) or CALLS_END.startswith(stripped))
        ):
            self.state = "done"  # the calls ended (or something else began)
        return False

    def _header(self, rest: str, final: bool, calls: list[dict]) -> bool:
        """`function<sep>NAME` and the opening fence: a new call (or one skipped)."""
        m = _HEADER.match(rest)
        if m:
            self.pos += m.end()
            if not (self.parallel or not self.calls):
                self.state = "skip"
                return True
            call = ToolCall(new_call_id(), m.group(2).strip())
            self.calls.append(call)
            function = {"name": call.name, "arguments": ""}
            index = len(self.calls) - 1
            calls.append({"index": index, "id": call.id, "type": "function", "function": function})
            self.state, self.sent_args = "arguments", 0
            return True
        end = rest.find(CALL_END)
        if end >= 0:  # a call whose header does not parse: skipped
            self.pos += end + len(CALL_END)
            self.state = "calls"
            return True
        if final:
            self.state = "done"
        return False

    def _arguments(self, rest: str, final: bool, calls: list[dict]) -> bool:
        """The current call's arguments as they arrive (a possible start of the closing
        fence held back); in state "skip" (a call not kept) they are read and dropped."""
        end = rest.find(CALL_END)
        if end >= 0:
            args = rest[:end]
            if args.endswith(FENCE_CLOSE):
                args = args[: -len(FENCE_CLOSE)]
            self.pos += end + len(CALL_END)
        else:
            keep = 0 if final else held_back(rest, FENCE_CLOSE + CALL_END)
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


def _merge(deltas: list[dict]) -> list[dict]:
    """Consecutive fragments of one call's arguments, within one chunk, as one (the
    fragment with the id and name stays apart, its arguments "")."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"] and "id" not in d and "id" not in out[-1]:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append({**d, "function": dict(d["function"])})
    return out


def parse(text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; content None when there is none."""
    stream = ToolCallStream(parallel=parallel)
    content = stream.feed(text, final=True).get("content")
    return content, stream.calls


def tool_call_grammar(tools: list[dict], only: str | None, parallel: bool) -> str:
    """xgrammar structural tag (JSON text): the output is `<｜tool▁calls▁begin｜>`, one
    or more calls (only to `only` when a function is named, just one when not
    `parallel` or when named), each to a declared function with arguments that follow
    its `parameters` schema, and `<｜tool▁calls▁end｜>`. The markers must be the tokens
    themselves, not their spelling in pieces."""

    def token(text: str) -> dict:
        return {"type": "token", "token": text}

    def call(fn: dict) -> dict:
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        return {
            "type": "tag",
            "begin": token(CALL_BEGIN),
            "content": {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": "function"},
                    token(SEP),
                    {"type": "const_string", "value": fn["name"] + "\n" + FENCE_OPEN},
                    {"type": "grammar", "grammar": json_schema_grammar(json.dumps(schema), True)},
                    {"type": "const_string", "value": FENCE_CLOSE},
                ],
            },
            "end": token(CALL_END),
        }

    fns = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    body = {
        "type": "tags_with_separator",
        "tags": [call(fn) for fn in fns],
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": only is not None or not parallel,
    }
    fmt = {"type": "tag", "begin": token(CALLS_BEGIN), "content": body, "end": token(CALLS_END)}
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
