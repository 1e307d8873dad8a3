#!/usr/bin/env python3
"""What a closed-loop benchmark with fixed output lengths charges a method that lets its
requests drift apart. Plain decoding only, one engine, no HTTP:

    lockstep   every request generates --output-len tokens; the first wave starts together,
               so its requests finish on the same step and the next wave is admitted (and
               prefilled) together, to the end of the run
    staggered  the same, except the first wave's lengths are spread (output-len / c,
               2 x output-len / c, ...), so requests finish one at a time from then on, as
               they do once MTP drafting has desynchronised them (requests accept different
               numbers of drafts), whatever the engine decides afterwards

    python -m perf.lockstep --model xllm_py/assets/small-deepseek-v3-mtp --graph
    python -m perf.lockstep --model xllm_py/assets/small-deepseek-v3-mtp --graph --num-prompts 96

perf/mtp_sweep.py's cpu preset is such a benchmark (256 in, 128 out, ignore_eos, a
closed loop of --concurrency clients). Each round prints output tok/s per arm (the
staggered arm emits fewer tokens: its first wave is shorter) and the seconds per kind of
step: decode steps by batch size, steps that admit requests (a prompt chunk with or
without decodes beside it). The result JSON keeps every round's figures.
"""

from __future__ import annotations

import random
import statistics
import time

from perf.common import RESULTS, command, machine, parser, print_block, settings, write_json
from perf.gate_check import add_requests, engine_options

ARMS = ("lockstep", "staggered")

FLAGS = [
    ("--model", str, None, "checkpoint directory (None: the bundled model)"),
    ("--concurrency", int, 4, "requests running at once"),
    ("--num-prompts", int, 24, "requests per round (mtp_sweep's cpu preset: max(24, 2c))"),
    ("--input-len", int, 256, "prompt tokens (random ids)"),
    ("--output-len", int, 128, "output tokens of every request, EOS ignored"),
    ("--rounds", int, 4, "counted rounds (after one warm-up round)"),
    ("--graph", bool, False, "graph mode (compiles at start-up: minutes)"),
    ("--dtype", str, "float32", "weights and activations"),
    ("--out", str, str(RESULTS / "lockstep.json"), "result JSON"),
]  # fmt: skip


def lengths(args, arm: str) -> list[int]:
    out = [args.output_len] * args.num_prompts
    if arm == "staggered":
        c = min(args.concurrency, args.num_prompts)
        out[:c] = [args.output_len * (i + 1) // c for i in range(c)]
    return out


def run_round(engine, prompts: list[list[int]], limits: list[int]) -> dict:
    """One closed-loop round: output tok/s, and seconds and count per kind of step."""
    add_requests(engine, prompts, limits)
    sched = engine.core.scheduler
    kinds: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        running, waiting = len(sched.running), len(sched.waiting)
        t = time.perf_counter()
        engine.step()
        admitted = waiting - len(sched.waiting)
        kind = f"admit {admitted} beside {running}" if admitted else f"decode batch {running}"
        kinds.setdefault(kind, []).append(time.perf_counter() - t)
    seconds = time.perf_counter() - t0
    return {
        "output_tok_s": sum(limits) / seconds,
        "seconds": seconds,
        "steps": {k: {"count": len(v), "seconds": sum(v), "median_ms": 1e3 * statistics.median(v)}
                  for k, v in sorted(kinds.items())},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, FLAGS).parse_args(argv)
    from xllm_py import LLM

    llm = LLM(**engine_options(args))
    vocab = llm.engine.config.model.vocab_size
    rounds: dict[str, list[dict]] = {a: [] for a in ARMS}
    for r in range(args.rounds + 1):
        for arm in ARMS[r % 2 :] + ARMS[: r % 2]:  # order rotated by the round
            rnd = random.Random(f"{r}-{arm}")  # prompts of their own: no prefix-cache hits
            prompts = [[rnd.randrange(2, vocab) for _ in range(args.input_len)]
                       for _ in range(args.num_prompts)]  # fmt: skip
            res = run_round(llm.engine, prompts, lengths(args, arm))
            steps = ", ".join(f"{k} {s['count']} x {s['median_ms']:.1f} ms"
                              for k, s in res["steps"].items())  # fmt: skip
            warm = " (warm-up)" if r == 0 else ""
            print(f"round {r}{warm}, {arm}: {res['output_tok_s']:.1f} output tok/s; {steps}")
            if r:
                rounds[arm].append(res)
    rates = {a: [x["output_tok_s"] for x in v] for a, v in rounds.items()}
    ratios = [s / p for s, p in zip(rates["staggered"], rates["lockstep"])]
    result = {
        "command": command("lockstep", argv),
        "machine": machine(),
        "settings": settings(args),
        "rounds": rounds,
        "median_tok_s": {a: statistics.median(v) for a, v in rates.items()},
        "staggered_over_lockstep": ratios,
        "median_ratio": statistics.median(ratios),
    }
    print_block(
        f"lockstep check: concurrency {args.concurrency}, {args.num_prompts} prompts, "
        f"{args.rounds} rounds",
        [(f"{a} median output tok/s", f"{result['median_tok_s'][a]:.1f}") for a in ARMS]
        + [("staggered / lockstep, per round", " ".join(f"{x:.3f}" for x in ratios)),
           ("median ratio", f"{result['median_ratio']:.3f}")],
    )  # fmt: skip
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
