#!/usr/bin/env python3
"""Offline decode throughput: xllm-py's engine vs HF transformers `generate`.

Same tiny DeepSeek-V3 checkpoint, same prompts (random token ids, equal
lengths so HF needs no padding), greedy, EOS ignored. Decode tokens/s counts
only tokens after the first: prefill time is measured separately and left
out (for HF: time(generate N) - time(generate 1)). Both sides run in one
process, side by side, so the ratio is measured under the same conditions.

    python -m perf.bench_offline                      # the bundled model
    python -m perf.bench_offline --random-model       # random, the probe shape (docs/design.md)
    python -m perf.bench_offline --model DIR --batch-sizes 1 32 --new-tokens 128
    python -m perf.bench_offline --graph --graph-k 0 1 --batch-sizes 1 4 8   # graph mode

Writes perf/results/bench_offline.json (override with --output). What one step costs
(ms per step, tokens per step, in plain steps, and where the time goes) is
perf/step_cost.py's (`--measure`, `--graph`); this script times whole decodes.

With --spec K [K ...] it instead measures MTP speculative decoding on held-out
ShareGPT prompts (first user turns, chat template applied): for each batch size
and each k, output tokens/s of the engine with k draft tokens, speedup over
k = 0 measured in the same run, mean acceptance length (tokens per target
pass) and efficiency = speedup / mean acceptance length. Writes
perf/results/bench_spec.json by default.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from perf.step_cost import decode_run, prompts_for

ROOT = Path(__file__).resolve().parent.parent

# The probe shape (docs/design.md section 6): 4 layers, hidden 256, 8 routed experts.
DEFAULT_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_rope_head_dim=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=512,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)


def build_default_model(out: Path) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**DEFAULT_CONFIG))
    # Fan-in-scaled weights keep activations at trained-model magnitudes. HF's default
    # (std 0.02 everywhere) shrinks them into float32 denormals, which are ~10x slower on
    # x86 and would measure the FPU's slow path rather than either engine.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 if "embed" in name else p.shape[-1] ** -0.5)
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.uniform_(0, 0.1)
    model.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"built tiny DeepSeek-V3 ({params / 1e6:.1f}M parameters) in {out}")
    return out


def build_ours(model_dir: Path, batch: int, dtype: str, graph: bool = False, k: int = 0):
    """The engine; with `graph`, one graph bucket of exactly `batch` (compiled here)."""
    from xllm_py import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        block_size=128,
        max_seqs_per_batch=max(batch, 1),
        enable_graph=graph,
        graph_batch_sizes=[batch],
        num_speculative_tokens=k,
    )
    llm.start_s = time.perf_counter() - t0
    return llm


def run_ours(llm, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Decode tokens/s of one batch of random prompts, after an untimed run of the same."""
    prompts = prompts_for(batch, prompt_len, llm.engine.config.model.vocab_size)
    decode_run(llm, prompts, new_tokens)  # warm-up
    r = decode_run(llm, prompts, new_tokens)
    decoded = batch * (new_tokens - 1)
    return {"prefill_s": r["prefill_s"], "decode_s": r["decode_s"], "decode_tokens": decoded,
            "decode_tok_s": decoded / r["decode_s"]}  # fmt: skip


def run_graph_comparison(args, model_dir: Path) -> list[dict]:
    """Per batch size: graph mode off and on, for each k of --graph-k (k > 0: MTP drafts on
    random-id prompts, so acceptance is what it is on them), runs interleaved --repeats
    times, medians reported; HF once."""
    rows = []
    for b in args.batch_sizes:
        keys = [(g, k) for k in args.graph_k for g in (False, True)]
        llms = {key: build_ours(model_dir, b, args.dtype, *key) for key in keys}
        runs: dict[tuple[bool, int], list[float]] = {key: [] for key in keys}
        for _ in range(args.repeats):
            for key, llm in llms.items():
                runs[key].append(run_ours(llm, b, args.prompt_len, args.new_tokens)["decode_tok_s"])
        hf = bench_hf(model_dir, b, args.prompt_len, args.new_tokens, args.dtype)["decode_tok_s"]
        med = {key: statistics.median(v) for key, v in runs.items()}
        row = {"batch": b, "hf_decode_tok_s": hf, "configs": []}
        for (g, k), tok_s in med.items():
            c = {"graph": g, "k": k, "decode_tok_s": tok_s, "runs_tok_s": runs[g, k],
                 "start_s": llms[g, k].start_s, "vs_hf": tok_s / hf,
                 "vs_eager_same_k": tok_s / med[False, k]}  # fmt: skip
            if g and (True, 0) in med:
                c["vs_graph_k0"] = tok_s / med[True, 0]
            row["configs"].append(c)
            print(
                f"batch {b:>3} k={k} graph={'on ' if g else 'off'}: {tok_s:8.1f} tok/s  "
                f"vs eager {c['vs_eager_same_k']:4.2f}x  vs HF {c['vs_hf']:4.2f}x  "
                f"start {c['start_s']:5.1f} s",
                flush=True,
            )
        rows.append(row)
    return rows


