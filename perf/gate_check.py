#!/usr/bin/env python3
"""Does --speculative_confidence=auto pick the faster kind of step? One process, no HTTP:
three engines on the same checkpoint, their rounds interleaved, each round the same
prompts for all three:

    plain    num_speculative_tokens=0
    auto     MTP k with the defaults (the gate decides per batch size whether steps draft)
    always   MTP k with --speculative_confidence=off (every step drafts, every draft verified)

    python -m perf.gate_check --k 3 --concurrency 8 --draft-vocab-size 512 --graph
    python -m perf.gate_check --k 1 --concurrency 4 --rounds 8

A round is a closed loop at --concurrency: --num-prompts random-id prompts of --input-len
tokens with output lengths drawn from --output-len (so requests finish at different steps,
as a server's do), at most --concurrency running, greedy, EOS ignored. Output tok/s per
round; the per-round ratios to plain and their medians are printed and written to
--out. Round 0 is a warm-up (the gate's first measurements, graph warm-up) and is not
counted. The serving sweep (perf/mtp_sweep.py --rounds) measures the same through the
daemon, HTTP and a second process included; here only the engines run, but a shared
2-core machine still moves single rounds by 10-25% (the committed run's ratios to plain
spread from 0.86x to 1.26x), so use enough rounds for the medians to settle.

--interleave step runs a round's three engines together instead, one step of each in
turn (the order rotated every step), each timed by a clock that counts its own steps
only (so the gate's step timings are its engine's alone). The machine's drift then falls
on all three alike within a few milliseconds, and a round's ratios move by 1-2% where
whole rounds in turn move by 10% and more: the way to see what a change to the gate
costs or saves. What it leaves out is what running alone adds (the caches each engine
would have to itself).
"""

from __future__ import annotations

import itertools
import random
import statistics
import time

from perf.common import RESULTS, command, machine, parser, print_block, settings, write_json

ARMS = ("plain", "auto", "always")

FLAGS = [
    ("--model", str, None, "checkpoint directory (None: the bundled model)"),
    ("--k", int, 1, "MTP draft tokens of the auto and always engines"),
    ("--concurrency", int, 4, "requests running at once"),
    ("--num-prompts", int, 24, "requests per round"),
    ("--input-len", int, 256, "prompt tokens (random ids)"),
    ("--output-len", int, [64, 192], "output tokens: N, or LOW HIGH drawn per request"),
    ("--rounds", int, 5, "counted rounds (after one warm-up round)"),
    ("--draft-vocab-size", str, "auto",
     "--speculative_draft_vocab_size of the MTP engines (0: whole; auto: the engine's default)"),
    ("--graph", bool, False, "graph mode, buckets 1, 2, 4, 8 (compiles at start-up: minutes)"),
    ("--dtype", str, "float32", "weights and activations"),
    ("--interleave", ("round", "step"), "round",
     "round: the engines run a whole round each, in turn; step: one step each, in turn"),
    ("--out", str, str(RESULTS / "gate_check.json"), "result JSON"),
]  # fmt: skip


def engine_options(args) -> dict:
    """LLM keywords of --model, --dtype, --graph and --concurrency (its batch limit)."""
    return dict(
        dtype=args.dtype,
        max_seqs_per_batch=args.concurrency,
        enable_graph=args.graph,
        **({"model": args.model} if args.model else {}),
    )


def engines(args) -> dict:
    from xllm_py import LLM

    common = engine_options(args)
    mtp = dict(
        common, num_speculative_tokens=args.k, speculative_draft_vocab_size=args.draft_vocab_size
    )
    return {
        "plain": LLM(**common),
        "auto": LLM(**mtp),
        "always": LLM(**mtp, speculative_confidence="off"),
    }


_ids = itertools.count()


def add_requests(engine, prompts: list[list[int]], lengths: list[int]) -> None:
    """One greedy request per prompt, EOS ignored, generating its length's tokens."""
    from xllm_py import SamplingParams

    for p, n in zip(prompts, lengths):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine.add_request(f"g{next(_ids)}", {"prompt_token_ids": p}, params)


