"""Engine-core outputs (token ids) -> RequestOutputs (text, logprobs, stop strings).

Stop strings are found here, on the detokenized text: when one appears the
text is cut before it (or after it with `include_stop_str_in_output`) and
the request is reported back so the core stops and frees it. Everything here is
one request's own work: an exception fails that request only (LLMEngine.step).
"""

from __future__ import annotations

from xllm_py.engine import faults
from xllm_py.engine.outputs import CompletionOutput, RequestOutput
from xllm_py.engine.scheduler import EngineCoreOutput
from xllm_py.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from xllm_py.sampling_params import SamplingParams


class RequestState:
    def __init__(
        self,
        req_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        sampling: SamplingParams,
        tokenizer: Tokenizer | None,
    ) -> None:
        self.req_id = req_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.detok = (
            IncrementalDetokenizer(tokenizer, prompt_ids, sampling.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.completion = CompletionOutput(0, "", [], [] if sampling.logprobs is not None else None)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_ranks: list[int] | None = None
        self.num_draft_tokens = self.num_accepted_tokens = 0

    def apply(self, out: EngineCoreOutput) -> bool:
        """Fold one step's output in; True if a stop string ended the request here."""
        faults.check("output", self.prompt)
        c = self.completion
        if out.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_ranks = out.prompt_logprobs, out.prompt_ranks
        c.token_ids.extend(out.new_token_ids)
        self.num_draft_tokens = out.num_draft_tokens  # the request's totals so far
        self.num_accepted_tokens = out.num_accepted_tokens
        if c.logprobs is not None and out.new_logprobs:
            c.logprobs.extend(out.new_logprobs)
        c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        if self.detok is None:
            return False
        delta = self.detok.add(out.new_token_ids)
        if out.finish_reason is not None:
            delta += self.detok.flush()
        before = len(c.text)
        c.text += delta
        return self._check_stop_strings(before)

    def _check_stop_strings(self, scan_from: int) -> bool:
        c, stops = self.completion, self.sampling.stop
        if not stops or len(c.token_ids) < self.sampling.min_tokens:  # like EOS: not before
            return False
        longest = max(len(s) for s in stops)
        start = max(scan_from - longest + 1, 0)
        best = None
        for s in stops:
            idx = c.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        c.text = (
            c.text[: idx + len(s)] if self.sampling.include_stop_str_in_output else c.text[:idx]
        )
        c.finish_reason, c.stop_reason = "stop", s
        return True

    def output(self, error: str | None = None) -> RequestOutput:
        if error is not None:
            self.completion.finish_reason, self.completion.stop_reason = "error", None
        return RequestOutput(
            self.req_id,
            self.prompt,
            self.prompt_ids,
            [self.completion],
            finished=self.completion.finish_reason is not None,
            prompt_logprobs=self.prompt_logprobs,
            prompt_ranks=self.prompt_ranks,
            error=error,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )
