#!/usr/bin/env python3
"""Acceptance vs cost of a hot-vocabulary MTP draft head (--speculative_draft_vocab_size).

    python -m perf.hot_vocab                       # bundled model, its token map
    python -m perf.hot_vocab --sizes 256 1024 0 --k 1 2 --prompts 16 --tokens 48

For each draft vocabulary size N (0 = the whole vocabulary) and each k, one engine
decodes held-out ShareGPT prompts one at a time (concurrency 1, greedy, float32) and the
script reports the mean acceptance length, ms per output token and output tokens/s; a
plain (k = 0) engine is the baseline. The engines' timed runs are interleaved over
--rounds, and the median round counts, so machine noise hits every configuration alike.
Writes JSON (--output); the best N per k is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from xllm_py import LLM, SamplingParams
from xllm_py.sharegpt import held_out_user_turns

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_OUTPUT = ROOT / "perf/results/hot_vocab.json"


def build(model: str | None, k: int, size: int) -> LLM:
    kw = dict(num_speculative_tokens=k, speculative_draft_vocab_size=size) if k else {}
    # one request at a time: a small cache, so a dozen engines fit in RAM together
    return LLM(model=model, dtype="float32", max_seqs_per_batch=1, max_cache_size=64 << 20, **kw)


def one_round(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    """Seconds and output tokens for the prompts, one request at a time."""
    start, tokens = time.perf_counter(), 0
    for p in prompts:
        tokens += len(llm.generate([p], params)[0].outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="checkpoint dir with a token map (default: the bundled one)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 0], help="N (0 = all)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2], help="draft tokens per step")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per round")
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per prompt")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    configs = [(0, 0)] + [(k, n) for k in a.k for n in a.sizes]
    engines = {c: build(a.model, *c) for c in configs}
    tok = engines[(0, 0)].get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}])
        for t in held_out_user_turns(a.prompts, 20, 600)
    ]
    for llm in engines.values():  # warm-up (and each engine's first allocations)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))
    times = {c: [] for c in configs}
    for r in range(a.rounds):
        for c, llm in engines.items():
            seconds, tokens = one_round(llm, prompts, params)
            times[c].append(seconds / tokens)
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    rows = []
    base = statistics.median(times[(0, 0)])
    for (k, n), llm in engines.items():
        per_token = statistics.median(times[(k, n)])
        m = llm.get_metrics()
        rows.append(
            {
                "k": k,
                "draft_vocab_size": n,
                "mean_acceptance_length": round(m.mean_acceptance_length, 3) if k else 1.0,
                "ms_per_token": round(1000 * per_token, 3),
                "tokens_per_s": round(1 / per_token, 1),
                "speedup_vs_plain": round(base / per_token, 3),
            }
        )
    print(f"\n{'k':>2} {'N':>6} {'accept len':>10} {'ms/token':>9} {'tok/s':>7} {'vs plain':>8}")
    for r in rows:
        n = r["draft_vocab_size"] or "all"
        print(
            f"{r['k']:>2} {n:>6} {r['mean_acceptance_length']:>10} {r['ms_per_token']:>9} "
            f"{r['tokens_per_s']:>7} {r['speedup_vs_plain']:>8}"
        )
    for k in a.k:
        best = max((r for r in rows if r["k"] == k), key=lambda r: r["tokens_per_s"])
        print(f"k={k}: fastest with N = {best['draft_vocab_size'] or 'all'}")
    a.output.parent.mkdir(parents=True, exist_ok=True)
    meta = {"prompts": a.prompts, "tokens": a.tokens, "rounds": a.rounds, "threads": a.threads}
    a.output.write_text(json.dumps({"settings": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
