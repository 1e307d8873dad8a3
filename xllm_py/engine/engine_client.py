"""What the HTTP layer may ask of the engine: one interface, `EngineClient`.

    HTTP modules (api_server, serving, chat, completions)
        │  tokenize_prompt / validate / generate / abort, health, stats, config
        ▼
    EngineClient  (AsyncEngine implements it: the engine on its own thread)

An `Update` is what one request produced since its handler last read: a text delta and
the new token ids (and logprobs). The engine keeps at most one pending Update per
request and merges newer output into it in place (async_engine.py), so a handler that reads
slowly (a stalled stream) costs the size of its own output, never a queue of copies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from xllm_py.config import ModelConfig
from xllm_py.engine.scheduler import SchedulerStats
from xllm_py.engine.tokenizer import Tokenizer
from xllm_py.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop stopped with an error; no request can complete."""


class RequestFailedError(RuntimeError):
    """Handling this request's own data raised; it was ended, the engine goes on."""


class RequestAbortedError(RuntimeError):
    """The server ended the request before it finished (shutdown); the message says why."""


@dataclass(frozen=True)
class Update:
    """What one request produced since its handler last read (immutable: it crosses
    threads). Text that could still become a stop string is held back until it cannot,
    so deltas are never taken back."""

    delta_text: str  # the text this update adds (stop strings already cut)
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None  # one entry per new token, when asked for
    finish_reason: str | None
    stop_reason: int | str | None
    # in the first update after the prompt was computed, when prompt_logprobs were asked
    # for (RequestOutput.prompt_logprobs and prompt_ranks)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int] | None = None
    # the request's totals so far (RequestOutput.num_draft_tokens, num_accepted_tokens)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineClient(Protocol):
    """The engine as the HTTP layer sees it."""

    dead: BaseException | None  # set when the engine stopped: every request fails
    draining: bool  # set on shutdown: new requests are refused
    stats: SchedulerStats  # the latest snapshot (running, waiting, KV usage, speculation)

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer (None: prompts must be token ids)."""

    @property
    def model_config(self) -> ModelConfig:
        """The checkpoint's config (path, vocab_size, eos_token_ids)."""

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens one request may hold."""

    def tokenize_prompt(self, prompt: str) -> tuple[str | None, list[int]]:
        """(text, ids) of a text prompt; ValueError naming `prompt` when it cannot be.
        Thread-safe (the server calls it off the event loop)."""

    def validate(self, ids: list[int], sampling: SamplingParams) -> None:
        """The engine's checks of one request (ValueError naming the field). Thread-safe."""

    def generate(
        self, req_id: str, text: str | None, ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[Update]:
        """Updates of one request until it finishes; closing the iterator early aborts
        it (its blocks are freed)."""

    def abort(self, req_id: str) -> None:
        """End one request now (a no-op once it finished)."""
