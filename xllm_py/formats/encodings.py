"""The chat encodings that are Python rules, not a Jinja template (`--chat_template`):
DeepSeek-V3.2's (encoding_dsv32.py) and DeepSeek-V4's (encoding_dsv4.py)."""

from __future__ import annotations

from collections.abc import Callable

from xllm_py.formats import encoding_dsv4, encoding_dsv32

ENCODINGS: dict[str, Callable[..., str]] = {
    encoding_dsv32.NAME: encoding_dsv32.render,
    encoding_dsv4.NAME: encoding_dsv4.render,
}
CHAT_TEMPLATES = ("auto", *ENCODINGS)


def encoder(
    chat_template: str, model_config: dict, has_own_template: bool
) -> Callable[..., str] | None:
    """The `render` that makes the prompts, or None for the checkpoint's chat template:
    the one `--chat_template` names, or with `auto` the one of config.json's model_type
    (deepseek_v32, deepseek_v4) for a checkpoint that ships no template of its own
    (DeepSeek-V3.2-Exp ships V3.1's, and keeps it)."""
    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(
            f"--chat_template={chat_template!r}: must be one of {', '.join(CHAT_TEMPLATES)}"
        )
    if chat_template != "auto":
        return ENCODINGS[chat_template]
    return None if has_own_template else ENCODINGS.get(model_config.get("model_type"))
