"""The reasoning split (`--reasoning_parser`): the model thinks in `<think> ... </think>`
before it answers; a chat answer carries the thinking as `message.reasoning_content`
(`delta.reasoning_content` when streaming) and the rest as `content`, as vLLM and
DeepSeek's own API return it. The parsers differ in when a request thinks and where the
thinking ends:

    deepseek_r1   always thinks; the thinking ends at `</think>`
    deepseek_v3   DeepSeek-V3.1's and V3.2's hybrid thinking: only a request whose
                  chat_template_kwargs set `thinking` (or `enable_thinking`) true thinks,
                  as only then does V3.1's template (V3.2's encoding: encoding_dsv32.py,
                  which asks `thinks` the same question) open `<think>` in the prompt;
                  any other answer is all content, `</think>` or not
    kimi_k2       Kimi-K2-Thinking: thinks unless `thinking` (or `enable_thinking`) is
                  false; the thinking ends at `</think>` or where a section of tool calls
                  begins (the model may call tools before it closes its thinking: the
                  marker and what follows are content, where the tool-call reader finds it)

`thinks` says whether a request thinks from its chat_template_kwargs. A thinking output
usually has only the closing tag (R1's template opens `<think>` in the prompt from
R1-0528 on, V3.1's when thinking): everything before `</think>` is reasoning, a leading
`<think>` (older templates; Kimi writes its own) is dropped, and an output that never
closes its thinking (cut short by max_tokens) is all reasoning with no content. The split
works on text, so it holds whether the tags are special tokens or spelled out in several
tokens; streamed text that could still become an end of the thinking is held back until
it cannot. Under the parser a structured-output grammar applies after `</think>` only
(`structured.after_reasoning`) in a request that thinks (one that does not has no
`</think>` to wait for), and tool calls are read from the answer.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
KIMI_TOOLS = "<|tool_calls_section_begin|>"  # tool_parser.py's KIMI_CALLS_BEGIN
PARSERS = ("deepseek_r1", "deepseek_v3", "kimi_k2")
THINKING_KWARGS = ("thinking", "enable_thinking")  # chat_template_kwargs that switch it


def thinks(parser: str, template_kwargs: dict | None) -> bool:
    """Whether a request with these chat_template_kwargs thinks under `parser`: R1
    always; V3.1 when one of THINKING_KWARGS is true (its template's default is off);
    Kimi-K2 unless one is false. Truthiness as the template's `{% if thinking %}`."""
    given = [bool(v) for k, v in (template_kwargs or {}).items() if k in THINKING_KWARGS]
    if parser == "deepseek_v3":
        return any(given)
    if parser == "kimi_k2":
        return all(given)
    return True


def splitter_for(parser: str, template_kwargs: dict | None) -> StreamSplitter:
    """The stream splitter of one request's answer under `parser` (a name in PARSERS)."""
    return StreamSplitter(
        thinks(parser, template_kwargs), KIMI_TOOLS if parser == "kimi_k2" else None
    )


def split(
    text: str, thinking: bool = True, tools_begin: str | None = None
) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output (the arguments: StreamSplitter's);
    reasoning None when the request does not think, content None when the output never
    left its thinking or left nothing after it."""
    if not thinking:
        return None, text or None
    s = StreamSplitter(thinking, tools_begin)
    reasoning, content = s.feed(text, final=True)
    return reasoning, (content or None) if s.done_thinking else None


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: what a
    stream must hold back because the next delta could complete the marker (also used by
    tool_parser.py)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class StreamSplitter:
    """Splits streamed text deltas into (reasoning delta, content delta)."""

    def __init__(self, thinking: bool = True, tools_begin: str | None = None) -> None:
        """thinking: False, all of it is content; tools_begin: a marker that also ends
        the thinking, kept as the content's start (Kimi-K2's section of tool calls)."""
        self.ends = (END,) if tools_begin is None else (END, tools_begin)
        self.pending = ""  # text not yet handed out (a possible start of a tag)
        self.seen_start = False  # a leading <think> was consumed (or ruled out)
        self.done_thinking = not thinking

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content text this delta completes; `final` flushes what was
        held back (the output ended)."""
        if self.done_thinking:
            return "", delta
        text = self.pending + delta
        if not self.seen_start:
            if START.startswith(text) and not final:
                self.pending = text  # might still be the opening tag
                return "", ""
            self.seen_start = True
            if text.startswith(START):
                text = text[len(START) :]
        found = [(i, end) for end in self.ends if (i := text.find(end)) >= 0]
        if found:
            i, end = min(found)
            self.pending, self.done_thinking = "", True
            after = i + len(end) if end == END else i  # a tool section stays in the content
            return text[:i], text[after:]
        hold = 0 if final else max(held_back(text, end) for end in self.ends)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], ""
