#!/usr/bin/env python3
"""What a decode step costs, with and without MTP drafts: the batch-1 bandwidth ceiling of
MTP (docs/design.md section 9; perf/README.md explains the table) and, with --measure, the
measured step here with its torch.profiler split. perf's one step-cost tool.

    python -m perf.step_cost --results perf/results/mtp_sweep/sweep.json
    python -m perf.step_cost --reuse perf/results/mtp_ceiling.json --k 1 2 --measure [--graph]

ceiling(k) = acceptance_length / (verify(k+1 rows) + k x draft), costs in plain steps, each
pass costing the bytes it reads (weights in --dtype from the safetensors headers; latent KV
over --context tokens; routed experts as routed on held-out ShareGPT prompts, measured by
Router hooks over windows of 1..k+1 tokens). Acceptance lengths: from --results (sweep.json
or results/bench_spec.json, whose rows are also compared with the ceiling), --reuse, or
measured here. --measure: ms per decode step for k = 0 and each --k, tokens per step, step
cost measured vs modelled, and in eager mode the split of a step (attention, MoE, dense MLP,
head, draft, other) that perf/gpu_report.py uses too.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import re
import struct
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from perf.common import (
    RESULTS,
    chat_prompts,
    close,
    command,
    md_table,
    parser,
    settings,
    write_json,
)

EL_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
SCALES = ("_scale_inv", "weight_scale")  # FP8 block scales: not kept once dequantised
MB = 1e6


@dataclass
class ByteModel:
    """Bytes in the run dtype; lists run over the target's MoE layers / the MTP layers."""

    target_dense: int  # every target pass, whatever its rows; no experts, embedding or head
    expert: list[int]  # one routed expert, per target MoE layer
    draft_dense: list[int]  # per MTP layer: all but its routed experts (block, norms, eh_proj)
    draft_expert: list[int]  # one routed expert, per MTP layer
    head: int  # lm_head (the target's; the draft shares it)
    draft_head: int  # what one draft token's head reads (head, or --draft-vocab rows of it)
    embed_row: int
    kv_token_layer: int  # latent cache bytes per token and layer
    num_layers: int
    top_k: int
    total_weights: int  # every weight tensor, target and MTP (shared copies once)


def _config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _headers(model_dir: str) -> dict[str, dict]:
    """name -> header entry ({"dtype", "shape", ...}) of every checkpoint tensor the loader
    would read (the index's, so other files beside it, e.g. a draft token map, are not
    counted), from the shards' headers."""
    from xllm_py.weights.loader import tensor_files

    files = tensor_files(model_dir)
    out = {}
    for f in sorted(set(files.values())):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out.update({k: v for k, v in header.items() if k in files})
    return out


