#!/usr/bin/env python3
"""Soak: thousands of mixed requests, aborts and KV pressure against one daemon, then checks.

    python -m perf.soak                           # 2,000 requests at concurrency 64 (~7 min here)
    python -m perf.soak --requests 200 --result /tmp/soak.json

It starts the daemon (MTP k = 1 by default) with a KV cache of --max-cache-size blocks, too
small for the load, and sends ShareGPT prompts (bench_serving's sampling) with random
endpoint, streaming, n, max_tokens, temperature, seed, stop strings and logprobs;
--abort-fraction of them are abandoned mid-stream or before the answer. Checks (exit 1 on
any failure; the JSON's `checks`): every other request finished ("stop"/"length") with
usage counts that match the tokens received (or the bounds the finish reasons allow);
greedy probes answer the same during and after the load as on the idle daemon; the cache
preempted; the gauges return to 0; no "error" finishes, no tracebacks in the log; RSS grows
less than --max-rss-growth from the end of the warm-up to the end.
"""

from __future__ import annotations

import asyncio
import json
import random
import shlex
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from perf.bench_serving import load_tokenizer, sample_sharegpt
from perf.common import (
    RESULTS,
    command,
    http_client,
    machine,
    parser,
    print_block,
    settings,
    write_json,
)
from perf.daemon import Server, flag_value
from xllm_py.assets import bundled_model
from xllm_py.config import CacheConfig, DeviceConfig, ModelConfig
from xllm_py.sharegpt import held_out_user_turns

STOP_POOL = (".", "\n", ",", "?", "!", ":", " the", " and", " is")
FINISHED = ("stop", "length")
MAX_FAILURES_KEPT = 100  # in the JSON; the count is always complete
MAX_TOKENS, PROBE_TOKENS = 48, 32  # a request's max_tokens is drawn from 1..48; a probe's
WARMUP_FRACTION = 0.2  # RSS growth counts from when this fraction of the requests finished


@dataclass
class Spec:
    """One request to send: its body, what its usage must say, and how to abandon it."""

    index: int
    chat: bool
    body: dict[str, Any]
    prompt_tokens: int  # the expected usage.prompt_tokens
    abort: tuple[str, float] | None = None  # ("events", k) | ("seconds", s) | None

    url = property(lambda s: "/v1/chat/completions" if s.chat else "/v1/completions")
    stream = property(lambda s: bool(s.body.get("stream")))
    n = property(lambda s: s.body.get("n", 1))
    max_tokens = property(lambda s: s.body.get("max_tokens") or s.body["max_completion_tokens"])
    logprobs = property(lambda s: (s.body.get("logprobs") is True) if s.chat
                        else s.body.get("logprobs") is not None)  # fmt: skip
    stops = property(lambda s: [s.body["stop"]] if isinstance(s.body.get("stop"), str)
                     else s.body.get("stop") or [])  # fmt: skip


def prompt_length(tokenizer, prompt: str, chat: bool) -> int:
    """usage.prompt_tokens the server must report: the prompt as the server tokenizes it
    (chat: the rendered chat template, whose special tokens encode as themselves)."""
    if chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return len(tokenizer.encode(prompt))


def random_body(rng: random.Random, prompt: str, chat: bool, max_tokens: int) -> dict:
    body: dict[str, Any] = {"stream": rng.random() < 0.5}
    limit = rng.randint(1, max_tokens)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        body[rng.choice(("max_tokens", "max_completion_tokens"))] = limit
    else:
        body["prompt"], body["max_tokens"] = prompt, limit
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if (n := rng.randint(1, 3)) > 1:
        body["n"] = n
    body["temperature"] = 0.0 if rng.random() < 0.3 else round(rng.uniform(0.2, 1.5), 2)
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.4:
        stops = rng.sample(STOP_POOL, rng.randint(1, 2))
        body["stop"] = stops[0] if len(stops) == 1 and rng.random() < 0.5 else stops
    if rng.random() < 0.5:
        if chat:
            body["logprobs"] = True
            if rng.random() < 0.7:
                body["top_logprobs"] = rng.randint(0, 3)
        else:
            body["logprobs"] = rng.randint(0, 3)
    return body