def bench_hf(model_dir: Path, batch: int, prompt_len: int, new_tokens: int, dtype: str) -> dict:
    from transformers import DeepseekV3ForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    vocab = model.config.vocab_size
    ids = torch.tensor(prompts_for(batch, prompt_len, vocab))

    def gen(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return time.perf_counter() - t

    gen(4)  # warm-up
    prefill = gen(1)
    total = gen(new_tokens)
    decoded = batch * (new_tokens - 1)
    return {
        "prefill_s": prefill,
        "decode_s": total - prefill,
        "decode_tokens": decoded,
        "decode_tok_s": decoded / (total - prefill),
    }


MIN_SPEC_PROMPTS = 8


def bench_spec(model_dir: Path, batch: int, k: int, new_tokens: int, dtype: str) -> dict:
    from xllm_py import LLM, SamplingParams
    from xllm_py.sharegpt import held_out_user_turns

    llm = LLM(model=str(model_dir), dtype=dtype, max_seqs_per_batch=batch, num_speculative_tokens=k)
    tok = llm.get_tokenizer()
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}])
        for p in held_out_user_turns(max(batch, MIN_SPEC_PROMPTS) + 2, 20, 1500)
    ]  # at batch 1 several prompts run one after another (max_seqs_per_batch=1)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(texts[:2], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    before = llm.get_metrics()
    t0 = time.perf_counter()
    outs = llm.generate(texts[2:], params)
    dt = time.perf_counter() - t0
    m = llm.get_metrics()
    drafts, accepted = m.drafts - before.drafts, m.accepted_tokens - before.accepted_tokens
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "batch": batch,
        "k": k,
        "output_tokens": generated,
        "seconds": dt,
        "output_tok_s": generated / dt,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / max(m.draft_tokens - before.draft_tokens, 1) if k else None,
    }


def run_spec_sweep(args, model_dir: Path) -> None:
    rows = []
    for b in args.batch_sizes:
        base = None
        for k in args.spec:
            r = bench_spec(model_dir, b, k, args.new_tokens, args.dtype)
            base = base or (r["output_tok_s"] if k == 0 else None)
            if base:
                r["speedup"] = r["output_tok_s"] / base
                r["efficiency"] = r["speedup"] / r["mean_acceptance_length"]
            rows.append(r)
            print(
                f"batch {b:>3} k={k}: {r['output_tok_s']:8.1f} tok/s  "
                f"speedup {r.get('speedup', float('nan')):4.2f}x  "
                f"accept len {r['mean_acceptance_length']:4.2f}  "
                f"efficiency {r.get('efficiency', float('nan')):4.2f}",
                flush=True,
            )
    out = args.output if args.output != DEFAULT_OUTPUT else ROOT / "perf/results/bench_spec.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "MTP speculative decoding, greedy, held-out ShareGPT prompts",
                "command": " ".join(["python"] + sys.argv),
                "model": str(model_dir),
                "dtype": args.dtype,
                "threads": args.threads,
                "new_tokens": args.new_tokens,
                "torch": torch.__version__,
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


DEFAULT_OUTPUT = ROOT / "perf/results/bench_offline.json"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, help="checkpoint dir (default: the bundled model)")
    ap.add_argument(
        "--random-model",
        action="store_true",
        help="build and use a random model of the probe shape of docs/design.md instead",
    )
    ap.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 32], help="concurrent sequences"
    )
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="run dtype (both sides)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads (both sides)")
    ap.add_argument(
        "--spec",
        type=int,
        nargs="+",
        metavar="K",
        help="measure MTP speculation with these k values (include 0 for the baseline)",
    )
    ap.add_argument(
        "--graph",
        action="store_true",
        help="compare graph mode off and on (and HF), medians of --repeats interleaved runs; "
        "writes perf/results/bench_graph.json by default",
    )
    ap.add_argument(
        "--graph-k",
        type=int,
        nargs="+",
        default=[0],
        metavar="K",
        help="with --graph: MTP draft tokens per step to measure (0 = plain decoding)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="with --graph: runs per config")
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = None
    model_dir = args.model
    if args.random_model:
        tmp = tempfile.TemporaryDirectory()
        model_dir = build_default_model(Path(tmp.name))
    elif model_dir is None:
        from xllm_py.assets import bundled_model

        model_dir = Path(bundled_model())
    if args.spec:
        run_spec_sweep(args, model_dir)
        return
    if args.graph:
        rows = run_graph_comparison(args, model_dir)
        if args.output == DEFAULT_OUTPUT:
            args.output = ROOT / "perf/results/bench_graph.json"
    else:
        rows = bench_plain(args, model_dir)
    result = {
        "benchmark": "offline decode throughput, greedy, EOS ignored"
        + (", graph mode off vs on" if args.graph else ""),
        "command": " ".join(["python"] + sys.argv),
        "model": "random, DEFAULT_CONFIG" if args.random_model else str(model_dir),
        "config": DEFAULT_CONFIG if args.random_model else None,
        "dtype": args.dtype,
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "torch": torch.__version__,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": torch.get_num_threads(),
        },
        "results": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


def bench_plain(args, model_dir: Path) -> list[dict]:
    rows = []
    for b in args.batch_sizes:
        ours = run_ours(build_ours(model_dir, b, args.dtype), b, args.prompt_len, args.new_tokens)
        hf = bench_hf(model_dir, b, args.prompt_len, args.new_tokens, args.dtype)
        ratio = ours["decode_tok_s"] / hf["decode_tok_s"]
        rows.append({"batch": b, "xllm_py": ours, "hf_transformers": hf, "speedup": ratio})
        print(
            f"batch {b:>3}: xllm-py {ours['decode_tok_s']:8.1f} tok/s   "
            f"HF generate {hf['decode_tok_s']:8.1f} tok/s   ratio {ratio:5.2f}x",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
