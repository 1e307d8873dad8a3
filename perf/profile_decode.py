#!/usr/bin/env python3
"""Where a decode step's time goes, with and without MTP drafts (cProfile, batch 1).

    python perf/profile_decode.py                     # k = 0 and 1, float32
    python perf/profile_decode.py --k 0 2 --dtype bfloat16 --tokens 256 --compare-dtypes

One held-out ShareGPT prompt (chat template), greedy, EOS ignored. Each k gets its own
engine; their timed runs are interleaved (--rounds, median ms/token), then each
generation is run once under cProfile for the cumulative time of the pieces of a step:
the target forward, logits, attention layout, the MTP proposer (its forward and head),
verification, the per-layer MLA / MoE calls, in ms and as a share of the step. Plain
decoding is then timed in float32 and bfloat16, interleaved (--compare-dtypes; the
basis of dtype="auto" on CPU). Writes JSON with --output.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from xllm_py import LLM, SamplingParams  # noqa: E402
from xllm_py.sharegpt import held_out_user_turns  # noqa: E402


def _pieces() -> dict:
    """label -> the function whose cumulative time it reports."""
    from xllm_py.engine.engine_core import EngineCore
    from xllm_py.models.deepseek_mtp import DeepseekV3MTP
    from xllm_py.models.deepseek_v3 import DeepseekV3ForCausalLM
    from xllm_py.models.layers.mla import MLAttention
    from xllm_py.models.layers.moe import MoE
    from xllm_py.speculative.mtp_proposer import MTPProposer
    from xllm_py.models import attention_layout
    from xllm_py.worker import rejection_sampler
    from xllm_py.worker.model_runner import ModelRunner

    return {
        "engine step": EngineCore.step,
        "target forward": ModelRunner._forward,
        "logits (target and draft)": DeepseekV3ForCausalLM.compute_logits,
        "attention layout": attention_layout.build_context,
        "MTP proposer": MTPProposer.propose,
        "MTP forward": DeepseekV3MTP.forward,
        "verification": rejection_sampler.verify,
        "MLA layer": MLAttention.forward,
        "MoE layer": MoE.forward,
        "routed experts": MoE._routed,
    }


def _key(fn) -> tuple[str, int, str]:
    """cProfile's key of a function: (file, first line, name)."""
    code = inspect.unwrap(fn).__code__
    return code.co_filename, code.co_firstlineno, code.co_name


def first_prompt(llm: LLM) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": held_out_user_turns(1, 20, 600)[0]}]
    )


def interleaved_ms_per_token(llms: dict, prompt: str, params, rounds: int) -> dict:
    """Median ms/token of each engine, runs interleaved (this machine's speed drifts by
    tens of percent within minutes, so separate runs are not comparable)."""
    for llm in llms.values():
        llm.generate([prompt], params)  # warm-up
    runs: dict = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            llm.generate([prompt], params)
            runs[name].append(1000 * (time.perf_counter() - t0) / params.max_tokens)
    return {name: sorted(v)[len(v) // 2] for name, v in runs.items()}


def breakdown(llm: LLM, prompt: str, params) -> dict:
    """One cProfiled generation: per engine step, each piece's cumulative ms and its share
    of the step (shares compare across runs; the ms include cProfile's overhead)."""
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompt], params)
    prof.disable()
    stats = pstats.Stats(prof).stats  # key -> (primitive calls, calls, own, cumulative, ...)
    pieces = _pieces()
    steps = stats[_key(pieces["engine step"])][1]
    step_s = stats[_key(pieces["engine step"])][3]
    out = {"steps": steps}
    for label, fn in pieces.items():
        if _key(fn) in stats:
            _, calls, _, cumulative, _ = stats[_key(fn)]
            out[label] = {
                "ms_per_step": 1000 * cumulative / steps,
                "share_of_step": cumulative / step_s,
                "calls_per_step": calls / steps,
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1], help="draft tokens per step")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--tokens", type=int, default=128, help="tokens to generate")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument(
        "--compare-dtypes",
        nargs="*",
        default=["float32", "bfloat16"],
        help="also time plain decoding in these dtypes, interleaved (none: skip)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed runs per engine")
    ap.add_argument("--output", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llms = {k: LLM(dtype=args.dtype, num_speculative_tokens=k) for k in args.k}
    prompt = first_prompt(next(iter(llms.values())))
    timing = interleaved_ms_per_token(llms, prompt, params, args.rounds)
    results = []
    for k, llm in llms.items():
        parts = breakdown(llm, prompt, params)
        m = llm.get_metrics()
        length = m.mean_acceptance_length if k else 1.0
        results.append({"k": k, "ms_per_token": timing[k], "acceptance_length": length, **parts})
        print(
            f"k={k} {args.dtype}: {timing[k]:.2f} ms/token (median, interleaved), "
            f"acceptance length {length:.2f}; per step, under cProfile:"
        )
        for label, v in parts.items():
            if label != "steps":
                print(
                    f"    {label:28s} {v['ms_per_step']:6.2f} ms  {100 * v['share_of_step']:5.1f}%"
                    f"  ({v['calls_per_step']:.0f} calls)"
                )
    dtypes = {}
    if args.compare_dtypes:
        dtypes = interleaved_ms_per_token(
            {dt: LLM(dtype=dt) for dt in args.compare_dtypes}, prompt, params, args.rounds
        )
        for dt, ms in dtypes.items():
            print(f"plain decoding, {dt}: {ms:.2f} ms/token (median, interleaved)")
    if args.output:
        out = {"command": " ".join(sys.argv), "results": results, "dtypes_ms_per_token": dtypes}
        args.output.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
