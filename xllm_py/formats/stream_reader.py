"""What every tool-call format's reader shares (tool_parser.py's formats, dsml.py's DSML):
the call record, the streaming state machine's frame, and the grammar's constant piece."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

FN_NAME = r"[\w.\-]+"  # a function's name: the API admits [A-Za-z0-9_.-] (openai_protocol.py)


def const(text: str) -> dict:
    return {"type": "const_string", "value": text}


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


class StreamReader:
    """What the readers share (`calls`: the calls read so far, `parallel`: whether more
    than the first is kept): `feed` runs the reader's state machine (`_steps`: a step
    per state, each handling what it can of the unread text, True when it changed the
    state) over the text so far, and returns the OpenAI delta fields that came of it."""

    text: str
    pos: int  # text before pos is handled
    state: str
    calls: list[ToolCall]
    parallel: bool

    def _steps(self, final: bool, content: list[str], calls: list[dict]) -> dict:
        raise NotImplementedError

    def feed(self, delta: str, final: bool = False) -> dict:
        """The delta fields ("content" and/or "tool_calls") that `delta` completes;
        `final` flushes what was held back (the output ended)."""
        self.text += delta
        content: list[str] = []
        calls: list[dict] = []
        step = self._steps(final, content, calls)
        while self.state in step and step[self.state](self.text[self.pos :]):
            pass
        out: dict = {}
        if "".join(content):
            out["content"] = "".join(content)
        if calls:
            out["tool_calls"] = _merge(calls)
        return out

    def _new_call(self, call: ToolCall, calls: list[dict]) -> None:
        """A call whose header arrived: kept, and its id and name handed out."""
        self.calls.append(call)
        function = {"name": call.name, "arguments": ""}
        index = len(self.calls) - 1
        calls.append({"index": index, "id": call.id, "type": "function", "function": function})

    def _skip_malformed(self, rest: str, final: bool, end: str) -> bool:
        """A call whose header does not parse: skipped up to its `end` marker."""
        i = rest.find(end)
        if i >= 0:
            self.pos += i + len(end)
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
