"""The engine core: validated requests in, per-step outputs out.

    add_request -> Scheduler.schedule() -> Executor.execute() -> Scheduler.update()

It owns the scheduler and block manager and talks to workers only through
an `Executor`. It knows token ids, never text.
"""

from __future__ import annotations

import logging
import time

from xllm_py.cache.block_manager import BlockManager, blocks_for
from xllm_py.config import EngineConfig
from xllm_py.engine.core_client import EngineCoreClient
from xllm_py.engine.request import Request
from xllm_py.engine.scheduler import EngineCoreOutput, Scheduler, SchedulerStats
from xllm_py.executor.base import Executor
from xllm_py.executor.inproc import InProcExecutor
from xllm_py.sampling_params import SamplingParams
from xllm_py.speculative.adaptive import AdaptiveSpeculation
from xllm_py.speculative.confidence import ConfidencePolicy

logger = logging.getLogger(__name__)


def local_executor(config: EngineConfig) -> InProcExecutor:
    """One worker in this process, on `config.device`."""
    from xllm_py.worker.worker import Worker  # torch and the model: loaded only when used

    return InProcExecutor(Worker(config), config.device.seed)


class EngineCore(EngineCoreClient):
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        if executor is None:
            executor = local_executor(config)
        self.config = config
        self.executor = executor
        num_blocks = executor.determine_num_blocks()
        bs = config.cache.block_size
        min_blocks = config.max_blocks_per_seq
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget holds {num_blocks} blocks of {bs} tokens; raise "
                "max_cache_size or max_memory_utilization"
            )
        if num_blocks < min_blocks:
            logger.warning(
                "KV cache holds %d blocks, fewer than one full-length request needs (%d); "
                "longer requests will be rejected",
                num_blocks,
                min_blocks,
            )
        executor.init_cache(num_blocks)
        self._timed: tuple | None = None  # (the last step, when it started)
        # what times steps; perf/gate_check.py --interleave step, stepping three engines in
        # turn, gives each one that counts only the seconds of its own steps
        self.clock = time.perf_counter
        # DP attention: the worker runs every step, with nothing scheduled too, to join the
        # other ranks' expert exchanges (models/layers/moe.py); whoever steps this core
        # steps it while any rank has work (engine/dp_engine_core.py)
        self.lockstep = False
        self.blocks = BlockManager(num_blocks, bs, config.cache.enable_prefix_cache)
        self.scheduler = Scheduler(
            config.scheduler,
            self.blocks,
            config.cache.num_lookahead_tokens,
            config.spec.speculative_disable_batch_size,
            AdaptiveSpeculation(config.spec.num_speculative_tokens)
            if config.spec.adaptive
            else None,
            _confidence_policy(config.spec),
        )
        self.pd = _pd_side(config, executor)

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError naming the field if this request can never be served."""
        validate_request(self.config, self.blocks.num_blocks, prompt_token_ids, sampling)

    @property
    def num_blocks(self) -> int:
        """KV blocks of the cache: the most one request can ever hold."""
        return self.blocks.num_blocks

    def has_started(self, req_id: str) -> bool:
        """Whether some of the request's tokens were computed (it was scheduled)."""
        req = self.requests.get(req_id)
        return req is not None and req.num_computed_tokens > 0

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        """Queue a request that `validate` has accepted (LLMEngine validates first)."""
        req = Request(
            req_id,
            prompt_token_ids,
            sampling,
            self.config.model.eos_token_ids,
            self.config.max_model_len,
        )
        if sampling.kv_push is not None and self.config.pd.role == "prefill":
            self.pd.pushes[req_id] = sampling.kv_push
        elif self.config.pd.role == "decode" and self.pd.admit(self.blocks, req):
            return  # scheduled once its prompt's blocks arrived (or failed to)
        self.scheduler.add_request(req)

    def finish_request(self, req_id: str, reason: str = "abort") -> None:
        if self.config.pd.role == "decode" and self.pd.cancel(req_id):
            return
        if self.config.pd.role == "prefill":
            self.pd.pushes.pop(req_id, None)
        self.scheduler.finish_request(req_id, reason)

    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished requests by id."""
        return self.scheduler.requests

    def has_unfinished(self) -> bool:
        waiting = self.config.pd.role == "decode" and bool(self.pd.waiting)
        return waiting or self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        failed = []  # PD decode, --pd_on_transfer_failure=error: requests whose blocks failed
        if self.config.pd.role == "decode":
            ready, errors = self.pd.settled(self.blocks)
            for req in ready:
                self.scheduler.add_request(req)
            failed = [EngineCoreOutput(i, [], None, "error", why) for i, why in errors]
        sched = self.scheduler.schedule()
        if not sched.num_scheduled_tokens and not sched.finished_req_ids:
            self._timed = None  # idle: the time until the next step is not a step's
            if self.lockstep:
                self.executor.execute(sched)
            if self.config.pd.role == "decode" and not failed:
                self.pd.wait(PD_POLL_S)  # only transfers to wait for: not a busy loop
            return failed
        # Adaptive speculation times whole steps, start to next start: the executor's part
        # and what the engine does around it (scheduling, outputs, detokenising, streaming),
        # which a larger k shares among more tokens.
        now = self.clock()
        if self._timed is not None:
            self.scheduler.record_step_time(self._timed[0], now - self._timed[1])
        self._timed = (sched, now) if sched.num_scheduled_tokens else None
        result = self.executor.execute(sched)
        outputs = self.scheduler.update(sched, result)
        if self.config.pd.role == "prefill" and self.pd.pushes:
            self._push_finished(outputs)
        if not self.scheduler.has_unfinished():
            self._timed = None  # the next step starts after an idle wait: not this step's
        return outputs + failed

    def _push_finished(self, outputs: list[EngineCoreOutput]) -> None:
        """PD prefill: write each finished request's prompt blocks to its decode instance;
        a request whose blocks did not arrive ends as "abort", why in its stop_reason."""
        for out in outputs:
            push = self.pd.pushes.pop(out.req_id, None) if out.finish_reason else None
            if push is not None and (why := self.pd.push(self.blocks, push)) is not None:
                out.finish_reason, out.stop_reason = "abort", why

    def stats(self) -> SchedulerStats:
        st = self.scheduler.stats()
        if self.pd is not None:
            st.pd = self.pd.stats
        return st

    def shutdown(self, reason: str = "shutting down", failure: bool = False) -> None:
        if self.pd is not None:
            self.pd.close()
        self.executor.shutdown(reason, failure)


PD_POLL_S = 0.005  # how long an idle PD decode core waits for a transfer before it looks again


def _pd_side(config: EngineConfig, executor: Executor):
    """The PD role's part of the core (xllm_py/pd/roles.py), or None (role "both")."""
    if config.pd.role == "both":
        return None
    if not isinstance(executor, InProcExecutor):
        raise ValueError(
            f"pd_role={config.pd.role!r} on a cluster (--nnodes, --dp_size) is not implemented "
            "yet: one process per instance"
        )
    from xllm_py.pd.roles import DecodeSide, PrefillSide  # Mooncake: loaded only when used

    side = PrefillSide if config.pd.role == "prefill" else DecodeSide
    return side(config, executor.worker)


