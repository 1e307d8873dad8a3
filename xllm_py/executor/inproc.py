"""Single-device executor: the worker lives in this process.

It takes the worker ready-made (the caller builds it), so `executor/` stays below
`worker/`: the worker imports this package's messages, never the other way round."""

from __future__ import annotations

from typing import Protocol

from xllm_py.executor.base import Executor
from xllm_py.executor.messages import ModelRunnerOutput, SchedulerOutput


class LocalWorker(Protocol):
    """What the executor calls on an in-process worker (`worker.Worker`)."""

    def determine_num_blocks(self) -> int: ...

    def init_cache(self, num_blocks: int, seed: int) -> None: ...

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...


class InProcExecutor(Executor):
    def __init__(self, worker: LocalWorker, seed: int) -> None:
        self.worker = worker
        self.seed = seed

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def init_cache(self, num_blocks: int) -> None:
        self.worker.init_cache(num_blocks, self.seed)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(sched)
