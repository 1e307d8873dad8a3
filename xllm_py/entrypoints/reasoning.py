"""The reasoning split of DeepSeek-R1 (`--reasoning_parser=deepseek_r1`): the model thinks
in `<think> ... </think>` before it answers; a chat answer carries the thinking as
`message.reasoning_content` (`delta.reasoning_content` when streaming) and the rest as
`content`, as vLLM and DeepSeek's own API return it.

R1's chat template opens `<think>` in the prompt itself (from R1-0528 on), so the output
usually has only the closing tag: everything before `</think>` is reasoning, a leading
`<think>` (older templates) is dropped, and an output that never closes its thinking
(cut short by max_tokens) is all reasoning with no content. The split works on text, so
it holds whether the tags are special tokens or spelled out in several tokens; streamed
text that could still become `</think>` is held back until it cannot. Under the parser a
structured-output grammar applies after `</think>` only (`structured.after_reasoning`),
and tool calls are read from the answer.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1",)


def split(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output."""
    if text.startswith(START):
        text = text[len(START) :]
    if END not in text:
        return text, None
    reasoning, content = text.split(END, 1)
    return reasoning, content or None


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

    def __init__(self) -> None:
        self.pending = ""  # text not yet handed out (a possible start of a tag)
        self.seen_start = False  # a leading <think> was consumed (or ruled out)
        self.done_thinking = False

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
        if END in text:
            reasoning, content = text.split(END, 1)
            self.pending, self.done_thinking = "", True
            return reasoning, content
        hold = 0 if final else held_back(text, END)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], ""
