"""The one interface of an engine core, as LLMEngine and AsyncEngine drive it.

    EngineCoreClient          implemented by
    ----------------          --------------
    validate, add_request,    EngineCore               one replica, in this process
    finish_request, step,     DataParallelEngineCore   a cluster's replicas (cluster/master.py)
    stats, shutdown, ...      CoreProcessClient        either of them in a child process
                                                       (core_process.py)

A core in this process runs a step when asked: `wake` is None and `ready_to_step()` is
always true. A core process steps on its own and sends each step's outputs: `wake` is
the event it sets when some arrive, `ready_to_step()` says whether any have, and
`step_started` is when the latest of them began (its clock).
"""

from __future__ import annotations

import threading
from typing import Protocol

from xllm_py.engine.scheduler import EngineCoreOutput, SchedulerStats
from xllm_py.sampling_params import SamplingParams


class EngineCoreClient(Protocol):
    wake: threading.Event | None = None  # set when a step's outputs arrive (a core process)
    step_started: float | None = None  # time.monotonic() at the latest step's start
    num_blocks: int  # KV blocks of the cache: the most one request can ever hold

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError naming the field if this request can never be served."""
        ...

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        """Queue a request that `validate` has accepted."""
        ...

    def finish_request(self, req_id: str, reason: str = "abort") -> None:
        """End a request now (its blocks are freed); a no-op once it finished."""
        ...

    def has_unfinished(self) -> bool: ...

    def has_started(self, req_id: str) -> bool:
        """Whether some of the request's tokens were computed (it was scheduled)."""
        ...

    def ready_to_step(self) -> bool:
        """Whether `step()` has outputs to give now (a core in this process: always)."""
        return True

    def step(self) -> list[EngineCoreOutput]: ...

    def stats(self) -> SchedulerStats: ...

    def shutdown(self, reason: str = "shutting down", failure: bool = False) -> None:
        """Release the executors (a cluster's workers are told why; with `failure` they
        exit non-zero)."""
        ...
