"""Which kernel each layer calls, chosen once at start-up (`--attention_backend`,
`--moe_backend`) and logged.

    attention  torch       block-wise over the block table in torch (ops/paged_mla.py)
               triton      the Triton paged-MLA kernel (in place, split-KV)
               flashinfer  FlashInfer's MLA decode (package `flashinfer-python`)
               flashmla    FlashMLA (through vLLM's `vllm._flashmla_C` or `sgl_kernel`)
    moe        torch       the grouped loop over active experts (models/layers/moe.py)
               triton      the fused MoE kernels (ops/fused_moe.py)

The Triton attention backend brings its elementwise kernels with it: RMSNorm fused with
the residual add before it (ops/rms_norm.py) and the rotary embedding of the rope slice
(ops/rotary.py).

`auto` is `triton` on CUDA, `triton` on NPU where `triton-ascend` imports (torch
otherwise), and `torch` on CPU. On CPU, `triton` runs Triton's interpreter
(`TRITON_INTERPRET=1`): a correctness check, far too slow to serve with.

A backend asked for by name but not usable here is a start-up error naming the flag and
what is missing. FlashInfer and FlashMLA are named so that they can be asked for; their
adapters are not written yet, and asking for them says so.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from xllm_py.config import DeviceConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    attention: str  # torch | triton
    moe: str  # torch | triton

    def paged_mla(self) -> Callable[..., torch.Tensor]:
        from xllm_py.ops import paged_mla

        return (
            paged_mla.paged_mla_triton if self.attention == "triton" else paged_mla.paged_mla_torch
        )

    def fused_moe(self) -> Callable[..., torch.Tensor] | None:
        """The MoE's routed-expert function, or None for the layer's own torch path."""
        if self.moe != "triton":
            return None
        from xllm_py.ops import fused_moe

        return fused_moe.fused_moe_triton


def triton_missing(device_type: str) -> str | None:
    """Why Triton kernels cannot run on this device type, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "the `triton` package is not installed"
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "on CPU, Triton kernels run only in Triton's interpreter: set TRITON_INTERPRET=1 "
            "(a correctness check, far too slow to serve with)"
        )
    if device_type == "npu" and importlib.util.find_spec("triton_ascend") is None:
        return "on NPU, Triton needs the `triton-ascend` package"
    return None


def _resolve(flag: str, choice: str, device_type: str) -> str:
    if choice == "auto":
        if device_type == "cpu":
            return "torch"
        return "triton" if triton_missing(device_type) is None else "torch"
    if choice == "triton":
        why = triton_missing(device_type)
        if why:
            raise ValueError(f"--{flag}=triton on {device_type}: {why}")
    if choice in ("flashinfer", "flashmla"):
        package = {"flashinfer": "flashinfer-python", "flashmla": "vllm or sgl-kernel"}[choice]
        if device_type != "cuda":
            raise ValueError(f"--{flag}={choice} needs a CUDA device (got {device_type})")
        raise NotImplementedError(
            f"--{flag}={choice}: the adapter to {choice} ({package}) is not written yet; use "
            f"--{flag}=triton (or auto)"
        )
    return choice


def select_kernels(device: DeviceConfig) -> Kernels:
    """The kernels for a worker on `device.device` (cpu, cuda:N, npu:N), logged once."""
    device_type = device.device.partition(":")[0]
    kernels = Kernels(
        attention=_resolve("attention_backend", device.attention_backend, device_type),
        moe=_resolve("moe_backend", device.moe_backend, device_type),
    )
    logger.info("kernels: attention %s, MoE %s", kernels.attention, kernels.moe)
    return kernels


def install(model: torch.nn.Module, kernels: Kernels) -> None:
    """Hand the chosen kernels to every layer of `model` that has a choice to make."""
    for module in model.modules():
        use = getattr(module, "use_kernels", None)
        if use is not None:
            use(kernels)
