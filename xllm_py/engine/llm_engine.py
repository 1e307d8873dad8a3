"""Synchronous engine: text in, RequestOutputs out, one `step()` at a time.

prompt (text | token ids) --tokenize, validate--> EngineCore.add_request
EngineCore.step() -> EngineCoreOutput --detokenize, stop strings--> RequestOutput

A failure in one request's own work (adding it, detokenising, stop strings) ends that
request with `RequestOutput.error` set and its blocks freed; the step and the other
requests go on. A failure of the step itself (the shared forward) raises.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from xllm_py.config import EngineConfig
from xllm_py.engine import faults
from xllm_py.engine.core_client import EngineCoreClient
from xllm_py.engine.engine_core import EngineCore
from xllm_py.engine.output_processor import RequestState
from xllm_py.engine.outputs import RequestOutput
from xllm_py.engine.tokenizer import Tokenizer
from xllm_py.sampling_params import SamplingParams

Prompt = str | dict[str, Any]
STATS_LOG_INTERVAL_S = 10.0
logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, core: EngineCoreClient | None = None) -> None:
        """core: the engine core to drive (engine/core_client.py: a DataParallelEngineCore,
        a CoreProcessClient); default: one EngineCore with an in-process worker."""
        self.config = config
        self.tokenizer = Tokenizer.from_dir(config.model.path)
        self.core = core if core is not None else EngineCore(config)
        self.states: dict[str, RequestState] = {}
        self._last_log = time.monotonic()

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string or a dict, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if self.tokenizer is None:
            raise ValueError(
                f"prompt: {self.config.model.path} has no tokenizer.json; pass "
                "{'prompt_token_ids': [...]} instead of text"
            )
        return prompt, self.tokenizer.encode(prompt)

    def add_request(self, req_id: str, prompt: Prompt, sampling: SamplingParams) -> None:
        text, ids = self.tokenize_prompt(prompt)
        self.add_tokenized(req_id, text, ids, sampling)

    def validate(self, ids: list[int], sampling: SamplingParams) -> None:
        """Everything the core checks, plus what needs text: stop strings need a tokenizer."""
        if sampling.stop and self.tokenizer is None:
            raise ValueError(
                f"stop: {self.config.model.path} has no tokenizer.json, so stop strings cannot be "
                "matched; use stop_token_ids"
            )
        self.core.validate(ids, sampling)

    def add_tokenized(
        self,
        req_id: str,
        text: str | None,
        ids: list[int],
        sampling: SamplingParams,
        validated: bool = False,
    ) -> None:
        if not validated:
            self.validate(ids, sampling)
        self.core.add_request(req_id, ids, sampling)
        self.states[req_id] = RequestState(req_id, text, ids, sampling, self.tokenizer)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_log < STATS_LOG_INTERVAL_S:
            return
        self._last_log = now
        st = self.core.stats()
        spec = st.spec
        logger.info(
            "running %d, waiting %d, KV cache %.0f%%, preemptions %d; drafts %d, acceptance "
            "rate %.2f, mean acceptance length %.2f; drafts cut %d, steps without drafting %d",
            st.num_running,
            st.num_waiting,
            100 * st.kv_cache_usage,
            st.num_preemptions,
            spec.drafts,
            spec.acceptance_rate,
            spec.mean_acceptance_length,
            spec.cut_draft_tokens,
            spec.undrafted_steps,
        )

    def abort_request(self, req_id: str) -> None:
        self.core.finish_request(req_id, "abort")
        self.states.pop(req_id, None)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def fail_request(self, req_id: str, error: BaseException) -> RequestOutput | None:
        """End one request because handling its own data raised: its blocks are freed and
        its output carries the error (None if the request is unknown)."""
        logger.error(
            "request %s failed (%s: %s); the others go on",
            req_id,
            type(error).__name__,
            error,
            exc_info=error,
        )
        self.core.finish_request(req_id, "abort")
        state = self.states.pop(req_id, None)
        return None if state is None else state.output(f"{type(error).__name__}: {error}")

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that advanced."""
        self._maybe_log_stats()
        if faults.ACTIVE:
            for state in self.states.values():
                faults.check("step", state.prompt)
        results = []
        for out in self.core.step():
            state = self.states.get(out.req_id)
            if state is None:
                continue
            if out.finish_reason == "error":  # the core failed it (PD: its blocks never came)
                del self.states[out.req_id]
                results.append(state.output(str(out.stop_reason)))
                continue
            try:
                stopped = state.apply(out)
            except Exception as e:  # noqa: BLE001 - this request's own fault, not the step's
                results.append(self.fail_request(out.req_id, e))
                continue
            if stopped and out.finish_reason is None:
                self.core.finish_request(out.req_id, "stop")
            result = state.output()
            if result.finished:
                del self.states[out.req_id]
            results.append(result)
        return results
