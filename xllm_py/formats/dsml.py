"""DeepSeek-V3.2's and V4's tool calls, in DSML, read into OpenAI's `tool_calls` whole or
streamed (`--tool_call_parser=deepseek_v32` / `deepseek_v4`; tool_parser.py dispatches
here). V3.2's, as below; V4 names the section `tool_calls` where V3.2 has `function_calls`
and is the same otherwise:

    text\n\n<｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    <｜DSML｜invoke name="NAME2"> ... </｜DSML｜invoke>
    </｜DSML｜function_calls>

DeepSeek-V3.2's DSML (DeepSeek's `encoding/encoding_dsv32.py`; encoding_dsv32.py here
writes it into prompts) does not fit a `ToolCallFormat`: a call's arguments are XML-ish
parameters, not JSON. `DsmlStream` reads it with the same contract as `ToolCallStream`
and turns the parameters into JSON arguments in their order: a `string="true"` value is
raw text (a JSON string of it), a `string="false"` value is JSON as written (text that
does not parse as JSON is taken as a string, so the arguments stay JSON). They stream as
JSON fragments: `{"city": "` on the parameter's header, the raw text escaped as it
arrives, `", "days": ` ... a JSON value once its end tag came, `}` at the invoke's end.
The `\n\n` DSML puts before the calls is not content. An invoke whose header does not
parse is skipped, and so are a parameter whose header does not parse and one named a
second time (the first stays).

`dsml_section` is the grammar's part: the structural tag of a section of DSML calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from xllm_py.formats.reasoning import held_back
from xllm_py.formats.stream_reader import (
    FN_NAME,
    StreamReader,
    ToolCall,
    const,
    new_call_id,
)

# DeepSeek-V3.2's DSML tags (text: the grammar and the reader need no token of them)
DSML = "｜DSML｜"
# The section's tag: V3.2's `function_calls`, DeepSeek-V4's `tool_calls` (the rest is one
# grammar: --tool_call_parser deepseek_v32 / deepseek_v4)
V32_CALLS, V4_CALLS = "function_calls", "tool_calls"
DSML_CALLS_BEGIN = f"<{DSML}{V32_CALLS}>"
DSML_CALLS_END = f"</{DSML}{V32_CALLS}>"


def calls_tags(block: str) -> tuple[str, str]:
    """The opening and closing tags of a section of calls named `block`."""
    return f"<{DSML}{block}>", f"</{DSML}{block}>"


DSML_INVOKE = f"<{DSML}invoke"  # then ` name="NAME">`
DSML_INVOKE_END = f"</{DSML}invoke>"
DSML_PARAM = f"<{DSML}parameter"  # then ` name="KEY" string="true|false">`
DSML_PARAM_END = f"</{DSML}parameter>"
DSML_LEAD = "\n\n"  # what DSML writes between the text and the calls
_INVOKE_HEADER = re.compile(r'\s+name="(?P<name>' + FN_NAME + r')"\s*>')
_PARAM_HEADER = re.compile(r'\s+name="(?P<key>[^"<>]+)"\s+string="(?P<string>true|false)"\s*>')


@dataclass
class DsmlStream(StreamReader):
    """Reads one choice's streamed DSML (DeepSeek-V3.2); `feed` returns OpenAI delta fields
    for it, as `ToolCallStream.feed` does."""

    parallel: bool = True  # False: only the first call is kept (parallel_tool_calls=false)
    block: str = V32_CALLS  # the section's tag name (V4_CALLS for DeepSeek-V4)
    text: str = ""
    pos: int = 0  # text before pos is handled
    # content | calls | invoke | params | param | value | skip_param | skip | done
    state: str = "content"
    calls: list[ToolCall] = field(default_factory=list)
    keep: bool = False  # the current invoke is a call handed out (not skipped)
    keys: set[str] = field(default_factory=set)  # the current call's parameters so far
    raw: bool = False  # the current value is string="true" (raw text)

    def _steps(self, final: bool, content: list[str], calls: list[dict]) -> dict:
        return {
            "content": lambda rest: self._content(rest, final, content),
            "calls": lambda rest: self._between_calls(rest, final),
            "invoke": lambda rest: self._invoke(rest, final, calls),
            "params": lambda rest: self._params(rest, final, calls),
            "param": lambda rest: self._param(rest, final, calls),
            "value": lambda rest: self._value(rest, final, calls),
            "skip_param": lambda rest: self._skip(rest, final, DSML_PARAM_END, "params"),
            "skip": lambda rest: self._skip(rest, final, DSML_INVOKE_END, "calls"),
        }

    def _content(self, rest: str, final: bool, content: list[str]) -> bool:
        """Text before the calls (a possible start of `\n\n` and the marker held back)."""
        begin = calls_tags(self.block)[0]
        i = rest.find(begin)
        if i >= 0:
            content.append(rest[:i].removesuffix(DSML_LEAD))
            self.pos += i + len(begin)
            self.state = "calls"
            return True
        keep = 0
        if not final:
            keep = max(held_back(rest, begin), held_back(rest, DSML_LEAD + begin))
        content.append(rest[: len(rest) - keep])
        self.pos += len(rest) - keep
        return False

    def _between_calls(self, rest: str, final: bool) -> bool:
        """After the calls began or an invoke ended: the next invoke, or the end."""
        stripped = rest.lstrip()
        if stripped.startswith(DSML_INVOKE):
            self.pos += len(rest) - len(stripped) + len(DSML_INVOKE)
            self.state = "invoke"
            return True
        end = calls_tags(self.block)[1]
        pending = DSML_INVOKE.startswith(stripped) or end.startswith(stripped)
        if stripped.startswith(end) or final or not pending:
            self.state = "done"  # the calls ended (or something else began)
        return False

    def _invoke(self, rest: str, final: bool, calls: list[dict]) -> bool:
        """An invoke's header: a new call (or one skipped)."""
        m = _INVOKE_HEADER.match(rest)
        if m:
            self.pos += m.end()
            self.keep, self.keys = self.parallel or not self.calls, set()
            self.state = "params" if self.keep else "skip"
            if self.keep:
                self._new_call(ToolCall(new_call_id(), m.group("name")), calls)
            return True
        return self._skip_malformed(rest, final, DSML_INVOKE_END)

    def _params(self, rest: str, final: bool, calls: list[dict]) -> bool:
        """Inside an invoke, between parameters: the next one, or the invoke's end."""
        stripped = rest.lstrip()
        lead = len(rest) - len(stripped)
        if stripped.startswith(DSML_PARAM):
            self.pos += lead + len(DSML_PARAM)
            self.state = "param"
            return True
        if stripped.startswith(DSML_INVOKE_END):
            self.pos += lead + len(DSML_INVOKE_END)
            self._emit("}" if self.keys else "{}", calls)
            self.state = "calls"
            return True
        return self._past_junk(rest, final)

    def _param(self, rest: str, final: bool, calls: list[dict]) -> bool:
        """A parameter's header: its key (a second one of a name is skipped)."""
        m = _PARAM_HEADER.match(rest)
        if m:
            self.pos += m.end()
            key, self.raw = m.group("key"), m.group("string") == "true"
            if key in self.keys:
                self.state = "skip_param"
                return True
            head = ", " if self.keys else "{"
            self.keys.add(key)
            self._emit(head + json.dumps(key, ensure_ascii=False) + ": " + '"' * self.raw, calls)
            self.state = "value"
            return True
        return self._past_junk(rest, final, header=True)

    def _past_junk(self, rest: str, final: bool, header: bool = False) -> bool:
        """Text inside an invoke that is not a parameter: stray text between parameters,
        skipped up to the next parameter or the invoke's end; or (`header`) a parameter
        whose header does not parse, skipped past its end tag. Then state "params"."""
        tags = (DSML_PARAM_END if header else DSML_PARAM, DSML_INVOKE_END)
        found = [(i, tag) for tag in tags if (i := rest.find(tag)) >= 0]
        if not found:  # (not yet: the text might still become a tag)
            if final:
                self.state = "done"
            return False
        i, tag = min(found)
        self.pos += i + (len(tag) if tag == DSML_PARAM_END else 0)
        self.state = "params"
        return True

    def _value(self, rest: str, final: bool, calls: list[dict]) -> bool:
        """A parameter's value: raw text escaped as it arrives (a possible start of its end
        tag held back), a JSON value once whole."""
        end = rest.find(DSML_PARAM_END)
        if end < 0 and not self.raw:
            if final:  # cut short: what arrived, as it is
                self._emit(rest, calls)
                self.state = "done"
            return False
        if end >= 0:
            value = rest[:end]
            self.pos += end + len(DSML_PARAM_END)
        else:
            keep = 0 if final else held_back(rest, DSML_PARAM_END)
            value = rest[: len(rest) - keep]
            self.pos += len(value)
        if self.raw:
            self._emit(json.dumps(value, ensure_ascii=False)[1:-1] + '"' * (end >= 0), calls)
        else:
            self._emit(_json_value(value), calls)
        if end >= 0:
            self.state = "params"
            return True
        if final:
            self.state = "done"
        return False

    def _skip(self, rest: str, final: bool, end_tag: str, after: str) -> bool:
        """What is not handed out (a repeated parameter, a call past the first when not
        parallel), up to its end tag; then state `after`."""
        end = rest.find(end_tag)
        if end >= 0:
            self.pos += end + len(end_tag)
            self.state = after
            return True
        if final:
            self.state = "done"
        return False

    def _emit(self, fragment: str, calls: list[dict]) -> None:
        """A fragment of the current call's arguments (nothing for a skipped call)."""
        if self.keep and fragment:
            self.calls[-1].arguments += fragment
            calls.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})