def random_abort(rng: random.Random, body: dict) -> tuple[str, float]:
    limit = body.get("max_tokens") or body["max_completion_tokens"]
    if body["stream"] and rng.random() < 0.5:
        return ("events", rng.randint(0, max(1, limit // 2)))
    return ("seconds", round(rng.uniform(0.0, 1.5), 3))


def build_workload(args, tokenizer) -> list[Spec]:
    rng = random.Random(args.seed)
    samples = sample_sharegpt(tokenizer, args.requests, args.seed)
    specs = []
    for i, s in enumerate(samples):
        chat = rng.random() < 0.5
        body = random_body(rng, s.prompt, chat, MAX_TOKENS)
        abort = random_abort(rng, body) if rng.random() < args.abort_fraction else None
        specs.append(Spec(i, chat, body, prompt_length(tokenizer, s.prompt, chat), abort))
    return specs


def build_probes(args, tokenizer) -> list[Spec]:
    """Greedy requests on held-out prompts whose answers must not change under load."""
    probes = []
    for i, prompt in enumerate(held_out_user_turns(args.probes, 40, 400)):
        chat, stream = bool(i % 2), bool(i // 2 % 2)
        body: dict[str, Any] = {"max_tokens": PROBE_TOKENS, "temperature": 0.0}
        if chat:
            body |= {"messages": [{"role": "user", "content": prompt}], "logprobs": True}
        else:
            body |= {"prompt": prompt, "logprobs": 1}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        probes.append(Spec(-1 - i, chat, body, prompt_length(tokenizer, prompt, chat)))
    return probes


@dataclass
class Choice:
    text: str = ""
    finish_reason: str | None = None
    stop_reason: Any = None
    tokens: list[str] | None = None  # from the logprobs, when they were asked for
    after_finish: int = 0  # chunks with output that came after this choice's finish


@dataclass
class Outcome:
    """What the client saw of one request."""

    status: str = "pending"  # ok | aborted | failed
    http_status: int | None = None
    choices: dict[int, Choice] = field(default_factory=dict)
    usage: dict | None = None
    errors: list[str] = field(default_factory=list)
    events: int = 0  # SSE data events read
    complete: bool = False  # the whole answer arrived ([DONE], or the JSON body)
    aborted_at: str | None = None


def _logprob_tokens(chat: bool, lp: dict | None) -> list[str]:
    if not lp:
        return []
    return [e["token"] for e in lp["content"]] if chat else list(lp["tokens"])


def absorb_choice(spec: Spec, out: Outcome, ch: dict, streamed: bool) -> None:
    """Fold one choice (a streamed delta or a whole answer's choice) into `out`."""
    c = out.choices.setdefault(ch["index"], Choice(tokens=[] if spec.logprobs else None))
    if spec.chat:
        text = ((ch.get("delta") or {}) if streamed else ch["message"]).get("content") or ""
    else:
        text = ch.get("text") or ""
    tokens = _logprob_tokens(spec.chat, ch.get("logprobs"))
    if c.finish_reason is not None and (text or tokens):
        c.after_finish += 1
    c.text += text
    if c.tokens is not None:
        c.tokens += tokens
    if ch.get("finish_reason") is not None:
        if c.finish_reason is not None:
            out.errors.append(f"choice {ch['index']}: a second finish_reason")
        c.finish_reason, c.stop_reason = ch["finish_reason"], ch.get("stop_reason")


def absorb_event(spec: Spec, out: Outcome, data: str) -> None:
    if data == "[DONE]":
        out.complete = True
        return
    msg = json.loads(data)
    if "error" in msg:
        out.errors.append(f"SSE error event: {msg['error'].get('message')}")
        return
    for ch in msg.get("choices") or []:
        absorb_choice(spec, out, ch, streamed=True)
    if msg.get("usage"):
        out.usage = msg["usage"]


async def _read_stream(client: httpx.AsyncClient, spec: Spec, out: Outcome) -> None:
    stop_after = spec.abort[1] if spec.abort and spec.abort[0] == "events" else None
    async with client.stream("POST", spec.url, json=spec.body) as resp:
        out.http_status = resp.status_code
        if resp.status_code != 200:
            out.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
            return
        async for line in resp.aiter_lines():
            if stop_after is not None and out.events >= stop_after and not out.complete:
                out.aborted_at = f"after {out.events} events"
                return  # leaving the block closes the connection mid-stream
            if line.startswith("data: "):
                out.events += 1
                absorb_event(spec, out, line[6:])


async def _read_whole(client: httpx.AsyncClient, spec: Spec, out: Outcome) -> None:
    resp = await client.post(spec.url, json=spec.body)
    out.http_status = resp.status_code
    if resp.status_code != 200:
        out.errors.append(f"HTTP {resp.status_code}: {resp.text[:500]}")
        return
    answer = resp.json()
    for ch in answer["choices"]:
        absorb_choice(spec, out, ch, streamed=False)
    out.usage = answer.get("usage")
    out.complete = True


async def send(client: httpx.AsyncClient, spec: Spec) -> Outcome:
    """Send one request, abandon it as its spec says, and classify what came back."""
    out = Outcome()
    read = _read_stream if spec.stream else _read_whole
    try:
        if spec.abort and spec.abort[0] == "seconds":
            await asyncio.wait_for(read(client, spec, out), spec.abort[1])
        else:
            await read(client, spec, out)
    except TimeoutError:  # wait_for's: the connection is closed on the way out
        if not out.complete:
            out.aborted_at = f"after {spec.abort[1]:.2f} s"
    except Exception as e:  # noqa: BLE001 - any failure is this request's result
        out.errors.append(f"{type(e).__name__}: {e}")
    if out.aborted_at and not out.complete:
        out.status = "aborted"
    else:
        out.errors += check_answer(spec, out)
        out.status = "failed" if out.errors else "ok"
    return out


def check_choice(spec: Spec, i: int, c: Choice) -> list[str]:
    bad = []
    if c.finish_reason not in FINISHED:
        bad.append(f"choice {i}: finish_reason {c.finish_reason!r}")
    if c.after_finish:
        bad.append(f"choice {i}: {c.after_finish} chunks with output after its finish")
    if hit := [s for s in spec.stops if s in c.text]:
        bad.append(f"choice {i}: stop string {hit[0]!r} left in the text")
    if c.tokens is not None:
        k = len(c.tokens)
        if not 1 <= k <= spec.max_tokens:
            bad.append(f"choice {i}: {k} tokens received, max_tokens {spec.max_tokens}")
        elif c.finish_reason == "length" and k != spec.max_tokens:
            bad.append(f"choice {i}: finish 'length' after {k} of {spec.max_tokens} tokens")
    return bad


def check_usage(spec: Spec, out: Outcome) -> list[str]:
    u = out.usage
    if not u:
        return ["no usage in the answer"]
    bad = []
    if u["prompt_tokens"] != spec.prompt_tokens:
        bad.append(f"usage.prompt_tokens {u['prompt_tokens']} != {spec.prompt_tokens}")
    if u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]:
        bad.append(f"usage.total_tokens {u['total_tokens']} != prompt + completion")
    got, choices = u["completion_tokens"], list(out.choices.values())
    if spec.logprobs:
        received = sum(len(c.tokens or []) for c in choices)
        if got != received:
            bad.append(f"usage.completion_tokens {got} != {received} tokens received")
        return bad
    full = sum(c.finish_reason == "length" for c in choices) * spec.max_tokens
    rest = len(choices) - sum(c.finish_reason == "length" for c in choices)
    if not full + rest <= got <= full + rest * spec.max_tokens:
        bad.append(
            f"usage.completion_tokens {got} outside [{full + rest}, "
            f"{full + rest * spec.max_tokens}] (finish reasons, max_tokens {spec.max_tokens})"
        )
    return bad


def check_answer(spec: Spec, out: Outcome) -> list[str]:
    """Why this complete (not abandoned) answer is wrong; [] when it is right."""
    if out.errors or out.http_status != 200:
        return [] if out.errors else [f"HTTP {out.http_status}"]
    bad = [] if out.complete else ["stream ended without data: [DONE]"]
    if sorted(out.choices) != list(range(spec.n)):
        bad.append(f"choice indexes {sorted(out.choices)}, expected 0..{spec.n - 1}")
    for i, c in sorted(out.choices.items()):
        bad += check_choice(spec, i, c)
    return bad + check_usage(spec, out)


def probe_answer(out: Outcome) -> dict:
    """What must not change between runs of a greedy probe (usage.speculative may: how many
    drafts a step verifies follows load)."""
    if out.status != "ok":
        return {"error": "; ".join(out.errors) or out.status}
    usage = {k: v for k, v in (out.usage or {}).items() if k != "speculative"}
    choices = [[c.text, c.tokens, c.finish_reason] for _, c in sorted(out.choices.items())]
    return {"choices": choices, "usage": usage}


async def probe_round(client: httpx.AsyncClient, probes: list[Spec], load: Progress) -> dict:
    in_flight = load.started - load.finished
    outs = await asyncio.gather(*(send(client, p) for p in probes))
    return {"in_flight_at_start": in_flight, "answers": [probe_answer(o) for o in outs]}


def compare_probes(idle: list[dict], rounds: list[dict]) -> dict:
    """Each round's answers against the idle daemon's, probe by probe."""
    diffs = []
    for r, rnd in enumerate(rounds):
        for p, (want, got) in enumerate(zip(idle, rnd["answers"])):
            if got != want:
                diffs.append({"round": r, "probe": p, "idle": want, "got": got})
    total = len(rounds) * len(idle)
    idle_ok = all("error" not in a for a in idle)
    return {"compared": total, "equal": total - len(diffs), "idle_ok": idle_ok, "diffs": diffs}


@dataclass
class Progress:
    started: int = 0
    finished: int = 0
    counts: Counter = field(default_factory=Counter)


class RssSampler(threading.Thread):
    """VmRSS of the daemon (its HTTP process and its children: the engine core) every
    0.5 s, with the load's progress at that moment."""

    def __init__(self, pid: int, progress: Progress) -> None:
        super().__init__(daemon=True)
        self.pid, self.progress = pid, progress
        self.samples: list[tuple[float, int, int]] = []  # (seconds, KiB, requests finished)
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def sample(self) -> None:
        task = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        pids = [self.pid, *map(int, task.read_text().split())]
        kib = sum(
            int(Path(f"/proc/{p}/status").read_text().split("VmRSS:")[1].split()[0]) for p in pids
        )
        self.samples.append((time.monotonic() - self.t0, kib, self.progress.finished))

    def run(self) -> None:
        while not self._halt.wait(0.5):
            try:
                self.sample()
            except (OSError, IndexError):  # no such process, or no VmRSS: a zombie
                return  # the daemon is gone; the checks will say so

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.sample()


def rss_summary(samples: list[tuple[float, int, int]], warm_requests: int) -> dict:
    """Growth from the first sample at or after `warm_requests` finished to the last one."""
    mib = [(t, kib / 1024, done) for t, kib, done in samples]
    warm = next((s for s in mib if s[2] >= warm_requests), mib[-1])
    half = next((s for s in mib if s[2] >= (warm_requests + mib[-1][2]) / 2), mib[-1])
    after = [s for s in mib if s[0] >= warm[0]]
    end, peak = mib[-1][1], max(s[1] for s in after)
    return {
        "warm_mib": warm[1],
        "peak_after_warm_mib": peak,
        "end_mib": end,
        "growth_after_warmup": (end - warm[1]) / warm[1],
        "peak_growth_after_warmup": (peak - warm[1]) / warm[1],
        # a leak grows in both halves of the run after warm-up; a high-water mark flattens
        "growth_second_half": (end - half[1]) / half[1],
    }


async def run_load(client, specs: list[Spec], probes: list[Spec], args, pid: int) -> dict:
    """The requests at --concurrency, probe rounds spread over the run, and the RSS of the
    daemon (process `pid`) sampled alongside."""
    progress, limit = Progress(), asyncio.Semaphore(args.concurrency)
    bar = tqdm(total=len(specs), disable=args.no_progress, desc="soak", unit="req")
    outcomes: list[Outcome | None] = [None] * len(specs)

    async def one(spec: Spec) -> None:
        async with limit:
            progress.started += 1
            outcomes[spec.index] = out = await send(client, spec)
        progress.finished += 1
        progress.counts[out.status] += 1
        bar.update(1)
        bar.set_postfix(**progress.counts)

    async def rounds() -> list[dict]:
        """Round r starts once r / (rounds + 1) of the load has finished, whether or not the
        round before it is done (probes wait in the same queue as the load)."""
        started = []
        for r in range(1, args.probe_rounds + 1):
            while progress.finished < r * len(specs) // (args.probe_rounds + 1):
                await asyncio.sleep(0.1)
            started.append(asyncio.create_task(probe_round(client, probes, progress)))
        return list(await asyncio.gather(*started))

    rss = RssSampler(pid, progress)
    rss.start()
    probe_task = asyncio.create_task(rounds())
    await asyncio.gather(*(one(s) for s in specs))
    probe_rounds = await probe_task
    bar.close()
    return {"outcomes": outcomes, "rounds": probe_rounds, "rss": rss}


def cache_flag(blocks: int, model: str, flags: list[str]) -> list[str]:
    """--max_cache_size (bytes) for `blocks` KV blocks of the daemon these flags start: a block
    holds block_size tokens of every cache layer (the target's, plus the MTP layers when
    speculation is on), kv_lora_rank + qk_rope_head_dim numbers each, in the run dtype."""
    if not blocks:
        return []
    cfg = ModelConfig.from_pretrained(model)
    spec_on = int(flag_value(flags, "num_speculative_tokens") or 0) > 0
    layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if spec_on else 0)
    block = int(flag_value(flags, "block_size") or CacheConfig().block_size)
    device = DeviceConfig(
        device=flag_value(flags, "devices") or "cpu", dtype=flag_value(flags, "dtype") or "auto"
    )
    elem = device.torch_dtype().itemsize
    return [f"--max_cache_size={blocks * layers * block * cfg.kv_cache_dim * elem}"]


def kv_blocks_from_log(log: str) -> int | None:
    for line in log.splitlines():
        if "KV cache: " in line and " blocks x " in line:
            return int(line.split("KV cache: ")[1].split()[0])
    return None


def log_tracebacks(log: str) -> dict:
    """Tracebacks in the daemon's log; those of a client that hung up while its request body
    was read (starlette's ClientDisconnect: logged at ERROR twice, by the server's 500
    handler and by uvicorn) apart, as the abandoned requests cause them by design."""
    total = log.count("Traceback (most recent call last)")
    disconnects = sum(line == "starlette.requests.ClientDisconnect" for line in log.splitlines())
    return {"tracebacks": total, "client_disconnect": disconnects, "other": total - disconnects}


def counters(server: Server) -> dict[str, float]:
    return {
        "preemptions": server.metric("xllm:num_preemptions_total"),
        "finished_error": server.metric("xllm:request_success_total", finished_reason="error"),
    }


def failures(specs: list[Spec], outcomes: list[Outcome]) -> list[dict]:
    bodies = [{k: v for k, v in s.body.items() if k not in ("prompt", "messages")} for s in specs]
    return [
        {"index": s.index, "endpoint": s.url, "body": body, "reasons": o.errors}
        for s, body, o in zip(specs, bodies, outcomes)
        if o.status == "failed"
    ]


def request_counts(specs: list[Spec], outcomes: list[Outcome]) -> dict:
    by = Counter(o.status for o in outcomes)
    return {
        "requests": len(specs),
        "ok": by["ok"],
        "aborted": by["aborted"],
        "failed": by["failed"],
        "streamed": sum(s.stream for s in specs),
        "chat": sum(s.chat for s in specs),
        "with_logprobs": sum(s.logprobs for s in specs),
    }


def checks(r: dict, args) -> list[dict]:
    c, p, g, rss, srv = r["counts"], r["probes"], r["gauges"], r["rss"], r["server"]
    rows = [
        ("requests", c["failed"] == 0,
         f"{c['ok']} ok, {c['aborted']} aborted, {c['failed']} failed"),
        ("aborts happened", c["aborted"] > 0 or not args.abort_fraction, f"{c['aborted']} aborted"),
        ("probes", p["idle_ok"] and p["equal"] == p["compared"] > 0,
         f"{p['equal']}/{p['compared']} equal to the idle answers"),
        ("preemption", r["preemptions"] > 0, f"{r['preemptions']:.0f} preemptions"),
        ("gauges at 0", not any(g[k] for k in ("running", "waiting", "kv_cache_usage")),
         f"running {g['running']:.0f}, waiting {g['waiting']:.0f}, KV {g['kv_cache_usage']:.3f}"),
        ("no error finishes", srv["finished_error"] == 0,
         f"{srv['finished_error']:.0f} requests finished with 'error'"),
        ("daemon alive", r["healthy"], "GET /health after the run"),
        ("log without tracebacks", r["log"]["other"] == 0,
         f"{r['log']['other']} tracebacks, besides {r['log']['client_disconnect']} of "
         "clients gone while their body was read"),
        ("RSS growth", rss["growth_after_warmup"] < args.max_rss_growth,
         f"{100 * rss['growth_after_warmup']:+.1f}% after warm-up "
         f"(limit {100 * args.max_rss_growth:.0f}%)"),
    ]  # fmt: skip
    return [{"check": name, "ok": bool(ok), "detail": detail} for name, ok, detail in rows]


def print_summary(r: dict) -> None:
    c = r["counts"]
    print_block("Soak result", [
        ("Requests (concurrency), seconds:", f"{c['requests']} ({r['settings']['concurrency']})"
         f", {r['duration_s']:.0f}"),
        ("OK / aborted / failed:", f"{c['ok']} / {c['aborted']} / {c['failed']}"),
        ("Checks",),
        *((f"{'PASS' if ch['ok'] else 'FAIL'}  {ch['check']}", ch["detail"]) for ch in r["checks"]),
    ])  # fmt: skip
    for f in r["failures"][:10]:
        print(f"  failed #{f['index']} {f['endpoint']}: {'; '.join(f['reasons'])[:300]}")


FLAGS = [  # (flag, type, default, help)
    ("--requests", int, 2000, "requests in the load"),
    ("--concurrency", int, 64, "requests in flight at once"),
    ("--abort-fraction", float, 0.1, "fraction of the requests the client abandons"),
    ("--seed", int, 0, "seed of the prompts and every random choice"),
    ("--max-cache-size", int, 12, "KV cache in blocks (of the daemon's block size, 128 by "
     "default), converted to its --max_cache_size bytes; 0: the daemon's own sizing. 12 x 128 "
     "tokens hold the longest request (1024 + 48), not 64 running ones"),
    ("--server-args", str, "--num_speculative_tokens=1", "daemon flags, one quoted string "
     "(the bundled model unless they hold --model)"),
    ("--probes", int, 8, "greedy probe requests (held-out prompts, both endpoints)"),
    ("--probe-rounds", int, 4, "times the probes are sent during the load, evenly spread"),
    ("--max-rss-growth", float, 0.10, "largest RSS growth after warm-up that passes"),
    ("--result", Path, RESULTS / "soak.json", "JSON result file"),
    ("--no-progress", bool, False, "no progress bar"),
]  # fmt: skip


async def _client_phase(server: Server, specs, probes, args) -> dict:
    async with http_client(600.0, base_url=server.url) as client:
        idle = [probe_answer(await send(client, p)) for p in probes]
        load = await run_load(client, specs, probes, args, server.proc.pid)
        after = [probe_answer(await send(client, p)) for p in probes]
    load["rounds"].append({"in_flight_at_start": 0, "answers": after, "after_load": True})
    return load | {"idle": idle}


def soak(args, specs: list[Spec], probes: list[Spec], flags: list[str]) -> dict:
    server = Server(*flags, startup_timeout=600.0)
    try:
        before = counters(server)
        phase = asyncio.run(_client_phase(server, specs, probes, args))
        gauges = server.settle(60.0)
        phase["rss"].stop()
        after = counters(server)
        healthy = httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()
    log = Path(server.log.name).read_text()  # stop() closed the file: output() cannot
    server_counts = {k: after[k] - before[k] for k in after}
    return {**phase, "gauges": gauges, "server": server_counts, "healthy": healthy, "log": log}


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, FLAGS).parse_args(argv)
    t0 = time.perf_counter()
    flags = shlex.split(args.server_args)
    model = flag_value(flags, "model") or str(bundled_model())
    flags += cache_flag(args.max_cache_size, model, flags)
    tokenizer = load_tokenizer(model)
    specs, probes = build_workload(args, tokenizer), build_probes(args, tokenizer)
    run = soak(args, specs, probes, flags)
    outcomes = run["outcomes"]
    result = {
        "command": command("soak", argv),
        "settings": settings(args),
        "daemon_flags": flags,
        "machine": machine(),
        "kv_blocks": kv_blocks_from_log(run["log"]),
        "counts": request_counts(specs, outcomes),
        "failures": failures(specs, outcomes)[:MAX_FAILURES_KEPT],
        "probes": compare_probes(run["idle"], run["rounds"])
        | {"rounds": [{k: v for k, v in r.items() if k != "answers"} for r in run["rounds"]]},
        "gauges": run["gauges"],
        "preemptions": run["server"]["preemptions"],
        "server": run["server"],
        "healthy": run["healthy"],
        "log": log_tracebacks(run["log"]),
        "rss": rss_summary(run["rss"].samples, int(WARMUP_FRACTION * len(specs))),
    }
    result["duration_s"] = time.perf_counter() - t0
    result["checks"] = checks(result, args)
    result["passed"] = all(c["ok"] for c in result["checks"])
    print_summary(result)
    write_json(args.result, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
