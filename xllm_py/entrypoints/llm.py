"""Offline batch inference, mirroring vLLM's `LLM`:

from xllm_py import LLM, SamplingParams
llm = LLM(model="path/to/checkpoint", device="cpu", dtype="float32")
outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
outs[0].outputs[0].text, outs[0].outputs[0].token_ids
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from xllm_py.args import EngineArgs
from xllm_py.config import EngineConfig
from xllm_py.engine.llm_engine import LLMEngine, Prompt
from xllm_py.engine.outputs import RequestOutput
from xllm_py.processes import ProcessOptions
from xllm_py.sampling_params import SamplingParams


def engine_config(model: str | None = None, **options) -> EngineConfig:
    """The engine's configuration from LLM's keyword options (EngineArgs.for_offline).
    No model means the bundled one."""
    return EngineArgs.for_offline(model=model, **options).engine_config()


class LLM:
    """Offline generation. The keywords are the engine's options of `xllm` (EngineArgs,
    xllm_py/args.py, e.g. dtype, block_size, num_speculative_tokens, grammar_cache_bytes,
    enable_test_hooks; device and draft_device are also taken for --devices and
    --draft_devices). The HTTP server's, the cluster's, the secrets and logging options are
    refused with a TypeError naming the flag; so is cpu_threads (torch's threads stay the
    caller's to set)."""

    def __init__(self, model: str | None = None, **options) -> None:
        args = EngineArgs.for_offline(model=model, **options)
        ProcessOptions.from_args(args, threads=False).apply()
        self.engine = LLMEngine(args.engine_config())
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts"
            )
        # Validate everything before queueing anything, so one bad prompt leaves no orphans.
        tokenized = [self.engine.tokenize_prompt(p) for p in prompts]
        for (_, ids), sp in zip(tokenized, sampling_params):
            self.engine.validate(ids, sp)
        req_ids = [str(next(self._ids)) for _ in prompts]
        for rid, (text, ids), sp in zip(req_ids, tokenized, sampling_params):
            self.engine.add_tokenized(rid, text, ids, sp, validated=True)
        return self._run(req_ids, use_tqdm)

    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(req_ids), desc="generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.error is not None:
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in req_ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in req_ids]

    def get_stats(self):
        """Scheduler and cache state plus speculative-decoding counters (`.spec`)."""
        return self.engine.core.stats()

    def get_metrics(self):
        """Speculative-decoding counters: drafts, draft_tokens, accepted_tokens,
        accepted_per_position, acceptance_rate, mean_acceptance_length."""
        return self.engine.core.stats().spec
