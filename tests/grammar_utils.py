"""Grammar checks over the bundled model's tokenizer (xllm_py/structured/): whether a
constraint admits a given text as a whole output, token by token as the engine feeds it."""

from __future__ import annotations

import functools

from xllm_py.assets import BUNDLED_MODEL_DIR
from xllm_py.config import ModelConfig
from xllm_py.engine.tokenizer import Tokenizer
from xllm_py.sampling_params import StructuredOutput
from xllm_py.structured import Matcher, grammars_for


@functools.cache
def bundled() -> tuple[Tokenizer, ModelConfig]:
    """The bundled model's tokenizer and config."""
    return Tokenizer.from_dir(BUNDLED_MODEL_DIR), ModelConfig.from_pretrained(BUNDLED_MODEL_DIR)


def bundled_matcher(so: StructuredOutput) -> Matcher:
    """A fresh grammar state for `so` (drafts of up to 8 tokens can be undone)."""
    _, cfg = bundled()
    return Matcher(grammars_for(cfg.path, cfg.vocab_size, tuple(cfg.eos_token_ids)), so, 8)


def encode(text: str) -> list[int]:
    return bundled()[0].encode(text, add_special_tokens=False)


def follows(so: StructuredOutput, text: str) -> bool:
    """Whether `so` admits `text` (its tokens, then end of sequence) as a whole output."""
    m = bundled_matcher(so)
    return all(m.accept(t) for t in encode(text)) and m.accept(bundled()[1].eos_token_ids[0])
