"""Structured outputs: a grammar the output must follow, enforced with xgrammar.

A request's `StructuredOutput` names a kind and its source text:

    json         a JSON schema (text)             OpenAI's json_schema, vLLM's guided_json
    json_object  any JSON object                  OpenAI's json_object
    regex        a regular expression             vLLM's guided_regex
    choice       a JSON list of strings           vLLM's guided_choice: exactly one of them
    grammar      an EBNF grammar (xgrammar's)     vLLM's guided_grammar
    structural_tag  xgrammar's structural tag (JSON)  vLLM's structural_tag; tool calls
                 with tool_choice "required" or named (formats/tool_parser.py); any of
                 the above after a reasoning block (`after_reasoning`)

`Grammars` compiles specs for one tokenizer (StructuredOutput lives in sampling_params.py,
so it crosses the cluster wire with the other parameters), and `Matcher` follows one
request's output: the token bitmask of what may come next, tokens accepted, and rollback of
drafts (worker/model_runner.py applies the bitmask at every verified position;
speculative/mtp_proposer.py applies it to the MTP draft's logits, so drafts stay inside the
grammar).

Compiled grammars live in one cache per process, shared by every `Grammars` in it (so the
API server's check compile and an in-process worker share a grammar), bounded in bytes
(`set_cache_limit`, --grammar_cache_bytes): the least recently used are evicted beyond the
limit, and compiled again when next asked for. A matcher holds its own reference to its
grammar, so an eviction never disturbs a request in progress.

The API server compiles a spec it has not seen with a timeout (`Grammars.compile(so,
timeout=...)`): in a child process (compiler.py) that is killed past the timeout,
so a runaway compile stops there (`GrammarCompileTimeout`) and the next spec compiles in a
fresh child. Without a timeout (a worker, which sees only specs the server accepted: in a
cluster each worker compiles a grammar the first time a request brings it, inside that
step) the compile runs in the calling thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import re
import threading
from typing import TYPE_CHECKING

from xllm_py.sampling_params import StructuredOutput

if TYPE_CHECKING:  # torch is imported where a tensor is made (the HTTP process makes none)
    import torch

DEFAULT_CACHE_BYTES = 256 << 20  # --grammar_cache_bytes' default
SLOW_SPECS_KEPT = 1024  # specs remembered as too slow to compile (refused without a compile)


def xgrammar():
    try:
        import xgrammar as xgr
    except ImportError as e:  # an optional dependency: the `structured` extra
        raise ValueError(
            "structured outputs need xgrammar, which is not installed here "
            "(pip install 'xllm-py[structured]')"
        ) from e
    return xgr


class GrammarCompileTimeout(TimeoutError):
    """A spec took longer than its timeout to compile (its compile was stopped)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"took more than {timeout:g} s to compile")
        self.timeout = timeout


def grammar_nbytes(grammar) -> int:
    """The memory a compiled grammar holds: xgrammar's own count where it has one, else the
    length of its serialised JSON."""
    n = getattr(grammar, "memory_size_bytes", None)
    return int(n) if n is not None else len(grammar.serialize_json())


class _Cache:
    """Compiled grammars by (tokenizer, spec), least recently used first, at most `limit`
    bytes in all (a grammar larger than the whole limit is not kept)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        self.entries: collections.OrderedDict[tuple, tuple[object, int]] = collections.OrderedDict()
        self.nbytes = 0
        self.evictions = 0
        self.compile_timeouts = 0
        self.compiling = 0  # compiles in a compile process now

    def get(self, key: tuple):
        with self.lock:
            hit = self.entries.get(key)
            if hit is None:
                return None
            self.entries.move_to_end(key)
            return hit[0]

    def put(self, key: tuple, grammar) -> None:
        n = grammar_nbytes(grammar)
        with self.lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self.entries[key] = (grammar, n)
            self.nbytes += n
            self._evict()

    def set_limit(self, limit: int) -> None:
        with self.lock:
            self.limit = limit
            self._evict()

    def _evict(self) -> None:
        while self.nbytes > self.limit and self.entries:
            _, (_, n) = self.entries.popitem(last=False)
            self.nbytes -= n
            self.evictions += 1


_CACHE = _Cache(DEFAULT_CACHE_BYTES)


def set_cache_limit(nbytes: int) -> None:
    """Keep at most `nbytes` of compiled grammars in this process (--grammar_cache_bytes);
    grammars beyond it are evicted now, least recently used first."""
    if nbytes < 0:
        raise ValueError(f"grammar cache limit {nbytes}: must be >= 0 bytes")
    _CACHE.set_limit(int(nbytes))


def cache_stats() -> dict[str, int]:
    """The grammar cache now: bytes, entries, limit (bytes), evictions and compile timeouts
    so far, compiles running in a compile process."""
    c = _CACHE
    with c.lock:
        return {
            "bytes": c.nbytes,
            "entries": len(c.entries),
            "limit": c.limit,
            "evictions": c.evictions,
            "compile_timeouts": c.compile_timeouts,
            "compiling": c.compiling,
        }


class GrammarCacheCollector:
    """Prometheus collector of `cache_stats()` for a server's /metrics registry."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = cache_stats()
        for kind, name, doc, key in (
            (GaugeMetricFamily, "grammar_cache_bytes", "Bytes of compiled grammars cached.",
             "bytes"),
            (GaugeMetricFamily, "grammar_cache_entries", "Compiled grammars cached.", "entries"),
            (GaugeMetricFamily, "grammar_cache_limit_bytes",
             "The grammar cache's limit (--grammar_cache_bytes).", "limit"),
            (GaugeMetricFamily, "grammar_compiles_running",
             "Grammar compiles running now (with a timeout, in a compile process).",
             "compiling"),
            (CounterMetricFamily, "grammar_cache_evictions",
             "Compiled grammars evicted from the cache (least recently used).", "evictions"),
            (CounterMetricFamily, "grammar_compile_timeouts",
             "Grammar compiles stopped at --grammar_compile_timeout.", "compile_timeouts"),
        ):  # fmt: skip
            m = kind("xllm:" + name, doc, labels=["model_name"])
            m.add_metric([self.model], st[key])
            yield m


