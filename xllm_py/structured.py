"""Structured outputs: a grammar the output must follow, enforced with xgrammar.

A request's `StructuredOutput` names a kind and its source text:

    json         a JSON schema (text)             OpenAI's json_schema, vLLM's guided_json
    json_object  any JSON object                  OpenAI's json_object
    regex        a regular expression             vLLM's guided_regex
    choice       a JSON list of strings           vLLM's guided_choice: exactly one of them
    grammar      an EBNF grammar (xgrammar's)     vLLM's guided_grammar
    structural_tag  xgrammar's structural tag (JSON)  vLLM's structural_tag; tool calls
                 with tool_choice "required" or named (entrypoints/tool_parser.py); any of
                 the above after a reasoning block (`after_reasoning`)

`Grammars` compiles each once per process for one tokenizer (StructuredOutput lives in
sampling_params.py, so it crosses the cluster wire with the other parameters), and
`Matcher` follows one request's output: the token bitmask of what may come next, tokens
accepted, and rollback of drafts (worker/model_runner.py applies the bitmask at every
verified position; speculative/mtp_proposer.py applies it to the MTP draft's logits, so drafts
stay inside the grammar). In a cluster each worker compiles a grammar the first time a
request brings it, inside that step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import threading

import torch

from xllm_py.sampling_params import StructuredOutput


def xgrammar():
    try:
        import xgrammar as xgr
    except ImportError as e:  # an optional dependency: the `structured` extra
        raise ValueError(
            "structured outputs need xgrammar, which is not installed here "
            "(pip install 'xllm-py[structured]')"
        ) from e
    return xgr


class Grammars:
    """Compiles structured-output specs for one tokenizer, one at a time, each once
    (thread-safe)."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        xgr = xgrammar()
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._lock = threading.Lock()  # one compile at a time
        self._compiled: dict[StructuredOutput, object] = {}  # read without the lock

    def compile(self, so: StructuredOutput):
        """The compiled grammar (cached: a spec compiled before is a dict lookup, never a
        wait on a compile in progress); ValueError saying what is wrong with the spec."""
        done = self._compiled.get(so)
        if done is not None:
            return done
        with self._lock:
            if so not in self._compiled:
                self._compiled[so] = self._compile(so)
            return self._compiled[so]

    def _compile(self, so: StructuredOutput):
        c = self.compiler
        with _spec_errors():
            if so.kind in ("json", "json_object"):
                schema, strict = _json_schema(so)
                return c.compile_json_schema(schema, any_whitespace=False, strict_mode=strict)
            if so.kind == "regex":
                return c.compile_regex(so.spec)
            if so.kind == "choice":
                return c.compile_grammar(choice_grammar(so.spec))
            if so.kind == "structural_tag":
                return c.compile_structural_tag(so.spec)
            return c.compile_grammar(so.spec)


def _json_schema(so: StructuredOutput) -> tuple[str, bool]:
    """(schema text, strict) of a json or json_object constraint: json_object is OpenAI's
    any object (xgrammar's builtin JSON grammar would allow any value)."""
    return (so.spec, so.strict) if so.kind == "json" else ('{"type": "object"}', False)


@contextlib.contextmanager
def _spec_errors():
    """xgrammar reports a bad spec as RuntimeError (or another type): raised here as a
    ValueError saying what does not compile, its first line without xgrammar's time and
    source location."""
    try:
        yield
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0]
        first = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)
        raise ValueError(f"does not compile: {first}") from e


@functools.lru_cache(maxsize=4)
def grammars_for(model_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Grammars:
    """One compiler per tokenizer and process (the API server and an in-process worker
    share it, so a grammar the server checked is already compiled for the worker)."""
    return Grammars(model_path, vocab_size, eos_token_ids)


def choice_grammar(spec: str) -> str:
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def json_schema_grammar(schema: str, strict: bool) -> str:
    """The EBNF grammar of a JSON schema, as `_compile` compiles it (separators fixed,
    no free whitespace: a weak model cannot pad its output with blanks forever)."""
    g = xgrammar().Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    return str(g)


def _format(so: StructuredOutput) -> dict:
    """The constraint as a structural-tag format: its own structural tag, or the EBNF
    grammar xgrammar makes of it with the options `_compile` uses."""
    if so.kind == "structural_tag":
        spec = json.loads(so.spec)
        return spec["format"] if isinstance(spec, dict) and "format" in spec else spec
    if so.kind in ("json", "json_object"):
        grammar = json_schema_grammar(*_json_schema(so))
    elif so.kind == "regex":
        grammar = str(xgrammar().Grammar.from_regex(so.spec))
    else:
        grammar = choice_grammar(so.spec) if so.kind == "choice" else so.spec
    return {"type": "grammar", "grammar": grammar}


def after_reasoning(so: StructuredOutput, end: str) -> StructuredOutput:
    """`so`, applied only after the reasoning: any text up to and including `end` (e.g.
    `</think>`) comes first, unconstrained, then the output follows `so`."""
    think = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": end}
    with _spec_errors():
        fmt = {"type": "sequence", "elements": [think, _format(so)]}
    spec = json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
    return StructuredOutput("structural_tag", spec)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, grammars: Grammars, so: StructuredOutput, max_rollback: int) -> None:
        xgr = xgrammar()
        self.xgr = xgr
        self.matcher = xgr.GrammarMatcher(grammars.compile(so), max_rollback_tokens=max_rollback)
        self.vocab_size = grammars.vocab_size

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) if the grammar does not allow it."""
        return self.matcher.accept_token(token)

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` (xgrammar's packed int32 layout) := what may come next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return xgrammar().allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[i]] of tokens bitmask row i disallows := -inf."""
    xgrammar().apply_token_bitmask_inplace(logits, bitmask[: len(rows)], indices=rows)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab] from a packed bitmask [rows, ceil(vocab / 32)] (bit b of word w
    is token 32 w + b)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(1)[:, :vocab_size].bool()