def byte_model(
    model: str,
    dtype: str = "float32",
    draft_model: str | None = None,
    draft_vocab: int = 0,
    fp8_held: bool = False,
) -> ByteModel:
    """The bytes of each part a pass reads, from the checkpoint's (and draft's) headers:
    every tensor in `dtype`, or with `fp8_held` the checkpoint's FP8 ones at 1 byte plus
    their float32 block scales (an FP8-resident engine; else scales are not counted)."""
    from xllm_py.models.deepseek_mtp import draft_name_map

    el, cfg = EL_BYTES[dtype], _config(model)
    N, E, hidden = cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["hidden_size"]
    n_mtp = _config(draft_model)["num_hidden_layers"] if draft_model else 0
    n_mtp = n_mtp or cfg.get("num_nextn_predict_layers", 0)
    tensors = [(n, h, False) for n, h in _headers(model).items()]
    tensors += [(n, h, True) for n, h in _headers(draft_model).items()] if draft_model else []
    parts: dict[tuple[str, int], int] = defaultdict(int)
    for name, header, exported in tensors:
        scale = name.endswith(SCALES)
        if scale and not fp8_held:
            continue
        size = 4 if scale else 1 if fp8_held and header["dtype"].startswith("F8") else el
        name = re.sub(r"_scale(_inv)?$", "", name) if scale else name  # where its weight is
        layer = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        if exported or (layer and int(layer.group(1)) >= N):  # the MTP layers
            mapped = draft_name_map([name], N, n_mtp, exported)[name]
            if not (isinstance(mapped, str) and mapped.startswith("layers.")):
                continue  # a copy of the target's embedding or head
            _, j, rest = mapped.split(".", 2)
            key = ("draft_expert" if rest.startswith("mlp.experts.") else "draft_dense", int(j))
        elif layer and layer.group(2).startswith("mlp.experts."):
            key = ("expert", int(layer.group(1)))
        elif name in ("lm_head.weight", "model.embed_tokens.weight"):
            key = (name, 0)
        else:
            key = ("dense", 0)
        parts[key] += math.prod(header["shape"]) * size
    head = parts[("lm_head.weight", 0)] or parts[("model.embed_tokens.weight", 0)]  # tied
    moe = sorted(i for kind, i in parts if kind == "expert")
    return ByteModel(
        target_dense=parts[("dense", 0)], expert=[parts[("expert", i)] // E for i in moe],
        draft_dense=[parts[("draft_dense", j)] for j in range(n_mtp)],
        draft_expert=[parts[("draft_expert", j)] // E for j in range(n_mtp)], head=head,
        draft_head=draft_vocab * hidden * el if draft_vocab else head, embed_row=hidden * el,
        kv_token_layer=(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * el, num_layers=N,
        top_k=cfg["num_experts_per_tok"], total_weights=sum(parts.values()),
    )  # fmt: skip


def new_llm(model: str, k: int, dtype: str = "float32", draft_model: str | None = None):
    from xllm_py import LLM

    return LLM(model=model, dtype=dtype, num_speculative_tokens=k, draft_model=draft_model,
               enable_prefix_cache=False, max_cache_size=256 << 20)  # fmt: skip


def held_out_prompts(llm, n: int) -> list[list[int]]:
    """Token ids of n held-out ShareGPT chat prompts, chat template applied."""
    return [
        llm.engine.tokenize_prompt(t)[1] for t in chat_prompts(llm.get_tokenizer(), n, 20, 1500)
    ]


def acceptance(llm, prompts: list[list[int]], new_tokens: int) -> float:
    """Mean acceptance length (1 + accepted / drafts) of greedy generation of the prompts."""
    from xllm_py import SamplingParams

    before = llm.get_metrics()
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    m = llm.get_metrics()
    return 1 + (m.accepted_tokens - before.accepted_tokens) / max(m.drafts - before.drafts, 1)


def measure_routing(llm, prompts: list[list[int]], new_tokens: int, max_window: int) -> dict:
    """{"target": {w: [distinct experts per MoE layer]}, "draft": {w: [per MTP layer]}}: means
    over every window of w consecutive continuation tokens, w = 1..max_window. `llm` must
    draft (k >= 1) for the MTP layer's routers to run."""
    from xllm_py import SamplingParams
    from xllm_py.models.layers.moe import Router

    worker = llm.engine.core.executor.worker
    routers = {part: [m for m in module.modules() if isinstance(m, Router)]
               for part, module in (("target", worker.model), ("draft", worker.draft))}  # fmt: skip
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    calls: dict[tuple[str, int], list] = defaultdict(list)
    hooks = [r.register_forward_hook(lambda _m, _i, o, key=(part, i): calls[key].append(o[1]))
             for part, rs in routers.items() for i, r in enumerate(rs)]  # fmt: skip
    sums: dict[tuple, float] = defaultdict(float)
    count: dict[tuple, int] = defaultdict(int)
    try:
        for p, out in zip(prompts, outs):
            ids = p + list(out.outputs[0].token_ids)
            calls.clear()
            llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0))
            for key, recs in calls.items():  # prefill rows come in position order
                rows = [set(r) for call in recs for r in call.tolist()][len(p) : len(ids)]
                for w in range(1, max_window + 1):
                    for s in range(len(rows) - w + 1):
                        sums[(*key, w)] += len(set().union(*rows[s : s + w]))
                        count[(*key, w)] += 1
    finally:
        for h in hooks:
            h.remove()
    return {part: {w: [sums[part, i, w] / max(count[part, i, w], 1) for i in range(len(rs))]
                   for w in range(1, max_window + 1)} for part, rs in routers.items()}  # fmt: skip


def routing_stats(model: str, prompts: int, new_tokens: int, max_window: int,
                  draft_model: str | None = None) -> dict:  # fmt: skip
    """measure_routing on a fresh engine (k = 1, float32) over `prompts` held-out prompts."""
    llm = new_llm(model, 1, "float32", draft_model)
    return measure_routing(llm, held_out_prompts(llm, prompts), new_tokens, max_window)


def _distinct(table: dict, rows: float, layer: int) -> float:
    """Distinct experts of one layer over `rows` rows, linear between measured windows."""
    table = {int(w): v for w, v in table.items()}  # JSON keys are strings
    lo = max(1, min(int(rows), max(table)))
    hi = min(lo + 1, max(table))
    a, b = table[lo][layer], table[hi][layer]
    return a + (b - a) * min(max(rows - lo, 0.0), 1.0)


def step_bytes(bm: ByteModel, routing: dict, k: int, accept: float, context: int) -> dict:
    """Bytes of a plain step, a (k+1)-row verify step and one step's k draft passes."""
    kv = context * bm.kv_token_layer
    t, d = routing["target"], routing["draft"]
    measured_mtp = len(next(iter(d.values())))

    def target(rows: int) -> float:
        experts = sum(e * _distinct(t, rows, i) for i, e in enumerate(bm.expert))
        return bm.target_dense + bm.head + experts + rows * bm.embed_row + bm.num_layers * kv

    def mtp(j: int, rows: float) -> float:  # unmeasured MTP layers route like the last one
        experts = bm.draft_expert[j] * _distinct(d, rows, min(j, measured_mtp - 1))
        return bm.draft_dense[j] + experts + rows * bm.embed_row + kv

    n = len(bm.draft_dense)
    first = sum(mtp(j, accept) for j in range(min(k, n))) + bm.draft_head
    chained = sum(mtp(s % n, 1) + bm.draft_head for s in range(1, k))
    return {"plain": target(1), "verify": target(k + 1), "draft": first + chained, "kv": kv}


def ceiling(accept: float, verify_cost: float, draft_cost: float, k: int) -> float:
    """The speedup bound: tokens per step / step cost, costs in plain-step units."""
    return accept / (verify_cost + k * draft_cost)


def ceiling_row(bm: ByteModel, routing: dict, k: int, accept: float, context: int) -> dict:
    b = step_bytes(bm, routing, k, accept, context)
    verify, draft = b["verify"] / b["plain"], b["draft"] / k / b["plain"]
    return {"k": k, "acceptance_length": accept, "plain_mb": b["plain"] / MB,
            "verify_mb": b["verify"] / MB, "draft_mb_per_pass": b["draft"] / k / MB,
            "verify_cost": verify, "draft_cost": draft, "step_cost": verify + k * draft,
            "ceiling": ceiling(accept, verify, draft, k)}  # fmt: skip


def measured_rows(path: Path) -> tuple[list[dict], dict]:
    """Rows (k, where, acceptance_length, speedup) of a perf.mtp_sweep sweep.json or
    results/bench_spec.json, and the file's input/output lengths if it has them."""
    data = json.loads(path.read_text())
    out = []
    for r in data.get("rows", []):
        m = re.fullmatch(r"MTP k=(\d+)", r.get("method", ""))
        if m and r.get("spec_decode_acceptance_length"):
            out.append({"k": int(m.group(1)), "where": f"concurrency {r['concurrency']}",
                        "acceptance_length": r["spec_decode_acceptance_length"],
                        "speedup": r["speedup"]})  # fmt: skip
    for r in data.get("results", []):
        if r.get("k") and "speedup" in r and "mean_acceptance_length" in r:
            out.append({"k": r["k"], "where": f"batch {r['batch']}",
                        "acceptance_length": r["mean_acceptance_length"],
                        "speedup": r["speedup"]})  # fmt: skip
    return out, {key: data[key] for key in ("input_len", "output_len") if key in data}


LABELS = ("attention", "moe", "dense_mlp", "head", "draft")
_ids = itertools.count()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Random prompt ids, the same for the same batch size (seeded with it)."""
    g = torch.Generator().manual_seed(batch)
    return torch.randint(2, vocab, (batch, prompt_len), generator=g).tolist()


def decode_run(llm, prompts, new_tokens: int, device=None, around=None) -> dict:
    """One batch through an in-process engine, greedy, EOS ignored: the prefill step, then
    the decode steps to the end, timed apart (`around`: a context entered for the decode
    steps only, e.g. a profiler)."""
    from xllm_py import SamplingParams

    device = torch.device(device or "cpu")
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine, before = llm.engine, llm.get_metrics()
    ids = [f"r{next(_ids)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    sync(device)
    t0 = time.perf_counter()
    outs, steps = engine.step(), 0
    sync(device)
    t1 = time.perf_counter()
    with around or contextlib.nullcontext():
        while engine.has_unfinished():
            outs += engine.step()
            steps += 1
        sync(device)
    t2 = time.perf_counter()
    done = {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}
    m = llm.get_metrics()
    return {
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "decode_steps": steps,
        "step_ms": 1000 * (t2 - t1) / max(steps, 1),
        "tokens_per_step": (new_tokens - 1) / max(steps, 1),  # per request
        "tokens": [done[r] for r in ids],
        "drafts": m.drafts - before.drafts,
        "draft_tokens": m.draft_tokens - before.draft_tokens,
        "accepted": m.accepted_tokens - before.accepted_tokens,
    }


@contextlib.contextmanager
def labelled(llm):
    """Each part of LABELS in a torch.profiler range of its own: the target's attention and
    MLP/MoE modules, its head (compute_logits) and the proposer. Outermost only: the head
    and layers run by the draft count as draft."""
    from xllm_py.models.layers.moe import MoE

    worker, inside = llm.engine.core.executor.worker, [False]
    model, proposer = worker.model, worker.runner.proposer

    def wrap(fn, label):
        def run(*a, **kw):
            if inside[0]:
                return fn(*a, **kw)
            inside[0] = True
            try:
                with torch.profiler.record_function(f"step_cost/{label}"):
                    return fn(*a, **kw)
            finally:
                inside[0] = False

        return run

    parts = [(model, "compute_logits", "head")]
    parts += [(proposer, "propose", "draft")] if proposer is not None else []
    for lay in model.model.layers:
        parts.append((lay.self_attn, "forward", "attention"))
        parts.append((lay.mlp, "forward", "moe" if isinstance(lay.mlp, MoE) else "dense_mlp"))
    for obj, name, label in parts:
        object.__setattr__(obj, name, wrap(getattr(obj, name), label))
    try:
        yield
    finally:
        for obj, name, _ in parts:
            object.__delattr__(obj, name)  # the class's method again


def profiled_split(llm, prompts, new_tokens: int, device=None) -> dict:
    """ms per decode step in each part of LABELS and the rest ("other"), from one run under
    torch.profiler (CPU: the ranges' wall time; CUDA: the device time of their kernels)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device or "cpu")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with labelled(llm):
        prof = profile(activities=acts)
        r = decode_run(llm, prompts, new_tokens, device, around=prof)
    ms = dict.fromkeys(LABELS, 0.0)
    for ev in prof.events():
        if ev.name.startswith("step_cost/"):
            us = ev.device_time_total if device.type == "cuda" else ev.cpu_time_total
            ms[ev.name.removeprefix("step_cost/")] += us / 1000 / r["decode_steps"]
    step = r["step_ms"]
    ms["other"] = max(step - sum(ms.values()), 0.0)
    return {"step_ms": step, "ms": ms, "fraction": {k: v / step for k, v in ms.items()}}


def measure_steps(args, model: str, bm: ByteModel, routing: dict, context: int) -> list[dict]:
    """--measure: a row per k (0 first) of step time, tokens per step and step cost, the
    byte model's step cost beside it, and the profiler split (eager mode)."""
    from xllm_py import LLM

    rows, plain = [], None
    for k in [0, *args.k]:
        llm = LLM(model=model, dtype=args.run_dtype, num_speculative_tokens=k,
                  draft_model=args.draft_model, enable_prefix_cache=False,
                  max_seqs_per_batch=args.batch, enable_graph=args.graph,
                  graph_batch_sizes=[args.batch])  # fmt: skip
        prompts = held_out_prompts(llm, args.batch)
        decode_run(llm, prompts, args.measure_tokens)  # warm-up
        r = decode_run(llm, prompts, args.measure_tokens)
        accept = 1 + r["accepted"] / max(r["drafts"], 1)
        row = {"k": k, "graph": args.graph, "batch": args.batch, "step_ms": r["step_ms"],
               "tokens_per_step": r["tokens_per_step"], "acceptance_length": accept}  # fmt: skip
        plain = plain or row
        row["step_cost_measured"] = row["step_ms"] / plain["step_ms"]
        row["speedup"] = row["tokens_per_step"] / row["step_cost_measured"]
        if k:
            row["step_cost_model"] = ceiling_row(bm, routing, k, accept, context)["step_cost"]
        if not args.graph:
            row["split"] = profiled_split(llm, prompts, args.measure_tokens)
        rows.append(row)
        close(llm)
    return rows


def print_measured(rows: list[dict]) -> None:
    head = ["k", "mode", "step ms", "tokens/step", "acceptance", "step cost measured",
            "step cost model", "speedup", "split (ms per step)"]  # fmt: skip
    print("\n" + md_table(head, [
        [r["k"], "graph" if r["graph"] else "eager", f"{r['step_ms']:.2f}",
         f"{r['tokens_per_step']:.2f}", f"{r['acceptance_length']:.2f}",
         f"{r['step_cost_measured']:.3f}", f"{r.get('step_cost_model', 1.0):.3f}",
         f"{r['speedup']:.2f}x", " ".join(f"{n} {v:.2f}" for n, v in
                                           r.get("split", {}).get("ms", {}).items())]
        for r in rows]))  # fmt: skip


FLAGS = [  # (flag, type, default, help)
    ("--model", str, None, "checkpoint directory (None: the bundled model)"),
    ("--draft-model", str, None, "exported MTP draft, if separate"),
    ("--k", int, [1, 2, 3, 4], "draft counts"),
    ("--results", Path, None, "sweep.json (perf.mtp_sweep) or results/bench_spec.json: "
     "acceptance lengths, measured speedups to compare, the context"),
    ("--prompts", int, 8, "held-out ShareGPT prompts to measure on"),
    ("--new-tokens", int, 64, "greedy tokens per prompt"),
    ("--dtype", tuple(EL_BYTES), "float32", "bytes per weight and KV element; the measuring "
     "engine runs float32 unless bfloat16/float16"),
    ("--context", int, 0, "tokens the KV reads cover (0: input_len + output_len / 2 of "
     "--results, else the prompts' mean length + new_tokens / 2)"),
    ("--draft-vocab", int, 0, "a draft head over this many hot tokens (0: all)"),
    ("--reuse", Path, None, "an earlier JSON of this tool on this model: its routing (and "
     "acceptance lengths for k not in --results) instead of measuring them"),
    ("--measure", bool, False, "also time decode steps here and split them (torch.profiler)"),
    ("--graph", bool, False, "--measure in graph mode (no split)"),
    ("--batch", int, 1, "--measure: requests decoded at once"),
    ("--measure-tokens", int, 64, "--measure: tokens each"),
    ("--output", Path, RESULTS / "mtp_ceiling.json", "JSON to write"),
]  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    from xllm_py.assets import bundled_model

    args = parser(__doc__, FLAGS).parse_args(argv)
    model = args.model or bundled_model()
    run_dtype = args.dtype if args.dtype in ("bfloat16", "float16") else "float32"
    args.run_dtype = run_dtype
    bm = byte_model(model, args.dtype, args.draft_model, args.draft_vocab)
    measured, lengths = measured_rows(args.results) if args.results else ([], {})
    reused = json.loads(args.reuse.read_text()) if args.reuse else {}
    engine: dict = {}  # the measuring engine, made when first needed, and its prompts

    def llm_at(k: int):
        if engine.get("k") != k:
            engine.pop("llm", None)
            gc.collect()
            engine.update(k=k, llm=new_llm(model, k, run_dtype, args.draft_model))
            engine.setdefault("prompts", held_out_prompts(engine["llm"], args.prompts))
        return engine["llm"], engine["prompts"]

    routing = reused.get("routing")
    if routing is None or max(map(int, routing["target"])) < max(args.k) + 1:
        routing = measure_routing(*llm_at(1), args.new_tokens, max(args.k) + 1)
    if args.context or lengths:
        context = args.context or lengths["input_len"] + lengths["output_len"] // 2
    elif "prompts" in engine:
        prompts = engine["prompts"]
        context = round(sum(map(len, prompts)) / len(prompts) + args.new_tokens / 2)
    else:
        context = reused["context"]
    rows = []
    for k in args.k:
        got = [r["acceptance_length"] for r in measured if r["k"] == k]
        old = [r for r in reused.get("rows", []) if r["k"] == k]
        if got:
            acc, src = sum(got) / len(got), f"results, mean of {len(got)} rows"
        elif old:
            acc, src = old[0]["acceptance_length"], f"{args.reuse}: {old[0]['acceptance_source']}"
        else:
            acc = acceptance(*llm_at(k), args.new_tokens)
            src = f"measured, {args.prompts} prompts x {args.new_tokens} tokens"
        rows.append({**ceiling_row(bm, routing, k, acc, context), "acceptance_source": src})
    compare = []
    for r in measured:
        c = ceiling_row(bm, routing, r["k"], r["acceptance_length"], context)
        compare.append({**r, "ceiling": c["ceiling"], "ratio": r["speedup"] / c["ceiling"],
                        "step_cost_measured": r["acceptance_length"] / r["speedup"],
                        "step_cost_model": c["step_cost"]})  # fmt: skip
    plain = step_bytes(bm, routing, 1, 1.0, context)
    print(f"model {model}, {args.dtype}, context {context} tokens, batch 1")
    print(
        f"weights {bm.total_weights / MB:.2f} MB; plain step {plain['plain'] / MB:.2f} MB = "
        f"dense {bm.target_dense / MB:.2f} + head {bm.head / MB:.2f} + routed experts "
        f"{sum(bm.expert) * bm.top_k / MB:.2f} + KV {bm.num_layers * plain['kv'] / MB:.2f}; "
        f"MTP layer {sum(bm.draft_dense) / MB:.2f} + {bm.top_k} experts "
        f"{bm.top_k * sum(bm.draft_expert) / MB:.2f}, draft head {bm.draft_head / MB:.2f}"
    )
    t, d = routing["target"], routing["draft"]
    print("distinct experts per MoE layer over w tokens (target mean / MTP): " + ", ".join(
        f"w={w} {sum(t[w]) / len(t[w]):.2f}/{d[w][0]:.2f}" for w in t))  # fmt: skip
    head = ["k", "acceptance length", "source", "plain MB", "verify MB", "draft MB/pass",
            "verify cost", "draft cost", "step cost", "ceiling"]  # fmt: skip
    print("\n" + md_table(head, [
        [r["k"], f"{r['acceptance_length']:.2f}", r["acceptance_source"], f"{r['plain_mb']:.2f}",
         f"{r['verify_mb']:.2f}", f"{r['draft_mb_per_pass']:.2f}", f"{r['verify_cost']:.3f}",
         f"{r['draft_cost']:.3f}", f"{r['step_cost']:.3f}", f"{r['ceiling']:.2f}x"]
        for r in rows]))  # fmt: skip
    if compare:
        head = ["k", "where", "acceptance", "measured", "ceiling", "measured/ceiling",
                "step cost measured", "step cost model"]  # fmt: skip
        print(f"\n{args.results}; step cost = acceptance / speedup, in plain steps:\n" + md_table(
            head, [[c["k"], c["where"], f"{c['acceptance_length']:.2f}", f"{c['speedup']:.2f}x",
                    f"{c['ceiling']:.2f}x", f"{c['ratio']:.2f}", f"{c['step_cost_measured']:.2f}",
                    f"{c['step_cost_model']:.2f}"] for c in compare]))  # fmt: skip
    steps = []
    if args.measure:
        engine.clear()
        gc.collect()
        steps = measure_steps(args, model, bm, routing, context)
        print_measured(steps)
    summary = {
        "command": command("step_cost", argv),
        **settings(args),
        "model": model, "context": context, "measured_on_prompts": len(engine.get("prompts", [])),
        "byte_model": asdict(bm), "routing": routing, "rows": rows, "compare": compare,
        "measured": steps,
    }  # fmt: skip
    write_json(args.output, summary)
    return summary


if __name__ == "__main__":
    main()
