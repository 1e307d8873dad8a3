#!/usr/bin/env python3
"""Graph mode's exactness bar at scale: greedy tokens and logprobs with graphs on vs off.

    python perf/graph_exactness.py                       # 100 prompts, batch 1 8 64, k 0 1 3
    python perf/graph_exactness.py --prompts 20 --batch-sizes 8 --k 1

Held-out ShareGPT prompts (first user turns, chat template), float32, greedy, the
bundled model with its MTP draft. For each batch size b and each k, two engines with
at most b requests per step: eager, and graph mode with the one bucket b (so the steps
where fewer than b requests remain run padded). Reports per (b, k) the prompts whose
tokens differ, the largest logprob difference over the tokens both emitted, the steps
that ran in each graph, and the compile time. The graph buckets of a large b take the
dense MoE form, which compiles slowly (minutes per graph on 2 cores).

Writes perf/results/graph_exactness.json (override with --output); exits 1 when any
prompt's tokens differ or a logprob differs by more than --tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from xllm_py import LLM, SamplingParams  # noqa: E402
from xllm_py.sharegpt import held_out_user_turns  # noqa: E402


def decode(llm: LLM, prompts: list[str], params: SamplingParams):
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    tokens = [o.token_ids for o in outs]
    logprobs = [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]
    return tokens, logprobs


def compare(prompts, params, batch: int, k: int, tolerance: float) -> dict:
    common = dict(dtype="float32", block_size=16, max_seqs_per_batch=batch)
    common["num_speculative_tokens"] = k
    eager_tokens, eager_lp = decode(LLM(**common), prompts, params)
    t0 = time.perf_counter()
    llm = LLM(enable_graph=True, graph_batch_sizes=[batch], **common)
    start_s = time.perf_counter() - t0
    tokens, lp = decode(llm, prompts, params)
    runner = llm.engine.core.executor.worker.runner
    graph_steps = {f"target B{b} Q{q}": n for (b, q), n in runner.graphs.steps.items()}
    if runner.proposer is not None:
        for layer, g in runner.proposer.graphs.items():
            graph_steps |= {f"MTP layer {layer} B{b} Q{q}": n for (b, q), n in g.steps.items()}
    differ = [i for i, (a, b) in enumerate(zip(tokens, eager_tokens)) if a != b]
    # where each differing prompt first emits another token; logprobs are compared up to
    # there (past it the two runs score different tokens in different contexts)
    first = {
        i: next(
            (j for j, (x, y) in enumerate(zip(tokens[i], eager_tokens[i])) if x != y),
            min(len(tokens[i]), len(eager_tokens[i])),
        )
        for i in differ
    }
    max_diff = max(
        (
            abs(x - y)
            for i, (got, want) in enumerate(zip(lp, eager_lp))
            for x, y in list(zip(got, want))[: first.get(i)]
        ),
        default=0.0,
    )
    # of the prompts whose tokens are identical, and per differing prompt the first token
    # whose logprob is off by more than the tolerance (a flipped routing tie shows there,
    # a few tokens before the outputs part)
    max_diff_matching = max(
        (
            abs(x - y)
            for i, (got, want) in enumerate(zip(lp, eager_lp))
            if i not in first
            for x, y in zip(got, want)
        ),
        default=0.0,
    )
    first_off = {
        i: next(
            (j for j, (x, y) in enumerate(zip(lp[i], eager_lp[i])) if abs(x - y) > tolerance),
            None,
        )
        for i in differ
    }
    row = {
        "batch": batch,
        "k": k,
        "prompts": len(prompts),
        "tokens_compared": sum(len(t) for t in eager_tokens),
        "prompts_differing": differ,
        "first_differing_token": first,
        "first_logprob_off_by_more_than_tolerance": first_off,
        "max_logprob_diff_identical_prompts": max_diff_matching,
        "max_logprob_diff": max_diff,
        "graph_steps": graph_steps,
        "graph_start_s": start_s,
        "ok": not differ and max_diff <= tolerance,
    }
    print(
        f"batch {batch:>3} k={k}: {len(differ)} of {len(prompts)} prompts differ, "
        f"max |logprob diff| {max_diff:.2e}, graph steps {graph_steps}, "
        f"start {start_s:.0f} s  {'OK' if row['ok'] else 'FAIL'}",
        flush=True,
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=100, help="held-out ShareGPT prompts")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1, 3], help="draft tokens per step")
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens generated per prompt")
    ap.add_argument("--tolerance", type=float, default=1e-5, help="largest logprob difference")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--output", default=str(ROOT / "perf/results/graph_exactness.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = LLM(dtype="float32").get_tokenizer()
    texts = held_out_user_turns(args.prompts, 20, 600)
    if len(texts) < args.prompts:
        raise SystemExit(f"--prompts={args.prompts}: only {len(texts)} held-out prompts found")
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=0)
    rows = [
        compare(prompts, params, b, k, args.tolerance) for b in args.batch_sizes for k in args.k
    ]
    result = {
        "benchmark": "graph mode exactness: greedy tokens and logprobs, graphs on vs off",
        "command": "python perf/graph_exactness.py " + " ".join(sys.argv[1:]),
        "dtype": "float32",
        "max_tokens": args.max_tokens,
        "tolerance": args.tolerance,
        "torch": torch.__version__,
        "results": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
