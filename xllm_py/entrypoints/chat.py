"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template (or
DeepSeek-V3.2's or V4's encoding, formats/encodings.py: --chat_template).

Each choice's text goes through the reasoning split (--reasoning_parser: `<think>` ...
`</think>` becomes `reasoning_content`) and then the tool-call reader (when the request
allows tool calls: the --tool_call_parser format's calls become `tool_calls`);
`tool_choice` required or named is enforced by a grammar. vLLM's `prompt_logprobs` (of
the rendered prompt) are one list for the request, at the top of the body.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from xllm_py.engine.engine_client import Update
from xllm_py.entrypoints.choice_output import Choice, ChoiceOutput, Formatter
from xllm_py.entrypoints.openai_protocol import ChatCompletionRequest
from xllm_py.entrypoints.serving import Answer, OpenAIServer
from xllm_py.formats import reasoning, tool_parser
from xllm_py.sampling_params import StructuredOutput


class ChatChoice(ChoiceOutput):
    def __init__(
        self,
        choice: Choice,
        fmt: Formatter,
        req: ChatCompletionRequest,
        reasoning_parser: str,
        tool_call_parser: str | None,
    ) -> None:
        super().__init__(choice, fmt, req.prompt_logprobs)
        self.splitter = None
        if reasoning_parser:
            self.splitter = reasoning.splitter_for(reasoning_parser, req.chat_template_kwargs)
        self.calls = None
        if tool_call_parser:
            self.calls = tool_parser.stream_for(tool_call_parser, req.parallel_tool_calls)
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[dict] = []

    def opening(self) -> dict:
        delta = {"role": "assistant", "content": ""}
        return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def delta(self, u: Update) -> dict | None:
        text = u.delta_text
        if not text and not u.finished and not u.new_logprobs:
            return None
        lp = None
        if self.want is not None and u.new_logprobs:
            entries = self.fmt.chat_logprobs(u.new_logprobs, u.new_token_ids, self.want)
            self.logprobs += entries
            lp = {"content": entries}
        thought, answer = "", text
        if self.splitter is not None:
            thought, answer = self.splitter.feed(text, final=u.finished)
        delta: dict = {"reasoning_content": thought} if thought else {}
        if self.calls is not None:
            delta |= self.calls.feed(answer, final=u.finished)
        elif answer:
            delta["content"] = answer
        self.reasoning.append(thought)
        self.content.append(delta.get("content", ""))
        if not delta and not u.finished and lp is None:
            return None  # all of it held back (a tag or a call's header)
        finish = self._finish()
        return {"index": self.index, "logprobs": lp, "finish_reason": finish, "delta": delta}

    def _finish(self) -> str | None:
        if self.finish_reason == "stop" and self.calls is not None and self.calls.calls:
            return "tool_calls"
        return self.finish_reason

    def final(self) -> dict:
        content: str | None = "".join(self.content)
        message: dict = {"role": "assistant", "content": content}
        if self.splitter is not None:
            message |= {"content": content or None, "reasoning_content": "".join(self.reasoning)}
        if self.calls is not None and self.calls.calls:
            message["content"] = content or None
            message["tool_calls"] = [call.openai() for call in self.calls.calls]
        return {
            "index": self.index,
            "finish_reason": self._finish(),
            "message": message,
            "logprobs": None if self.want is None else {"content": self.logprobs},
            "stop_reason": self.stop_reason,
        }


async def serve_chat(server: OpenAIServer, request: Request) -> Response:
    req = await server.read_body(request, ChatCompletionRequest)
    outputs = await chat_outputs(server, req)
    answer = Answer.of(server, req, "chat.completion", "chatcmpl-", outputs)
    answer.prompt_logprobs_at_top = True
    return await server.respond(request, req, answer)


async def chat_outputs(server: OpenAIServer, req: ChatCompletionRequest) -> list[ChatChoice]:
    """A chat request's choices, admitted to the engine: its messages rendered, its
    tool_choice or structured output compiled, each choice's reader (reasoning split,
    tool calls) set up. The other APIs (Responses, Messages) convert their bodies into a
    ChatCompletionRequest and read these choices' chat deltas and final messages."""
    server.admit(0)  # draining or dead: refuse before rendering anything
    opts = server.opts
    mode, named = req.tool_mode(opts.tool_call_parser, opts.enable_auto_tool_choice)
    grammar = None  # required or named calls: (field, the tool-call grammar)
    if mode in ("required", "named"):
        spec = tool_parser.tool_call_grammar(
            req.tool_dicts(), named, req.parallel_tool_calls, opts.tool_call_parser
        )
        grammar = ("tool_choice", StructuredOutput("structural_tag", spec))
    text = await server.run_blocking(server.render_chat, req)
    structured = await server.structured(req, grammar)
    choices = await server.run_blocking(
        server.choices, req, [text], req.output_limit, req.num_logprobs(), structured
    )
    server.admit(len(choices))  # each choice (n) is one engine request
    return [
        ChatChoice(
            c,
            server.formatter,
            req,
            opts.reasoning_parser,
            opts.tool_call_parser if mode != "none" else None,
        )
        for c in choices
    ]