def _json_value(text: str) -> str:
    """A string="false" value as JSON: the text as written (stripped) when it is JSON,
    else a JSON string of it (NaN and Infinity are not JSON)."""

    def refuse(name: str):
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=refuse)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)
    return text.strip()


def dsml_section(fns: list[dict], single: bool, block: str = V32_CALLS) -> dict:
    """DSML calls as DeepSeek's encoder writes them (`\n\n`, the calls' tag, one invoke a
    line, one parameter a line), each invoke's parameters following its function's
    schema: xgrammar's `deepseek_xml` style of a JSON schema, the same mapping the
    encoder makes. A string property is a `string="true"` parameter (raw text, its
    length, enum and pattern enforced), any other a `string="false"` one holding JSON;
    properties in the schema's order, the required ones present, no others. That mapping
    rather than one simpler for the grammar (every value JSON under string="false")
    because it is the text the model was trained on, so the grammar bends its output
    least; it reads back to the same arguments either way. One whitespace character at
    most between the pieces, as the encoder writes them: a weak model cannot pad its
    output with blanks. The tags are text, not tokens: DeepSeek-V3.2's tokenizer spells
    them in ordinary tokens, and a tokenizer that has them as tokens still matches."""

    def invoke(fn: dict) -> dict:
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        return {
            "type": "tag",
            "begin": f'{DSML_INVOKE} name="{fn["name"]}">\n',
            "content": {
                "type": "json_schema",
                "json_schema": schema,
                "style": "deepseek_xml",
                "max_whitespace_cnt": 1,
            },
            "end": DSML_INVOKE_END + "\n",
        }

    body = {
        "type": "tags_with_separator",
        "tags": [invoke(fn) for fn in fns],
        "separator": "",  # each invoke's end tag brings its line break
        "at_least_one": True,
        "stop_after_first": single,
    }
    begin, end = calls_tags(block)
    return {"type": "sequence", "elements": [const(DSML_LEAD + begin + "\n"), body, const(end)]}
