"""The interface the engine core drives; it never sees a worker directly."""

from __future__ import annotations

import abc

from xllm_py.executor.messages import ModelRunnerOutput, SchedulerOutput


class Executor(abc.ABC):
    @abc.abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""

    @abc.abstractmethod
    def init_cache(self, num_blocks: int) -> None: ...

    @abc.abstractmethod
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self, reason: str = "shutting down", failure: bool = False) -> None:  # noqa: B027
        """Release the workers; remote ones are told why and whether to exit non-zero."""
