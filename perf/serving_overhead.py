#!/usr/bin/env python3
"""What serving adds to the step: the offline decode time per output token and the
serving TPOT at concurrency 1, in one run, for plain and MTP decoding.

    python -m perf.serving_overhead                         # bundled model, eager, k = 0 and 1
    python -m perf.serving_overhead --graph --k 0 2         # graph mode, plain and k = 2
    python -m perf.serving_overhead --startup               # the daemon's default start-up

--startup: the daemon as `make serve` starts it (graph mode by its default, compiled in the
background), twice over one fresh --compile_cache_dir: seconds to a healthy /health, the
TPOT of a request served at once, seconds until the log says every graph is compiled, the
TPOT then (results/serving_startup.json).

Offline: the engine in this process (LLM), each held-out ShareGPT prompt alone, greedy,
EOS ignored: decode time / (tokens - 1). Serving: the daemon (`python -m xllm_py`) with
the same engine options, the same prompts as token ids, one stream at a time: (last
token's arrival - first token's arrival) / (tokens - 1). The ratio serving / offline is
what the HTTP process, the engine loop and streaming add. Both are up at once and take
turns, prompt by prompt, for --rounds rounds (each idle while the other runs): a shared
machine's speed moves by more than the overhead between two runs minutes apart. Medians
over the prompts and rounds; results/serving_overhead.json.
"""

from __future__ import annotations

import json
import statistics
import time

import httpx

from perf.common import RESULTS, close, command, machine, parser, print_block, write_json
from perf.daemon import Server, warm_up
from perf.step_cost import decode_run, held_out_prompts

FLAGS = [
    ("--model", str, None, "checkpoint directory (default: the bundled model)"),
    ("--dtype", str, "float32", "weights and activations dtype"),
    ("--k", int, [0, 1], "draft lengths to measure (0: plain decoding)"),
    ("--graph", bool, False, "graph mode (--enable_graph) on both sides"),
    ("--prompts", int, 4, "held-out ShareGPT prompts, each decoded alone"),
    ("--new-tokens", int, 128, "output tokens per request"),
    ("--rounds", int, 2, "times each prompt is decoded offline and served, taking turns"),
    ("--startup", bool, False, "measure the default start-up, fresh and with the cache"),
    ("--out", str, None, "JSON to write (default: results/serving_<overhead|startup>.json)"),
]
COMPILED = "every graph compiled"  # the worker's log line once graph mode is complete


def engine_options(args, k: int) -> dict:
    opts = dict(dtype=args.dtype, num_speculative_tokens=k, enable_graph=args.graph)
    opts["graph_warm_up"] = "startup"  # both sides measured with every graph compiled
    if k:
        opts["speculative_confidence"] = "off"  # the same k every step, on both sides
    if args.model:
        opts["model"] = args.model
    return opts


def offline_engine(args, k: int):
    """The offline engine, warmed up (its graphs compiled), and the prompts (token ids)."""
    import os

    import torch

    from xllm_py import LLM

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # as the daemon's core process
    llm = LLM(**engine_options(args, k))
    prompts = held_out_prompts(llm, args.prompts)
    decode_run(llm, prompts[:1], args.new_tokens)  # warm-up (graphs compile here)
    return llm, prompts


def offline_ms_per_token(llm, prompt: list[int], new_tokens: int) -> float:
    return 1000 * decode_run(llm, [prompt], new_tokens)["decode_s"] / (new_tokens - 1)


def tpot(url: str, prompt: list[int], new_tokens: int) -> float:
    """ms between tokens of one streamed completion (first to last arrival)."""
    body = dict(prompt=prompt, max_tokens=new_tokens, temperature=0, ignore_eos=True,
                stream=True, stream_options={"include_usage": True})  # fmt: skip
    first = last = None
    tokens_first = tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                last = time.perf_counter()
                if first is None:
                    first, tokens_first = last, 1
    if tokens != new_tokens or first is None:
        raise RuntimeError(f"expected {new_tokens} streamed tokens, got {tokens}")
    return 1000 * (last - first) / (tokens - tokens_first)


def side_by_side(args, k: int) -> tuple[float, float]:
    """Median offline ms per token and serving TPOT, the two taking turns prompt by prompt."""
    llm, prompts = offline_engine(args, k)
    flags = [f"--{name}={value}" for name, value in engine_options(args, k).items()]
    off, srv = [], []
    with Server(*flags, startup_timeout=900) as s:
        warm_up(s.url)
        tpot(s.url, prompts[0], args.new_tokens)  # warm-up, as offline
        for _ in range(args.rounds):
            for p in prompts:
                off.append(offline_ms_per_token(llm, p, args.new_tokens))
                srv.append(tpot(s.url, p, args.new_tokens))
    close(llm)
    return statistics.median(off), statistics.median(srv)


def startup(args, prompt: list[int], cache_dir: str) -> dict:
    """One start of the default daemon (MTP k = the last --k)."""
    flags = [f"--num_speculative_tokens={args.k[-1]}", f"--compile_cache_dir={cache_dir}"]
    t0 = time.monotonic()
    with Server(*flags, startup_timeout=900) as s:
        healthy = time.monotonic() - t0
        at_once = tpot(s.url, prompt, args.new_tokens)
        while COMPILED not in s.output():
            if time.monotonic() - t0 > 1800:
                raise RuntimeError(f"graphs not compiled in 1800 s:\n{s.output()[-2000:]}")
            time.sleep(0.5)
        compiled = time.monotonic() - t0
        after = statistics.median(tpot(s.url, prompt, args.new_tokens) for _ in range(3))
    return dict(healthy_s=healthy, tpot_at_once_ms=at_once, compiled_s=compiled,
                tpot_compiled_ms=after)  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, FLAGS).parse_args(argv)
    if args.startup:
        import tempfile

        from xllm_py import LLM

        prompt = held_out_prompts(LLM(**engine_options(args, 0)), 1)[0]
        with tempfile.TemporaryDirectory() as cache:
            runs = {run: startup(args, prompt, cache) for run in ("fresh", "restart")}
        for run, row in runs.items():
            print_block(f"start-up, {run} compile cache", [(k, f"{v:.2f}") for k, v in row.items()])
        result = dict(command=command("serving_overhead", argv), machine=machine(), **runs)
        write_json(args.out or RESULTS / "serving_startup.json", result)
        return result
    rows = []
    for k in args.k:
        off, srv = side_by_side(args, k)
        rows.append(dict(k=k, offline_ms_per_token=off, serving_tpot_ms=srv, ratio=srv / off))
        print_block(
            f"k={k}{' graph' if args.graph else ''}",
            [("offline ms/token", f"{off:.2f}"), ("serving TPOT ms", f"{srv:.2f}"),
             ("serving / offline", f"{srv / off:.2f}x")],
        )  # fmt: skip
    result = dict(command=command("serving_overhead", argv), machine=machine(), rows=rows)
    write_json(args.out or RESULTS / "serving_overhead.json", result)
    return result


if __name__ == "__main__":
    main()
