"""Single-device executor: the worker lives in this process."""

from __future__ import annotations

from xllm_py.config import EngineConfig
from xllm_py.executor.base import Executor
from xllm_py.executor.messages import ModelRunnerOutput, SchedulerOutput
from xllm_py.worker.worker import Worker


class InProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.seed = config.device.seed

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def init_cache(self, num_blocks: int) -> None:
        self.worker.init_cache(num_blocks, self.seed)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(sched)
