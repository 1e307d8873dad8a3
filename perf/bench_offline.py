#!/usr/bin/env python3
"""Offline decode throughput: xllm-py's engine vs HF transformers `generate`, one process,
same checkpoint and prompts (random ids of equal length), greedy, EOS ignored. Decode
tokens/s counts the tokens after the first (HF: time(generate N) - time(generate 1)).

    python -m perf.bench_offline                      # the bundled model
    python -m perf.bench_offline --random-model       # random, the probe shape (docs/design.md)
    python -m perf.bench_offline --graph --graph-k 0 1 --batch-sizes 1 8 32   # graph mode

--graph: graph mode off and on for each --graph-k, medians of --repeats interleaved runs
(results/bench_graph.json). MTP acceptance and speedup per k: perf/step_cost.py --measure and
perf/mtp_sweep.py.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from perf.common import RESULTS, command, machine, parser, write_json
from perf.step_cost import decode_run, prompts_for

# The probe shape (docs/design.md section 6): 4 layers, hidden 256, 8 routed experts.
DEFAULT_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], vocab_size=8192, hidden_size=256,
    intermediate_size=768, moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32,
    qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=2048,
    num_nextn_predict_layers=0, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                         original_max_position_embeddings=512, beta_fast=32, beta_slow=1,
                         mscale=1.0, mscale_all_dim=1.0),
)  # fmt: skip


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
        model=str(model_dir), dtype=dtype, block_size=128, max_seqs_per_batch=max(batch, 1),
        enable_graph=graph, graph_batch_sizes=[batch], num_speculative_tokens=k,
    )  # fmt: skip
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


def hf_seconds(model, ids, new_tokens: int) -> tuple[float, float]:
    """Seconds HF `generate` takes for 1 and for `new_tokens` greedy tokens of the batch
    `ids`, EOS ignored (the first is the prefill)."""

    def gen(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            mask, greedy = torch.ones_like(ids), {"do_sample": False, "eos_token_id": None}
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=0, **greedy)  # fmt: skip
        return time.perf_counter() - t

    return gen(1), gen(new_tokens)


def bench_hf(model_dir: Path, batch: int, prompt_len: int, new_tokens: int, dtype: str) -> dict:
    from transformers import DeepseekV3ForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    ids = torch.tensor(prompts_for(batch, prompt_len, model.config.vocab_size))
    hf_seconds(model, ids, 4)  # warm-up
    prefill, total = hf_seconds(model, ids, new_tokens)
    decoded = batch * (new_tokens - 1)
    return {"prefill_s": prefill, "decode_s": total - prefill, "decode_tokens": decoded,
            "decode_tok_s": decoded / (total - prefill)}  # fmt: skip


FLAGS = [  # (flag, type, default, help)
    ("--model", Path, None, "checkpoint directory (None: the bundled model)"),
    ("--random-model", bool, False, "build and use a random model of docs/design.md's probe "
     "shape instead"),
    ("--batch-sizes", int, [1, 32], "concurrent sequences"),
    ("--prompt-len", int, 32, "prompt tokens per sequence"),
    ("--new-tokens", int, 128, "tokens generated per sequence"),
    ("--dtype", ("float32", "bfloat16"), "float32", "run dtype (both sides)"),
    ("--threads", int, 2, "torch threads (both sides)"),
    ("--graph", bool, False, "graph mode off vs on (and HF)"),
    ("--graph-k", int, [0], "with --graph: MTP draft tokens per step (0: plain decoding)"),
    ("--repeats", int, 3, "with --graph: runs per config"),
    ("--output", Path, None, "JSON result file (None: results/bench_offline.json, "
     "bench_graph.json with --graph)"),
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__, FLAGS).parse_args(argv)
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    if args.random_model:
        model_dir = build_default_model(Path(tmp.name))
    else:
        from xllm_py.assets import bundled_model

        model_dir = args.model or Path(bundled_model())
    if args.graph:
        rows, name, what = run_graph_comparison(args, model_dir), "bench_graph", "graph off vs on"
    else:
        rows, name, what = bench_plain(args, model_dir), "bench_offline", "vs HF generate"
    result = {
        "benchmark": f"offline decode throughput, greedy, EOS ignored: {what}",
        "command": command("bench_offline", argv),
        "model": "random, DEFAULT_CONFIG" if args.random_model else str(model_dir),
        "config": DEFAULT_CONFIG if args.random_model else None, "dtype": args.dtype,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "machine": machine(),
        "results": rows,
    }  # fmt: skip
    write_json(args.output or RESULTS / f"{name}.json", result)


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
