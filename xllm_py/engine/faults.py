"""Fault injection, for tests of fault isolation: off unless BOTH the variable is set and
the process was started with --enable_test_hooks=true (LLM: enable_test_hooks=True).

    XLLM_FAULT_INJECT=output:MARKER   processing the output of a request whose prompt text
                                      contains MARKER raises (detokenisation, stop strings):
                                      that request fails with a 500, the others go on
    XLLM_FAULT_INJECT=step:MARKER     an engine step raises while such a request is running:
                                      a shared fault, so every request fails and the daemon
                                      exits 1

The variable alone does nothing (a production server must not fail because a client sent
a marker): `configure(enable_test_hooks)` reads it at start-up, arms the hook only when
test hooks are enabled, and then logs a WARNING; an unknown place is a ValueError naming
the variable. Until `configure` arms it, `check` does nothing.
"""

from __future__ import annotations

import logging
import os

ENV = "XLLM_FAULT_INJECT"
PLACES = ("output", "step")
logger = logging.getLogger(__name__)

_FAULT: tuple[str, str] | None = None  # (place, marker) once armed
ACTIVE = False  # read by the engine before it looks at every request's prompt


class InjectedFault(RuntimeError):
    """Raised where XLLM_FAULT_INJECT asks for it."""


def _parse(value: str) -> tuple[str, str] | None:
    if not value:
        return None
    place, sep, marker = value.partition(":")
    if place not in PLACES or not sep or not marker:
        raise ValueError(f"{ENV}={value!r}: expected <place>:<marker>, place one of {PLACES}")
    return place, marker


def configure(enable_test_hooks: bool) -> None:
    """Arm the hook from XLLM_FAULT_INJECT if `enable_test_hooks`; else disarm it (the
    variable is then ignored, with an INFO line saying so)."""
    global _FAULT, ACTIVE
    value = os.environ.get(ENV, "")
    _FAULT = _parse(value) if enable_test_hooks else None
    ACTIVE = _FAULT is not None
    if ACTIVE:
        logger.warning(
            "test hook armed: %s=%s fails %s whose prompt contains %r (--enable_test_hooks); "
            "never run a production server like this",
            ENV,
            value,
            "the requests" if _FAULT[0] == "output" else "the engine step",
            _FAULT[1],
        )
    elif value:
        logger.info("%s is set but ignored: --enable_test_hooks is off", ENV)


def check(place: str, prompt: str | None) -> None:
    """Raise InjectedFault if a fault is armed at `place` for this prompt."""
    if _FAULT is not None and _FAULT[0] == place and prompt and _FAULT[1] in prompt:
        raise InjectedFault(f"fault injected at {place!r} ({ENV})")