def run_round(llm, prompts: list[list[int]], lengths: list[int]) -> float:
    """Output tokens per second of one closed-loop round."""
    engine = llm.engine
    add_requests(engine, prompts, lengths)
    tokens, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += finished_tokens(engine.step())
    return tokens / (time.perf_counter() - t0)


def finished_tokens(outputs: list) -> int:
    """Output tokens of the requests a step finished."""
    return sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)


class StepClock:
    """An engine's clock under --interleave step: the seconds of its own steps, not of the
    other engines' steps run between them."""

    def __init__(self) -> None:
        self.spent, self.started = 0.0, None

    def __call__(self) -> float:
        now = time.perf_counter()
        return self.spent + (now - self.started if self.started is not None else 0.0)

    def step(self, engine) -> list:
        self.started = time.perf_counter()
        try:
            return engine.step()
        finally:
            self.spent += time.perf_counter() - self.started
            self.started = None


def run_together(llms: dict, prompts: list[list[int]], lengths: list[int]) -> dict[str, float]:
    """Output tokens per second of each engine over one round, the engines stepped in turn
    (the order rotated every turn): its tokens over the seconds of its own steps."""
    engines = {arm: llm.engine for arm, llm in llms.items()}
    clocks = {arm: StepClock() for arm in engines}
    for arm, engine in engines.items():
        engine.core.clock = clocks[arm]
        add_requests(engine, prompts, lengths)
    tokens = dict.fromkeys(engines, 0)
    arms = list(engines)
    for turn in itertools.count():
        i = turn % len(arms)
        busy = [a for a in arms[i:] + arms[:i] if engines[a].has_unfinished()]
        if not busy:
            break
        for arm in busy:
            tokens[arm] += finished_tokens(clocks[arm].step(engines[arm]))
    return {arm: tokens[arm] / clocks[arm].spent for arm in arms}


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, FLAGS).parse_args(argv)
    low, high = (args.output_len * 2)[:2]
    llms = engines(args)
    vocab = llms["plain"].engine.config.model.vocab_size
    rates: dict[str, list[float]] = {a: [] for a in ARMS}
    for r in range(args.rounds + 1):
        rnd = random.Random(r)  # new prompts each round: no prefix-cache hits across rounds
        prompts = [
            [rnd.randrange(2, vocab) for _ in range(args.input_len)]
            for _ in range(args.num_prompts)
        ]
        lengths = [rnd.randint(low, high) for _ in prompts]
        order = ARMS[r % 3 :] + ARMS[: r % 3]  # rotated by the round
        if args.interleave == "step":
            got = run_together({arm: llms[arm] for arm in order}, prompts, lengths)
        else:
            got = {arm: run_round(llms[arm], prompts, lengths) for arm in order}
        for arm, rate in got.items():
            print(f"round {r}{' (warm-up)' if r == 0 else ''}, {arm}: {rate:.1f} output tok/s")
            if r:
                rates[arm].append(rate)
    ratios = {a: [x / p for x, p in zip(rates[a], rates["plain"])] for a in ("auto", "always")}
    gate = llms["auto"].engine.core.scheduler.confidence.gate
    result = {
        "command": command("gate_check", argv),
        "machine": machine(),
        "settings": settings(args),
        "output_tok_s": rates,
        "median_tok_s": {a: statistics.median(v) for a, v in rates.items()},
        "ratio_to_plain": ratios,
        "median_ratio_to_plain": {a: statistics.median(v) for a, v in ratios.items()},
        "auto_steps": {"drafting": gate.steps[True], "not_drafting": gate.steps[False]},
    }
    print_block(
        f"gate check: k={args.k}, concurrency {args.concurrency}, {args.rounds} rounds",
        [(f"{a} median output tok/s", f"{result['median_tok_s'][a]:.1f}") for a in ARMS]
        + [(f"{a} median ratio to plain", f"{result['median_ratio_to_plain'][a]:.3f}")
           for a in ("auto", "always")]
        + [("auto: steps drafting / not", f"{gate.steps[True]} / {gate.steps[False]}")],
    )  # fmt: skip
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
