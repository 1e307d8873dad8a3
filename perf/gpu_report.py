#!/usr/bin/env python3
"""GPU decode report in one command, on a random DeepSeek-V3-shaped checkpoint with MTP.

    python -m perf.gpu_report                                # CUDA: ~2.6B parameters, bf16 + FP8
    python -m perf.gpu_report --preset tiny --device cpu     # the same pipeline, tiny, on CPU

For each checkpoint format (bf16, FP8 block-quantised; tools/make_random_checkpoint.py) and
random prompt ids, greedy, EOS ignored: decode tok/s per batch size (prefill left out, after
an untimed run), step_cost.py's profiler split of a step, the batch-1 roofline (bytes a step
must read / step time, over the peak bandwidth: datasheet, --hbm-gbps or a measured copy),
and the MTP step cost with an oracle draft (perf/oracle.py) while the real MTP layer runs,
emitted tokens pinned to the plain run's (`verification_agreement`: the share the
verification chose itself). --enable-graph runs every engine in graph mode (a graph per
batch size, compiled at start-up: the engine_start_s figures). JSON:
perf/results/gpu/<device>[-<preset>][-graph].json, written again after every row, so a run
stopped part way (a device lent for minutes) keeps what it measured; "complete" says
whether it ran to the end.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from perf.common import RESULTS, close, command, md_table, parser, write_json
from perf.oracle import install_oracle
from perf.step_cost import (
    LABELS,
    ByteModel,
    byte_model,
    decode_run,
    profiled_split,
    prompts_for,
    step_bytes,
    sync,
)
from tools.make_random_checkpoint import BASE_CONFIG, make_random_checkpoint

PRESETS = {
    # DeepSeek-V3's layout at hidden 2048 (V2-Lite's width), experts at half its 1408.
    "gpu": dict(
        overrides=dict(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=704,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            n_routed_experts=64,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            first_k_dense_replace=1,
            max_position_embeddings=4096,
            rope_scaling=dict(BASE_CONFIG["rope_scaling"], original_max_position_embeddings=1024),
        ),  # fmt: skip
        fp8_block=(128, 128),
    ),
    "tiny": dict(overrides={}, fp8_block=(32, 32)),  # make_random_checkpoint's own dims
}
# Datasheet peak memory bandwidth: (words all in torch.cuda.get_device_name, bytes/s).
PEAK_BANDWIDTH = [
    (("H200",), 4.8e12),
    (("H100", "PCIe"), 2.0e12),
    (("H100", "NVL"), 3.9e12),
    (("H100",), 3.35e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (("A100", "80GB"), 2.0e12),
]
BLOCK = 128  # KV cache block size (the engine's default)
FORMATS = ["bf16", "fp8"]


def table_bandwidth(name: str) -> float | None:
    return next((bw for words, bw in PEAK_BANDWIDTH if all(w in name for w in words)), None)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of the best of 5 copies of 128 MiB (read + write)."""
    a = torch.ones(32 * 2**20, device=device)
    b, best = torch.empty_like(a), float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * a.element_size() / best


def peak_bandwidth(args, device: torch.device, name: str) -> dict:
    if args.hbm_gbps:
        return {"bytes_per_s": args.hbm_gbps * 1e9, "source": "--hbm-gbps"}
    if device.type == "cuda" and table_bandwidth(name):
        return {"bytes_per_s": table_bandwidth(name), "source": f"datasheet peak of {name}"}
    return {
        "bytes_per_s": copy_bandwidth(device),
        "source": "measured here (best of 5 copies of 128 MiB, read + write), not a "
        "datasheet peak; pass --hbm-gbps for one",
    }


def checkpoint(work: Path, preset: str, fmt: str, seed: int) -> Path:
    """The preset's random checkpoint in `fmt`, built once per work dir: a stamp records
    what was asked, and a directory without a matching stamp is rebuilt."""
    spec = PRESETS[preset]
    fp8 = spec["fp8_block"] if fmt == "fp8" else None
    stamp = json.dumps([preset, fmt, seed, spec["overrides"], fp8], sort_keys=True)
    path = work / f"{preset}-{fmt}"
    if (path / "gpu_report_stamp.json").is_file():
        if (path / "gpu_report_stamp.json").read_text() == stamp:
            print(f"reusing the {fmt} checkpoint in {path}", flush=True)
            return path
    shutil.rmtree(path, ignore_errors=True)
    t = time.perf_counter()
    make_random_checkpoint(
        path, spec["overrides"], num_mtp=1, fp8_block=fp8, seed=seed, dtype=torch.bfloat16
    )
    (path / "gpu_report_stamp.json").write_text(stamp)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(
        f"wrote the {fmt} checkpoint ({size / 2**30:.2f} GiB) to {path} in "
        f"{time.perf_counter() - t:.0f} s",
        flush=True,
    )
    return path


