"""POST /v1/completions: text or token-id prompts (one or a batch), n choices each.

With `echo` the prompt comes first: its text, and with `logprobs` its tokens' entries
(the first null), in the choice's first chunk; with vLLM's `prompt_logprobs` each choice
of a whole answer carries its prompt's logprobs.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from xllm_py.engine.engine_client import Update
from xllm_py.entrypoints.choice_output import Choice, ChoiceOutput, Formatter
from xllm_py.entrypoints.openai_protocol import CompletionRequest
from xllm_py.entrypoints.serving import Answer, OpenAIServer


class CompletionChoice(ChoiceOutput):
    def __init__(self, choice: Choice, fmt: Formatter, req: CompletionRequest) -> None:
        super().__init__(choice, fmt, req.prompt_logprobs)
        self.echo_pending = req.echo  # the prompt goes first, in the first chunk
        self.text: list[str] = []
        self.offset = 0  # text offset of the next logprobs token
        self.logprobs: dict[str, list] | None = None
        if self.want is not None:
            self.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
            self.logprobs["text_offset"] = []

    def cost(self, u: Update) -> int:
        return super().cost(u) + (len(self.choice.ids) if self.echo_pending else 0)

    def _echoed(self, prompt_lps: list | None) -> tuple[str, list | None]:
        """Echo's prefix: the prompt's text and, when logprobs were asked for, its tokens'
        logprob entries (the first None)."""
        c = self.choice
        text = c.text if c.text is not None else self.fmt.decode(c.ids)
        if self.want is None or prompt_lps is None:
            return text, None
        tops = [self.fmt.top(e, t, self.want) for e, t in zip(prompt_lps[1:], c.ids[1:])]
        return text, [None, *tops]

    def delta(self, u: Update) -> dict | None:
        delta, new_lps, new_ids = u.delta_text, u.new_logprobs, u.new_token_ids
        if self.echo_pending:
            self.echo_pending = False
            echo_text, echo_lps = self._echoed(u.prompt_logprobs)
            delta = echo_text + delta
            if echo_lps is not None:
                new_lps, new_ids = echo_lps + (new_lps or []), self.choice.ids + new_ids
        if not delta and not u.finished and not new_lps:
            return None
        lp = None
        if self.logprobs is not None and new_lps:
            lp = self.fmt.completion_logprobs(new_lps, new_ids, self.offset)
            self.offset += sum(len(t) for t in lp["tokens"])
            for key, values in lp.items():
                self.logprobs[key] += values
        self.text.append(delta)
        finish = u.finish_reason
        return {"index": self.index, "logprobs": lp, "finish_reason": finish, "text": delta}

    def final(self) -> dict:
        entry = {
            "index": self.index,
            "finish_reason": self.finish_reason,
            "text": "".join(self.text),
            "logprobs": self.logprobs,
        }
        scored = self.scored()
        if scored is not None:
            entry["prompt_logprobs"] = scored
        entry["stop_reason"] = self.stop_reason
        return entry


async def serve_completion(server: OpenAIServer, request: Request) -> Response:
    req = await server.read_body(request, CompletionRequest)
    server.admit(0)  # draining or dead: refuse before tokenizing anything
    structured = await server.structured(req)
    prompts = req.prompts()
    choices = await server.run_blocking(
        server.choices, req, prompts, req.max_tokens, req.logprobs, structured
    )
    server.admit(len(choices))  # each choice (prompt x n) is one engine request
    outputs = [CompletionChoice(c, server.formatter, req) for c in choices]
    answer = Answer.of(server, req, "text_completion", "cmpl-", outputs)
    return await server.respond(request, req, answer)
