"""The bundled model: a small DeepSeek-V3 + MTP checkpoint trained on ShareGPT
(tools/train_tiny_model.py; see tiny-deepseek-v3-mtp/README.md). It is the
default model of `LLM()`, `make serve`, the tests and the benchmarks."""

from __future__ import annotations

from pathlib import Path

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "tiny-deepseek-v3-mtp"


def bundled_model() -> str:
    if not (BUNDLED_MODEL_DIR / "config.json").is_file():
        raise ValueError(
            f"model: none given and the bundled model is missing from {BUNDLED_MODEL_DIR}; "
            "pass model=PATH or regenerate it with tools/train_tiny_model.py"
        )
    return str(BUNDLED_MODEL_DIR)