def _confidence_policy(spec) -> ConfidencePolicy | None:
    """Confidence-scheduled draft length when drafting is on (adaptive speculation, which
    picks one k for the whole step from its own cost table, takes its place)."""
    if not spec.confidence_scheduled:
        return None
    return ConfidencePolicy(spec.num_speculative_tokens, spec.confidence)


def validate_request(
    config: EngineConfig, num_blocks: int, prompt_token_ids: list[int], sampling: SamplingParams
) -> None:
    """Raise ValueError naming the field if this request can never be served by an engine
    of `config` whose KV cache holds `num_blocks` blocks."""
    vocab, max_len = config.model.vocab_size, config.max_model_len
    if not prompt_token_ids:
        raise ValueError("prompt: must not be empty")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside [0, vocab_size={vocab})")
    n = len(prompt_token_ids)
    if sampling.max_tokens == 0 and n > max_len:  # scoring only: the prompt must fit
        raise ValueError(f"prompt: {n} tokens exceed the model's context of {max_len} tokens")
    if sampling.max_tokens != 0 and n >= max_len:
        raise ValueError(
            f"prompt: {n} tokens leave no room to generate within the model's context "
            f"of {max_len} tokens"
        )
    for t in sampling.stop_token_ids:
        if not 0 <= t < vocab:
            raise ValueError(f"stop_token_ids: {t} is outside [0, vocab_size={vocab})")
    for t in sampling.logit_bias or {}:
        if not 0 <= t < vocab:
            raise ValueError(f"logit_bias: key {t} is outside [0, vocab_size={vocab})")
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(sampling, name) or 0) > vocab:
            raise ValueError(f"{name}={getattr(sampling, name)} exceeds vocab_size={vocab}")
    if sampling.structured is not None:  # a grammar that does not compile: refused here
        from xllm_py.structured import grammars_for

        m = config.model
        grammars = grammars_for(m.path, vocab, tuple(m.eos_token_ids))
        try:
            grammars.compile(sampling.structured)
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from e
    sched = config.scheduler
    if not sched.enable_chunked_prefill and n > sched.max_tokens_per_batch:
        raise ValueError(
            f"prompt: {n} tokens exceed max_tokens_per_batch={sched.max_tokens_per_batch} "
            "and chunked prefill is off (enable_chunked_prefill)"
        )
    most = max_len if sampling.max_tokens is None else sampling.max_tokens
    longest = min(n + most, max_len)
    need = blocks_for(longest + config.cache.num_lookahead_tokens, config.cache.block_size)
    if need > num_blocks:
        raise ValueError(
            f"max_tokens: prompt ({n}) + max_tokens need {need} KV blocks but the cache has "
            f"only {num_blocks}"
        )
