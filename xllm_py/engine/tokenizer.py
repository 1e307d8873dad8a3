"""Tokenizer from a checkpoint directory (`tokenizer.json` + `tokenizer_config.json`),
using HF `tokenizers` directly, plus incremental detokenization.

The chat template comes with the checkpoint, where HF transformers finds it:
`chat_template.jinja` (and named ones in `additional_chat_templates/NAME.jinja`) before
`tokenizer_config.json`'s `chat_template` (one template, or a list of named ones). Of
named templates, "tool_use" renders requests with `tools` where there is one, and
"default" the rest.

It is untrusted code: it renders in jinja2's immutable sandbox, where a template that
reaches for Python internals (an attribute starting with `_`, e.g. `''.__class__`, or a
namespace attribute so named) or calls a method that mutates a value (`list.append`)
fails with `ChatTemplateRefused` instead of running.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2.exceptions import SecurityError
from tokenizers import Tokenizer as _HFTokenizer


class ChatTemplateRefused(ValueError):
    """The chat template tried something the sandbox forbids; nothing of it ran."""


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # HF's names (transformers.utils.hub)
CHAT_TEMPLATE_DIR = "additional_chat_templates"


class _ChatSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, except that reading an unsafe attribute fails at once:
    jinja2 would render it as an empty string (and fail only on its use)."""

    def unsafe_undefined(self, obj, attribute: str):
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} value is unsafe"
        )


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<eos>", ...} in some configs
        return value.get("content")
    return value


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` as HF gives it to templates: an attribute starting with `_` can be
    neither given nor set (jinja2's own would store it, unreadable but kept)."""

    def __init__(*args, **kwargs):  # jinja2's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which HF's templates use to mark what the
    assistant wrote (for training masks): rendered as its body, as HF renders it."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class Tokenizer:
    def __init__(
        self, tok: _HFTokenizer, config: dict, chat_template: str | dict | None = None
    ) -> None:
        """`chat_template`: the checkpoint's template(s) from files, which win over the
        config's (`from_dir` reads them)."""
        self._tok = tok
        self.config = config
        # one template, or {name: template}
        self.chat_template: str | dict[str, str] | None = _named(
            chat_template if chat_template is not None else config.get("chat_template")
        )
        self.bos_token_id = self._id(config.get("bos_token"))
        self.add_bos = bool(config.get("add_bos_token", False))

    def _id(self, token) -> int | None:
        text = _token_text(token)
        return None if text is None else self._tok.token_to_id(text)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None when it ships none (prompts must be token ids)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        return cls(tok, config, _template_files(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_kwargs,
    ) -> str:
        """Render `[{"role", "content", ...}, ...]` (and `tools`, OpenAI's function list)
        with the checkpoint's jinja2 chat template, as HF `apply_chat_template(...,
        tokenize=False)` renders it: messages normalised the same way, the same jinja2
        options, filters and globals, and the tokenizer's special tokens as variables.
        `template_kwargs` (vLLM's `chat_template_kwargs`) are further variables; they
        cannot replace these."""
        template = self._chosen_template(tools)
        variables = {
            **template_kwargs,
            **self.special_tokens(),
            "messages": [_as_hf_message(m) for m in messages],
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template(template).render(**variables)
        except SecurityError as e:
            raise ChatTemplateRefused(
                f"the checkpoint's chat template was refused by the sandbox: {e}"
            ) from None

    def _chosen_template(self, tools: list[dict] | None) -> str:
        """The template that renders a request (HF's `get_chat_template`)."""
        templates = self.chat_template
        if not templates:
            raise ValueError("messages: this checkpoint has no chat template")
        if isinstance(templates, str):
            return templates
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(
            "messages: this checkpoint's chat templates have none named 'default' "
            f"(it has {sorted(templates)})"
        )

    def special_tokens(self) -> dict[str, str]:
        """HF's special_tokens_map: bos_token, eos_token, ... as the config names them."""
        names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")
        out = {n: _token_text(self.config[n]) for n in (*names, "mask_token") if n in self.config}
        return {n: t for n, t in out.items() if t is not None}

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def _template(source: str) -> jinja2.Template:
        env = _ChatSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["namespace"] = _Namespace
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(source)


def _template_files(path: Path) -> str | dict[str, str] | None:
    """The chat templates a checkpoint ships as files, as HF reads them: the default in
    CHAT_TEMPLATE_FILE, named ones in CHAT_TEMPLATE_DIR; None when there are none."""
    found = {}
    if (path / CHAT_TEMPLATE_FILE).is_file():
        found["default"] = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (path / CHAT_TEMPLATE_DIR).is_dir():
        for f in sorted((path / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            found[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if list(found) == ["default"]:
        return found["default"]
    return found or None


def _named(templates) -> str | dict[str, str] | None:
    """A config's `chat_template` (a template, or a list of {"name", "template"}) as a
    template or {name: template}."""
    if isinstance(templates, (list, tuple)):
        return {t["name"]: t["template"] for t in templates}
    return templates


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _as_hf_message(message: dict) -> dict:
    """A message as HF's apply_chat_template hands it to the template: keys whose value is
    None dropped (a tool-calling turn without text has no content), and its reasoning
    under each name templates read it by."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """jinja2's own tojson escapes HTML characters; chat templates expect plain JSON."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


class IncrementalDetokenizer:
    """Text of a growing token list, emitted as deltas.

    Decodes a short window [prefix_offset, end) and compares it with the
    window's already-emitted part [prefix_offset, read_offset); a trailing
    U+FFFD means a multi-byte character is incomplete, so nothing is emitted
    until the next token completes it. Cost per token is O(window), not O(text).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-6:])  # a little left context for correct spacing
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, new_ids: list[int]) -> str:
        out = []
        for tid in new_ids:
            self.ids.append(tid)
            prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
            full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                out.append(full[len(prefix) :])
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return "".join(out)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character) once no token will follow."""
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