class Grammars:
    """Compiles structured-output specs for one tokenizer into the process's grammar cache
    (thread-safe; one compile at a time per way of compiling)."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        xgr = xgrammar()
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        self.info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.key = (model_path, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._lock = threading.Lock()  # in-process compiles, one at a time
        self._proc_lock = threading.Lock()  # compiles with a timeout, one at a time
        self._proc = None  # the compile process, started by the first compile with a timeout
        # spec -> the timeout it did not compile within: refused again without a compile
        self._slow: collections.OrderedDict[StructuredOutput, float] = collections.OrderedDict()

    def compile(self, so: StructuredOutput, timeout: float | None = None):
        """The compiled grammar, from the cache if it holds it (never a wait on another
        spec's compile). Otherwise compiled and cached: with `timeout` (seconds of compiling,
        not counting a wait for an earlier compile to end) in the compile process, which
        is killed past it (GrammarCompileTimeout); without, in this thread. ValueError
        saying what is wrong with the spec."""
        key = (self.key, so)
        done = _CACHE.get(key)
        if done is not None:
            return done
        if timeout is None:
            with self._lock:
                done = _CACHE.get(key)
                if done is None:
                    done = compile_spec(self.compiler, so)
                    _CACHE.put(key, done)
                return done
        with self._proc_lock:
            done = _CACHE.get(key)
            if done is not None:
                return done
            if self._slow.get(so, -1.0) >= timeout:
                self._slow.move_to_end(so)
                raise GrammarCompileTimeout(timeout)
            text = self._compile_in_process(so, timeout)
            done = xgrammar().CompiledGrammar.deserialize_json(text, self.info)
            _CACHE.put(key, done)
            return done

    def _compile_in_process(self, so: StructuredOutput, timeout: float) -> str:
        from xllm_py.structured.compiler import CompileProcess, CompileTimeout

        if self._proc is None:
            self._proc = CompileProcess(self.info.serialize_json())
        with _CACHE.lock:
            _CACHE.compiling += 1
        try:
            return self._proc.compile(so, timeout)
        except CompileTimeout as e:
            self._slow[so] = timeout
            while len(self._slow) > SLOW_SPECS_KEPT:
                self._slow.popitem(last=False)
            with _CACHE.lock:
                _CACHE.compile_timeouts += 1
            raise GrammarCompileTimeout(timeout) from e
        finally:
            with _CACHE.lock:
                _CACHE.compiling -= 1


def compile_spec(compiler, so: StructuredOutput):
    """`so` compiled by `compiler` (an xgrammar GrammarCompiler), uncached; ValueError
    saying what does not compile."""
    with _spec_errors():
        if so.kind in ("json", "json_object"):
            schema, strict = _json_schema(so)
            return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=strict)
        if so.kind == "regex":
            return compiler.compile_regex(so.spec)
        if so.kind == "choice":
            return compiler.compile_grammar(choice_grammar(so.spec))
        if so.kind == "structural_tag":
            return compiler.compile_structural_tag(so.spec)
        return compiler.compile_grammar(so.spec)


async def in_daemon_thread(fn):
    """fn() run in a daemon thread of its own, off the event loop: waiters never queue
    behind another caller, and the process's exit never waits on it."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def run() -> None:
        try:
            ok, value = True, fn()
        except BaseException as e:  # noqa: BLE001 (handed to the awaiting coroutine)
            ok, value = False, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=run, daemon=True, name="xllm-grammar").start()
    return await fut


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
    share it and the process's grammar cache, so a grammar the server checked is already
    compiled for the worker)."""
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
    """In place: logits[rows[i]] of tokens bitmask row i disallows := -inf. xgrammar's
    `indices` pick the same row of the logits and of the bitmask, so the compact mask is
    laid out at its rows of a full one (all allowed elsewhere) first."""
    if rows != list(range(len(rows))):
        full = bitmask.new_full((logits.shape[0], bitmask.shape[1]), -1)  # all allowed
        full[rows] = bitmask[: len(rows)]
        bitmask = full
    xgrammar().apply_token_bitmask_inplace(logits, bitmask[: logits.shape[0]], indices=rows)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab] from a packed bitmask [rows, ceil(vocab / 32)] (bit b of word w
    is token 32 w + b)."""
    import torch

    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(1)[:, :vocab_size].bool()
