"""One worker per device: loads the model, sizes and allocates the KV cache,
runs steps. The in-process executor calls it directly; the gRPC executor
will call the same methods remotely."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from xllm_py.config import EngineConfig
from xllm_py.executor.messages import ModelRunnerOutput, SchedulerOutput
from xllm_py.models.deepseek_v3 import DeepseekV3ForCausalLM
from xllm_py.weights.loader import layer_index, load_weights
from xllm_py.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_target_model(config: EngineConfig, device: torch.device, dtype: torch.dtype):
    mcfg = config.model
    if mcfg.quantization_config:
        method = mcfg.quantization_config.get("quant_method")
        raise NotImplementedError(
            f"quantization_config.quant_method={method!r}: quantized checkpoints are not "
            "supported yet"
        )
    with default_dtype(dtype), torch.device(device):
        model = DeepseekV3ForCausalLM(mcfg)
    n = mcfg.num_hidden_layers

    def is_mtp(name: str) -> bool:  # MTP layers (index >= num_hidden_layers) belong to the draft
        i = layer_index(name)
        return i is not None and i >= n

    load_weights(model, mcfg.path, skip=is_mtp)
    model.process_weights_after_loading()
    return model.eval()


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        return torch.npu.mem_get_info(device)[0]  # type: ignore[attr-defined]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device.device)
        self.dtype = config.device.torch_dtype()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = load_target_model(config, self.device, self.dtype)
        self.runner: ModelRunner | None = None

    @property
    def bytes_per_block(self) -> int:
        mcfg, bs = self.config.model, self.config.cache.block_size
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.model.num_cache_layers * bs * mcfg.kv_cache_dim * elem

    def determine_num_blocks(self) -> int:
        """Blocks that fit in --max_cache_size bytes, or in --max_memory_utilization of the
        memory left after loading the model. On CPU, never more than running requests can
        use at once (max_seqs_per_batch full-length sequences): RAM is shared with the host."""
        cache = self.config.cache
        if cache.max_cache_size:
            budget = cache.max_cache_size
        else:
            budget = int(available_memory(self.device) * cache.max_memory_utilization)
        num = budget // self.bytes_per_block
        if self.device.type == "cpu" and not cache.max_cache_size:
            per_seq = -(
                -(self.config.max_model_len + cache.num_lookahead_tokens) // cache.block_size
            )
            num = min(num, self.config.scheduler.max_seqs_per_batch * per_seq)
        return int(num)

    def init_cache(self, num_blocks: int, seed: int = 0) -> None:
        shape = (num_blocks, self.config.cache.block_size, self.config.model.kv_cache_dim)
        # Zeroed: padded context positions are masked, but 0 * NaN would still poison the output.
        caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.model.num_cache_layers)
        ]
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB)",
            num_blocks,
            self.config.cache.block_size,
            num_blocks * self.bytes_per_block / 2**20,
        )
        self.runner = ModelRunner(
            self.model,
            caches,
            self.config.cache.block_size,
            self.config.model.eos_token_ids,
            self.device,
            self.dtype,
            seed,
        )

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)