def make_llm(path: Path, cfg: dict, args, dtype: torch.dtype, k: int):
    """An engine whose KV cache holds exactly the largest batch (never the whole device)."""
    from xllm_py import LLM

    big = max(args.batch_sizes)
    blocks = big * -(-(args.prompt_len + args.new_tokens + k + 1) // BLOCK) + 1
    layers = cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    per_block = layers * BLOCK * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    return LLM(
        model=str(path), device=args.device, dtype=str(dtype).removeprefix("torch."),
        block_size=BLOCK, enable_prefix_cache=False, max_seqs_per_batch=big,
        max_tokens_per_batch=max(8192, big * (args.prompt_len + k + 1)),
        max_cache_size=blocks * per_block * dtype.itemsize, num_speculative_tokens=k,
        # every step drafts k: the confidence policy would stop drafting where its step
        # timings say a draft does not pay (it did at batch 1, k = 1, eager on an H200)
        speculative_confidence="off", seed=args.seed,
        enable_graph=args.enable_graph, graph_batch_sizes=args.batch_sizes,
        graph_warm_up="startup",
    )  # fmt: skip


def bench_engine(llm, k: int, args, device, vocab: int, plain: dict, reference: dict, rows, save):
    """Every batch size on one engine (k drafts; k = 0 records the plain baseline), each
    row appended to `rows` and saved (`save()`) as soon as it is measured."""
    tally = install_oracle(llm, reference, k) if k else None
    for b in args.batch_sizes:
        prompts = prompts_for(b, args.prompt_len, vocab)
        decode_run(llm, prompts, args.new_tokens, device)  # warm-up: every shape of the run
        agreed, emitted = tally or (0, 0)
        r = decode_run(llm, prompts, args.new_tokens, device)
        step_ms = r["step_ms"]
        row = {
            "k": k, "batch": b, "decode_tok_s": b * (args.new_tokens - 1) / r["decode_s"],
            "step_ms": step_ms, "decode_steps": r["decode_steps"],
            "tokens_per_step": r["tokens_per_step"], "prefill_s": r["prefill_s"],
        }  # fmt: skip
        if k == 0:
            plain[b] = row
            reference.update({tuple(p): p + t for p, t in zip(prompts, r["tokens"])})
        else:
            base = plain[b]
            row.update(
                step_cost_vs_plain=step_ms / base["step_ms"],
                speedup_vs_plain=row["decode_tok_s"] / base["decode_tok_s"],
                acceptance_rate=r["accepted"] / max(r["draft_tokens"], 1),
                mean_acceptance_length=1 + r["accepted"] / max(r["drafts"], 1),
                verification_agreement=(tally[0] - agreed) / (tally[1] - emitted),
            )  # fmt: skip
        row["split"] = profiled_split(llm, prompts, args.new_tokens, device)
        print(
            f"  k={k} batch {b:>3}: {row['decode_tok_s']:9.1f} tok/s  step {step_ms:7.2f} ms"
            f"  {row['tokens_per_step']:.2f} tok/step  split: "
            + " ".join(f"{n} {100 * f:.0f}%" for n, f in row["split"]["fraction"].items()),
            flush=True,
        )
        rows.append(row)
        save()


def resident_bytes(model) -> dict:
    """Bytes of the model's real-valued tensors as held in memory, by dtype: parameters,
    buffers and the tensors layers keep as plain attributes after re-laying their weights."""
    seen, out = set(), {}
    for mod in model.modules():
        for t in [*mod._parameters.values(), *mod._buffers.values(), *vars(mod).values()]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                name = str(t.dtype).removeprefix("torch.")
                out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return out


def roofline(bm: ByteModel, args, step_ms: float, peak: dict) -> dict:
    """The bytes a batch-1 plain step reads (step_cost.step_bytes: one token reads top-k routed
    experts per MoE layer; the latent KV over the mean context) / step time, against peak."""
    one_token = {"target": {1: [bm.top_k] * len(bm.expert)}, "draft": {1: [bm.top_k]}}
    b = step_bytes(bm, one_token, 1, 1.0, args.prompt_len + args.new_tokens / 2)
    kv_bytes = bm.num_layers * b["kv"]
    achieved = b["plain"] / (step_ms / 1000)
    return {
        "weight_bytes_per_step": b["plain"] - kv_bytes, "kv_bytes_per_step": kv_bytes,
        "step_ms": step_ms, "achieved_bytes_per_s": achieved,
        "peak_bytes_per_s": peak["bytes_per_s"], "peak_source": peak["source"],
        "fraction_of_peak": achieved / peak["bytes_per_s"],
    }  # fmt: skip


def bench_format(fmt: str, path: Path, args, device, dtype, peak, out: dict, save) -> None:
    """Fill `out` with the format's figures, saving (`save()`) after every row."""
    cfg = json.loads((path / "config.json").read_text())
    plain, reference = {}, {}
    out.update(
        checkpoint=str(path),
        fp8_block=cfg.get("quantization_config", {}).get("weight_block_size"),
        engine_start_s={},
        decode_tok_s={},
        roofline_batch1=None,
        runs=[],
    )
    for k in [0] + args.k:
        t = time.perf_counter()
        llm = make_llm(path, cfg, args, dtype, k)
        out["engine_start_s"][k] = start = time.perf_counter() - t
        held = resident_bytes(llm.engine.core.executor.worker.model)
        out.update(weights_in_memory_dtype=max(held, key=held.get), weights_in_memory_bytes=held)
        mib = ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in held.items())
        print(f"{fmt}, k={k}: engine ready in {start:.1f} s; target weights: {mib}", flush=True)
        bench_engine(llm, k, args, device, cfg["vocab_size"], plain, reference, out["runs"], save)
        out["decode_tok_s"] = {b: row["decode_tok_s"] for b, row in plain.items()}
        close(llm)
    fp8_held = any(n.startswith("float8") for n in held)
    bm = byte_model(str(path), str(dtype).removeprefix("torch."), fp8_held=fp8_held)
    out["byte_model"] = asdict(bm)
    if 1 in plain:
        out["roofline_batch1"] = roofline(bm, args, plain[1]["step_ms"], peak)
    save()


