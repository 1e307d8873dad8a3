"""What structured outputs cost: output tokens/s with and without a JSON schema, plain
decoding (k = 0) and MTP (k = 1), offline on the bundled model.

    .venv/bin/python -m perf.structured_cost        # about 2 minutes here

--prompts held-out ShareGPT chat prompts, greedy, up to --max-tokens each; the schema
arm asks each for an object of a few bounded fields. The grammar ends those outputs
early, and shorter outputs alone lower tokens/s (the prompt's prefill is shared by fewer
tokens), so the `none` arm generates, for each prompt, exactly as many tokens as the
schema gave it (ignore_eos): the arms differ only by the grammar. Arms run --rounds times,
interleaved; medians are reported with MTP's acceptance rate. The grammar's cost is
per token and per row: a bitmask filled for each verified row and each draft. The
verified rows' bitmask can be filled in a helper thread while the forward runs (the
runner's overlap_grammar, on by default on accelerators, off on CPU): `json_schema`
fills it in line, `json_schema_overlapped` in the thread, to measure what the overlap
buys here. Writes perf/results/structured_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from perf.daemon import machine
from xllm_py import LLM, SamplingParams
from xllm_py.sampling_params import StructuredOutput
from xllm_py.sharegpt import held_out_user_turns

ROOT = Path(__file__).resolve().parent.parent

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}


def run_arm(llm: LLM, prompts: list[str], params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, tokens


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=32, help="held-out chat prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", default=str(ROOT / "perf/results/structured_cost.json"))
    args = p.parse_args(argv)
    engines = {k: LLM(dtype="float32", num_speculative_tokens=k) for k in (0, 1)}
    tok = engines[0].get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}])
        for t in held_out_user_turns(args.prompts, 20, 600)
    ]
    schema = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0,
        structured=StructuredOutput("json", json.dumps(SCHEMA)),
    )
    lengths = [len(o.outputs[0].token_ids) for o in engines[0].generate(prompts, schema)]
    same_length = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    # arm -> (params, fill the bitmask during the forward?)
    arms = {
        "none": (same_length, False),
        "json_schema": (schema, False),
        "json_schema_overlapped": (schema, True),
    }
    for llm in engines.values():  # warm-up: first compile, allocator, caches
        for params, overlap in arms.values():
            llm.engine.core.executor.worker.runner.overlap_grammar = overlap
            run_arm(llm, prompts[:4], params if isinstance(params, SamplingParams) else params[:4])
    rates: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for k, llm in engines.items():
            for name, (params, overlap) in arms.items():
                llm.engine.core.executor.worker.runner.overlap_grammar = overlap
                rate, n = run_arm(llm, prompts, params)
                rates.setdefault(f"k{k}-{name}", []).append(rate)
                tokens[f"k{k}-{name}"] = n
    rows = []
    for k in engines:
        m = engines[k].get_metrics() if k else None
        for name in arms:
            key = f"k{k}-{name}"
            rows.append(
                {
                    "k": k,
                    "constraint": name,
                    "output_tok_s": rates[key],
                    "median_output_tok_s": statistics.median(rates[key]),
                    "output_tokens_per_round": tokens[key],
                    "acceptance_rate_all_arms": None if m is None else m.acceptance_rate,
                }
            )
    med = {(r["k"], r["constraint"]): r["median_output_tok_s"] for r in rows}
    print(f"{'k':>2} {'constraint':>22} {'output tok/s':>13} {'vs none':>8}")
    for r in rows:
        ratio = r["median_output_tok_s"] / med[(r["k"], "none")]
        print(f"{r['k']:>2} {r['constraint']:>22} {r['median_output_tok_s']:13.1f} {ratio:8.2f}")
    result = {
        "command": "python -m perf.structured_cost " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "schema": SCHEMA,
        "rows": rows,
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
