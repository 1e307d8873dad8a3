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

from xllm_py.assets import bundled_model
from xllm_py.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from xllm_py.engine.llm_engine import LLMEngine, Prompt
from xllm_py.engine.outputs import RequestOutput
from xllm_py.sampling_params import SamplingParams


def engine_config(
    model: str | None = None,
    device: str = "cpu",
    dtype: str = "auto",
    block_size: int = 128,
    max_memory_utilization: float = 0.9,
    max_cache_size: int = 0,
    enable_prefix_cache: bool = True,
    enable_chunked_prefill: bool = True,
    max_tokens_per_batch: int = 8192,
    max_seqs_per_batch: int = 256,
    max_model_len: int = 0,
    seed: int = 0,
    enable_graph: bool = False,
    graph_batch_sizes: Sequence[int] = (1, 2, 4, 8),
    num_speculative_tokens: int = 0,
    draft_model: str | None = None,
    speculative_disable_batch_size: int = 0,
    speculative_adaptive: bool = False,
    draft_device: str | None = None,
    weight_dtype: str = "auto",
    speculative_draft_vocab_size: int = 0,
    speculative_token_map: str | None = None,
) -> EngineConfig:
    """The engine's configuration from flat options (the offline API and the CLI share it).
    No model means the bundled one."""
    return EngineConfig(
        model=ModelConfig.from_pretrained(model or bundled_model()),
        cache=CacheConfig(
            block_size=block_size,
            max_memory_utilization=max_memory_utilization,
            max_cache_size=max_cache_size,
            enable_prefix_cache=enable_prefix_cache,
        ),
        scheduler=SchedulerConfig(
            max_tokens_per_batch=max_tokens_per_batch,
            max_seqs_per_batch=max_seqs_per_batch,
            enable_chunked_prefill=enable_chunked_prefill,
            max_model_len=max_model_len,
        ),
        device=DeviceConfig(
            device=device,
            dtype=dtype,
            seed=seed,
            enable_graph=enable_graph,
            graph_batch_sizes=tuple(graph_batch_sizes),
            weight_dtype=weight_dtype,
        ),
        spec=SpecConfig(
            num_speculative_tokens=num_speculative_tokens,
            draft_model=draft_model,
            speculative_disable_batch_size=speculative_disable_batch_size,
            adaptive=speculative_adaptive,
            draft_device=draft_device,
            draft_vocab_size=speculative_draft_vocab_size,
            token_map=speculative_token_map,
        ),
    )


class LLM:
    """Offline generation; every keyword is an `engine_config` option."""

    def __init__(self, model: str | None = None, **options) -> None:
        config = engine_config(model, **options)
        self.engine = LLMEngine(config)
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
