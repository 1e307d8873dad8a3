"""Data parallelism: one EngineCore per replica behind the EngineCore interface.

    add_request --(fewest unfinished requests)--> replica i: EngineCore(i) -> Executor(i)
    step() = every busy replica's EngineCore.step(), run at the same time, outputs merged

With DP attention (`--enable_dp_attention`) the replicas are single ranks that share the
routed experts: every busy step steps them all, idle ones included, since each MoE layer
exchanges tokens between all of them (`lockstep`, models/layers/moe.py).

Each replica runs the full model with its own scheduler and block manager (sized by
that replica's KV capacity), so a request lives on one replica from start to finish
and its tokens are the ones a single node would produce. Replica 0 is the master's
in-process worker; the others are GrpcExecutors. Steps run on a thread per replica:
in-process torch work and gRPC waits both release the GIL.

A dead remote worker (the health monitor's verdict) counts as work to do: the next
`step()` raises it, which is how an idle engine fails too.
"""

from __future__ import annotations

import logging
from collections import ChainMap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from xllm_py.config import EngineConfig
from xllm_py.engine.core_client import EngineCoreClient
from xllm_py.engine.engine_core import EngineCore
from xllm_py.engine.scheduler import EngineCoreOutput, SchedulerStats
from xllm_py.executor.base import Executor
from xllm_py.sampling_params import SamplingParams
from xllm_py.speculative.metrics import SpecDecodeStats

logger = logging.getLogger(__name__)


class ReplicaFailedError(RuntimeError):
    """A replica's worker died or stopped answering."""


class DataParallelEngineCore(EngineCoreClient):
    def __init__(
        self,
        config: EngineConfig,
        executors: list[Callable[[], Executor]],
        failure: Callable[[], str | None] = lambda: None,
        on_shutdown: Callable[[], None] = lambda: None,
        lockstep: bool = False,
    ) -> None:
        """executors: one factory per replica, replica 0 first; replicas load at the same
        time. failure: the health monitor's verdict (None while all workers live).
        on_shutdown: called first by `shutdown` (the master stops watching its workers).
        lockstep: DP attention, where each replica is one rank of the routed experts'
        exchange: while any replica has work, every replica steps."""
        self.config = config
        self.lockstep = lockstep
        self.failure = failure
        self.on_shutdown = on_shutdown
        self._pool = ThreadPoolExecutor(len(executors), thread_name_prefix="xllm-replica")
        built = [self._pool.submit(lambda f=f: EngineCore(config, f())) for f in executors]
        self.replicas: list[EngineCore] = [b.result() for b in built]
        for r in self.replicas:
            r.lockstep = lockstep
        self._owner: dict[str, int] = {}  # req_id -> replica
        self.requests = ChainMap(*(r.scheduler.requests for r in self.replicas))

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Accept a request that at least one replica can serve (their caches may differ)."""
        error = None
        for core in self.replicas:
            try:
                core.validate(prompt_token_ids, sampling)
                return
            except ValueError as e:
                error = e
        raise error

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        """To the replica with the fewest unfinished requests among those that can serve it;
        among equals, the one with the most free KV blocks."""
        able = [
            i for i, core in enumerate(self.replicas) if _accepts(core, prompt_token_ids, sampling)
        ]
        reps = self.replicas
        i = min(
            able or range(len(reps)),
            key=lambda i: (len(reps[i].requests), -reps[i].blocks.num_free_blocks),
        )
        self._owner[req_id] = i
        self.replicas[i].add_request(req_id, prompt_token_ids, sampling)

    def finish_request(self, req_id: str, reason: str = "abort") -> None:
        i = self._owner.pop(req_id, None)
        if i is not None:
            self.replicas[i].finish_request(req_id, reason)

    @property
    def num_blocks(self) -> int:
        """The largest replica's KV blocks: the most one request can hold."""
        return max(r.num_blocks for r in self.replicas)

    def has_started(self, req_id: str) -> bool:
        return any(r.has_started(req_id) for r in self.replicas)

    def has_unfinished(self) -> bool:
        return self.failure() is not None or any(r.has_unfinished() for r in self.replicas)

    def step(self) -> list[EngineCoreOutput]:
        dead = self.failure()
        if dead is not None:
            raise ReplicaFailedError(dead)
        busy = [r for r in self.replicas if r.has_unfinished()]
        if self.lockstep and busy:  # DP attention: every rank joins every step
            outs = self._lockstep()
        elif len(busy) == 1:
            outs = busy[0].step()
        else:
            outs = [o for f in [self._pool.submit(r.step) for r in busy] for o in f.result()]
        for o in outs:
            if o.finish_reason is not None:
                self._owner.pop(o.req_id, None)
        return outs

    def _lockstep(self) -> list[EngineCoreOutput]:
        """Every replica's step at once. When one fails, the others' exchanges with it fail
        too: the error names each replica's failure, the cause among them."""
        steps = [self._pool.submit(r.step) for r in self.replicas]
        errors = [(i, f.exception()) for i, f in enumerate(steps)]
        failed = [f"replica {i}: {type(e).__name__}: {str(e)[:300]}" for i, e in errors if e]
        if failed:
            raise ReplicaFailedError("; ".join(failed)) from next(e for _, e in errors if e)
        return [o for f in steps for o in f.result()]

    def stats(self) -> SchedulerStats:
        parts = [r.stats() for r in self.replicas]
        blocks = [r.blocks.num_blocks for r in self.replicas]
        return SchedulerStats(
            num_running=sum(p.num_running for p in parts),
            num_waiting=sum(p.num_waiting for p in parts),
            kv_cache_usage=sum(p.kv_cache_usage * b for p, b in zip(parts, blocks)) / sum(blocks),
            num_preemptions=sum(p.num_preemptions for p in parts),
            prefix_cache_queries=sum(p.prefix_cache_queries for p in parts),
            prefix_cache_hits=sum(p.prefix_cache_hits for p in parts),
            spec=_merge_spec([p.spec for p in parts if p.spec is not None]),
        )

    def shutdown(self, reason: str = "shutting down", failure: bool = False) -> None:
        self.on_shutdown()
        for core in self.replicas:
            core.shutdown(reason, failure)
        self._pool.shutdown(wait=False)


def _accepts(core: EngineCore, ids: list[int], sampling: SamplingParams) -> bool:
    try:
        core.validate(ids, sampling)
    except ValueError:
        return False
    return True


def _merge_spec(parts: list[SpecDecodeStats]) -> SpecDecodeStats:
    out = SpecDecodeStats()
    for p in parts:
        out.drafts += p.drafts
        out.draft_tokens += p.draft_tokens
        out.accepted_tokens += p.accepted_tokens
        out.accepted_per_position = _add(out.accepted_per_position, p.accepted_per_position)
        out.adaptive_k += p.adaptive_k
        out.steps_by_k = _add(out.steps_by_k, p.steps_by_k)
        out.acceptance_buckets = _add(out.acceptance_buckets, p.acceptance_buckets)
        out.acceptance_sum += p.acceptance_sum
        out.cut_draft_tokens += p.cut_draft_tokens
        out.undrafted_steps += p.undrafted_steps
    return out


def _add(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists of possibly different lengths."""
    width = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (width - len(a)), b + [0] * (width - len(b)))]