def print_table(result: dict) -> None:
    print(
        f"\n{result['device']['name']}, {result['preset']} preset, run dtype "
        f"{result['run_dtype']}, prompt {result['prompt_len']}, {result['new_tokens']} new"
    )
    head = ["format", "k", "batch", "tok/s", "step ms", "tok/step", "cost", "agree"]
    rows = []
    for fmt, res in result["formats"].items():
        for r in res["runs"]:
            cost = ("{step_cost_vs_plain:.2f} {verification_agreement:.3f}".format(**r).split()
                    if r["k"] else "--")  # fmt: skip
            split = [f"{100 * r['split']['fraction'][n]:.1f}%" for n in (*LABELS, "other")]
            rows.append([fmt, r["k"], r["batch"], f"{r['decode_tok_s']:.1f}",
                         f"{r['step_ms']:.2f}", f"{r['tokens_per_step']:.2f}",
                         *cost, *split])  # fmt: skip
    print(md_table(head + [*LABELS, "other"], rows))
    for fmt, res in result["formats"].items():
        if roof := res["roofline_batch1"]:
            print(f"{fmt}: batch 1 reads {roof['weight_bytes_per_step'] / 2**20:.1f} MiB weights + "
                  f"{roof['kv_bytes_per_step'] / 2**20:.2f} MiB KV per step: "
                  f"{roof['achieved_bytes_per_s'] / 1e9:.1f} GB/s = "
                  f"{100 * roof['fraction_of_peak']:.2f}% of {roof['peak_bytes_per_s'] / 1e9:.0f}"
                  f" GB/s ({roof['peak_source']})")  # fmt: skip
        if any(r["verification_agreement"] < 1 for r in res["runs"] if r["k"]):
            print(
                f"{fmt}: the verification chose other tokens than the plain run somewhere "
                "(agree < 1: rounding in the (k + 1)-row pass); the emitted ones were pinned"
            )


