"""What structured outputs cost: output tokens/s with and without a JSON schema, k = 0
and 1, offline on the bundled model, held-out chat prompts, greedy, arms interleaved over
--rounds (medians). The `none` arm generates for each prompt exactly as many tokens as the
schema gave it, so the arms differ only by the grammar; `json_schema` fills the bitmask in
line, `json_schema_overlapped` in a helper thread during the forward.

    .venv/bin/python -m perf.structured_cost        # about 2 minutes here
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from perf.common import (
    RESULTS,
    chat_prompts,
    command,
    machine,
    md_table,
    parser,
    settings,
    write_json,
)  # fmt: skip
from xllm_py import LLM, SamplingParams
from xllm_py.sampling_params import StructuredOutput

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


FLAGS = [  # (flag, type, default, help)
    ("--prompts", int, 32, "held-out chat prompts"),
    ("--max-tokens", int, 64, "max_tokens of each request"),
    ("--rounds", int, 3, "interleaved rounds of every arm"),
    ("--output", Path, RESULTS / "structured_cost.json", "result JSON"),
]


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, FLAGS).parse_args(argv)
    engines = {k: LLM(dtype="float32", num_speculative_tokens=k) for k in (0, 1)}
    prompts = chat_prompts(engines[0].get_tokenizer(), args.prompts, 20, 600)
    schema = SamplingParams(
        max_tokens=args.max_tokens, temperature=0,
        structured=StructuredOutput("json", json.dumps(SCHEMA)),
    )  # fmt: skip
    lengths = [len(o.outputs[0].token_ids) for o in engines[0].generate(prompts, schema)]
    same_length = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    # arm -> (params, fill the bitmask during the forward?)
    arms = {
        "none": (same_length, False), "json_schema": (schema, False),
        "json_schema_overlapped": (schema, True),
    }  # fmt: skip
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
                }  # fmt: skip
            )
    med = {(r["k"], r["constraint"]): r["median_output_tok_s"] for r in rows}
    print(md_table(["k", "constraint", "output tok/s", "vs none"], [
        [r["k"], r["constraint"], f"{r['median_output_tok_s']:.1f}",
         f"{r['median_output_tok_s'] / med[r['k'], 'none']:.2f}"] for r in rows]))  # fmt: skip
    result = {"command": command("structured_cost", argv), "machine": machine(),
              "settings": settings(args), "schema": SCHEMA, "rows": rows}  # fmt: skip
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
