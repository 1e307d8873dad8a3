"""Fault injection, for tests of fault isolation (off unless the variable is set).

    XLLM_FAULT_INJECT=output:MARKER   processing the output of a request whose prompt text
                                      contains MARKER raises (detokenisation, stop strings):
                                      that request fails with a 500, the others go on
    XLLM_FAULT_INJECT=step:MARKER     an engine step raises while such a request is running:
                                      a shared fault, so every request fails and the daemon
                                      exits 1

The variable is read once, at import; an unknown place is a ValueError naming it.
"""

from __future__ import annotations

import os

ENV = "XLLM_FAULT_INJECT"
PLACES = ("output", "step")


class InjectedFault(RuntimeError):
    """Raised where XLLM_FAULT_INJECT asks for it."""


def _parse(value: str) -> tuple[str, str] | None:
    if not value:
        return None
    place, sep, marker = value.partition(":")
    if place not in PLACES or not sep or not marker:
        raise ValueError(f"{ENV}={value!r}: expected <place>:<marker>, place one of {PLACES}")
    return place, marker


_FAULT = _parse(os.environ.get(ENV, ""))
ACTIVE = _FAULT is not None


def check(place: str, prompt: str | None) -> None:
    """Raise InjectedFault if a fault is injected at `place` for this prompt."""
    if _FAULT is not None and _FAULT[0] == place and prompt and _FAULT[1] in prompt:
        raise InjectedFault(f"fault injected at {place!r} ({ENV})")