FLAGS = [  # (flag, type, default, help)
    ("--device", str, "cuda" if torch.cuda.is_available() else "cpu", "cuda[:N] or cpu"),
    ("--preset", tuple(PRESETS), None, "model dims: gpu (~2.6B parameters, DeepSeek-V3's "
     "layout) or tiny (for CPU); None: gpu on CUDA, tiny on CPU"),
    ("--formats", tuple(FORMATS), FORMATS, "checkpoint formats to build and measure"),
    ("--dtype", str, "auto", "run dtype (auto: bfloat16 on a GPU, float32 on CPU)"),
    ("--batch-sizes", int, [1, 8, 32, 128], "concurrent sequences of each run (1: roofline)"),
    ("--k", int, [1, 3], "draft tokens per step of the oracle MTP runs (none: plain only)",
     {"nargs": "*"}),
    ("--prompt-len", int, 64, "prompt tokens per sequence (random ids)"),
    ("--new-tokens", int, 128, "tokens generated per sequence"),
    ("--hbm-gbps", float, None, "peak memory bandwidth in GB/s (None: the datasheet's by GPU "
     "name, else a copy measured on the device)"),
    ("--work-dir", Path, None, "build the checkpoints here and reuse them later (None: a "
     "temporary directory)"),
    ("--seed", int, 0, "seed of the random weights and of the engine"),
    ("--threads", int, None, "torch CPU threads (None: torch's)"),
    ("--enable-graph", bool, False, "run every engine in graph mode, a graph per batch size "
     "compiled at start-up (the engine's --enable_graph)"),
    ("--output", Path, None, "JSON file (None: perf/results/gpu/<device>[-<preset>]"
     "[-graph].json)"),
]  # fmt: skip


def build_parser():
    return parser(__doc__, FLAGS)


def main(argv: list[str] | None = None) -> dict:
    from xllm_py.config import DeviceConfig

    args = build_parser().parse_args(argv)
    if args.new_tokens < 2 or min(args.batch_sizes) < 1 or any(k < 1 for k in args.k):
        sys.exit("error: --new-tokens must be >= 2, batch sizes and k >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.preset = args.preset or ("gpu" if cuda else "tiny")
    name = torch.cuda.get_device_name(device) if cuda else f"cpu {platform.machine()}"
    dtype = DeviceConfig(device=args.device, dtype=args.dtype).torch_dtype()
    print(f"{name}: {args.preset} preset, run dtype {dtype}", flush=True)
    peak = peak_bandwidth(args, device, name)
    print(f"peak bandwidth {peak['bytes_per_s'] / 1e9:.0f} GB/s: {peak['source']}", flush=True)
    result = {
        "benchmark": "decode on a random DeepSeek-V3-shaped checkpoint with MTP "
        "(python -m perf.gpu_report), greedy, EOS ignored, random prompt ids",
        "command": command("gpu_report", argv),
        "device": {
            "type": device.type,
            "name": name,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "threads": torch.get_num_threads(),
        },
        "preset": args.preset,
        "config_overrides": PRESETS[args.preset]["overrides"],
        "run_dtype": str(dtype).removeprefix("torch."),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "batch_sizes": args.batch_sizes,
        "k": args.k,
        "warmup": "one untimed run of the same batch before the timed one",
        "peak_bandwidth": peak,
        "graph_mode": args.enable_graph,
        "complete": False,
        "formats": {},
    }
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    suffix = ("" if args.preset == "gpu" else f"-{args.preset}") + (
        "-graph" if args.enable_graph else ""
    )
    output = args.output or RESULTS / "gpu" / f"{slug}{suffix}.json"

    def save() -> None:
        write_json(output, result, announce=False)

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        for fmt in args.formats:
            path = checkpoint(work, args.preset, fmt, args.seed)
            bench_format(
                fmt, path, args, device, dtype, peak, result["formats"].setdefault(fmt, {}), save
            )
    print_table(result)
    result["complete"] = True
    write_json(output, result)
    return result


if __name__ == "__main__":
    main()
