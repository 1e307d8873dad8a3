"""One choice's answer, assembled in one place for streams and whole answers.

    engine Updates (text deltas, new ids, logprobs) ──▶ ChoiceOutput.feed(update)
        ├─▶ the chunk body of this update (what a stream sends; None: nothing to send)
        └─▶ the same pieces added to the totals that ChoiceOutput.final() reads

A stream sends what `feed` returns; a whole answer feeds the same updates and sends
`final()`. So the streamed chunks of a choice, put together, are its whole answer:
same text, same reasoning split, same tool calls, same logprobs.
`Formatter` turns token ids and logprob dicts into OpenAI's and vLLM's shapes; it
keeps each token's text once decoded (at most one entry per vocabulary id).
"""

from __future__ import annotations

from dataclasses import dataclass

from xllm_py.engine.engine_client import Update
from xllm_py.engine.tokenizer import Tokenizer
from xllm_py.sampling_params import SamplingParams


@dataclass
class Choice:
    """One engine request of an API request: prompt `prompt_index`, sample `index`."""

    index: int
    prompt_index: int
    req_id: str
    text: str | None  # the prompt's text (None: given as ids, or truncated)
    ids: list[int]
    sampling: SamplingParams


class Formatter:
    """Logprobs in the API's shapes. Thread-safe: it runs off the event loop too."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._strs: dict[int, str] = {}  # token id -> its text (bounded by the vocabulary)

    def token_str(self, tid: int) -> str:
        s = self._strs.get(tid)
        if s is None:
            if self.tokenizer is None:
                return f"token_id:{tid}"
            s = self._strs[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return s

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def completion_logprobs(self, lps: list[dict[int, float] | None], ids: list[int], offset: int):
        """OpenAI's completion `logprobs`, text offsets counted from `offset`; a None entry
        (the first prompt token under echo: nothing comes before it) has null logprobs."""
        tokens = [self.token_str(t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp[t] for lp, t in zip(lps, ids)],
            "top_logprobs": [
                None if lp is None else {self.token_str(k): v for k, v in lp.items()} for lp in lps
            ],
            "text_offset": offsets,
        }

    def chat_logprobs(self, lps: list[dict[int, float]], ids: list[int], top: int) -> list[dict]:
        """OpenAI's chat `logprobs.content` entries."""

        def entry(t, v):
            s = self.token_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return [
            entry(t, lp[t])
            | {
                "top_logprobs": [
                    entry(k, v) for k, v in sorted(lp.items(), key=lambda kv: -kv[1])[:top]
                ]
            }
            for lp, t in zip(lps, ids)
        ]

    @staticmethod
    def top(entry: dict[int, float], token: int, n: int) -> dict[int, float]:
        """`token`'s logprob, then the n largest of `entry` (which may hold more)."""
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
        return {token: entry[token]} | dict(best)

    def prompt_logprobs(self, ids: list[int], lps: list, ranks: list[int], n: int) -> list:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or
        {token id: {logprob, rank, decoded_token}}, the prompt's token first, then the top n."""
        out: list = [None]
        for entry, token, rank in zip(lps[1:], ids[1:], ranks):
            top = self.top(entry, token, n)
            out.append(
                {
                    str(t): {
                        "logprob": v,
                        "rank": rank if t == token else 1 + sum(w > v for w in top.values()),
                        "decoded_token": self.token_str(t),
                    }
                    for t, v in top.items()
                }
            )
        return out


class ChoiceOutput:
    """What both APIs keep per choice; chat.py and completions.py say how an update
    becomes a chunk (`delta`) and what the whole answer is (`final`)."""

    def __init__(self, choice: Choice, fmt: Formatter, prompt_logprobs: int | None) -> None:
        self.choice, self.fmt = choice, fmt
        self.want = choice.sampling.logprobs  # top logprobs per token (None: no logprobs)
        self.prompt_logprobs_n = prompt_logprobs  # vLLM's prompt_logprobs, if asked for
        self.tokens = 0  # output tokens so far
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.prompt_lps: tuple[list, list[int]] | None = None  # (logprobs, ranks)
        self.draft_tokens = self.accepted_tokens = 0  # speculation's totals so far

    @property
    def index(self) -> int:
        return self.choice.index

    def cost(self, u: Update) -> int:
        """About how many token decodes `feed(u)` makes (the caller moves large ones off
        the event loop)."""
        if self.want is None:
            return 0
        return (len(u.new_token_ids) + len(u.prompt_logprobs or ())) * (1 + self.want)

    def opening(self) -> dict | None:
        """The chunk a stream sends for this choice before any output (chat: the role)."""
        return None

    def feed(self, u: Update) -> dict | None:
        """Take in one update: the chunk body it makes, or None when there is nothing to
        send yet (all of it held back)."""
        self.tokens += len(u.new_token_ids)
        self.finish_reason, self.stop_reason = u.finish_reason, u.stop_reason
        self.draft_tokens, self.accepted_tokens = u.num_draft_tokens, u.num_accepted_tokens
        if u.prompt_logprobs is not None:
            self.prompt_lps = (u.prompt_logprobs, u.prompt_ranks or [])
        body = self.delta(u)
        if body is not None and u.finished:
            body["stop_reason"] = u.stop_reason
        return body

    def delta(self, u: Update) -> dict | None:
        raise NotImplementedError

    def final(self) -> dict:
        """The whole answer's entry in `choices`."""
        raise NotImplementedError

    def scored(self) -> list | None:
        """vLLM's `prompt_logprobs` of this choice's prompt, when asked for."""
        if self.prompt_logprobs_n is None or self.prompt_lps is None:
            return None
        lps, ranks = self.prompt_lps
        return self.fmt.prompt_logprobs(self.choice.ids, lps, ranks, self.prompt_logprobs_n)
