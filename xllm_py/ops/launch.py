"""What every Triton launcher in ops/ checks before it launches, and how it learns whether
its kernel runs compiled or in Triton's interpreter."""

from __future__ import annotations

import torch


def interpreted(kernel) -> bool:
    """Whether `kernel` (a @triton.jit function) was defined under TRITON_INTERPRET=1."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_launch(kernel, device: torch.device, what: str) -> None:
    """Refuse, naming the fix, a launch that cannot run. `kernel` is the launcher's
    @triton.jit kernel, None when `triton` could not be imported. CPU tensors need the
    interpreter, which Triton reads when a kernel is *defined* (its module imported).
    Under torch.compile nothing is checked: Dynamo cannot trace the isinstance on a Triton
    kernel, and the eager warm-up run before the graphs already passed these checks."""
    if torch.compiler.is_compiling():
        return
    if kernel is None:
        raise RuntimeError(
            f"{what} needs the `triton` package, which could not be imported; install "
            "triton, or use the torch backend"
        )
    if device.type == "cpu" and not interpreted(kernel):
        module = getattr(kernel, "__module__", "its module")
        raise RuntimeError(
            f"{what} got CPU tensors but Triton's interpreter is off: set TRITON_INTERPRET=1 "
            f"before {module} is imported (Triton reads it when a kernel is defined), or pass "
            "CUDA tensors"
        )
