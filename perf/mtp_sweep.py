#!/usr/bin/env python3
"""Baseline vs MTP serving sweep, in one command: the table, a plot and all raw JSON.

    python -m perf.mtp_sweep --scale cpu                       # bundled model, this machine
    python -m perf.mtp_sweep --scale full --model /models/DeepSeek-V3 \\
        --server-args "--devices=cuda:0 --draft_model /models/DeepSeek-V3-MTP"

For each method (baseline = no drafts, then MTP with each k of --k) it starts our
daemon, runs perf/bench_serving.py at every concurrency of --concurrency on the
same ShareGPT prompts with the same lengths and settings, and stops the daemon.
`--launch` replaces our daemon with any command (vLLM, SGLang, a cluster script):
it is run with {port} and {k} substituted and must serve /health; a launcher that
returns once its servers run (scripts/launch_cluster.sh) needs `--launch-stop`.

Presets (--scale):
    full  input 2500 / output 1500 tokens, 80 requests per level (the reference table)
    cpu   input 256 / output 128 tokens, max(24, 2 x concurrency) requests per level
          (finishes on 2 CPU cores in well under 30 minutes)

Writes into --result-dir: results.md (one row per method and concurrency, baseline
and MTP interleaved: mean TPOT, mean TTFT, output and total tokens/s, speedup over
the baseline at that concurrency, mean acceptance length, and the ceiling: the batch-1
bandwidth bound on the speedup at the row's k and acceptance length, from
perf/step_cost.py), sweep.png (output
tokens/s and TPOT against concurrency), sweep.json (everything, with the command
and the machine) and raw/ (one bench_serving JSON per run). With --hf-peer, the
same prompts also go through HF transformers `generate` one at a time (offline,
concurrency 1) as a peer figure.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from perf import bench_serving, step_cost
from perf.daemon import ROOT, Daemon, flag_value, machine, warm_up
from xllm_py.assets import bundled_model

PRESETS = {
    "full": {"input_len": 2500, "output_len": 1500, "prompts": lambda c: 80},
    "cpu": {"input_len": 256, "output_len": 128, "prompts": lambda c: max(24, 2 * c)},
}
DEFAULT_CONCURRENCY = [1, 2, 4, 8, 16, 20, 40, 80]
STARTUP_TIMEOUT_S = 600


def server_command(args, k: int, port: int, adaptive: bool = False) -> list[str]:
    if args.launch:
        return shlex.split(args.launch.format(port=port, k=k))
    cmd = [sys.executable, "-m", "xllm_py", "--port", str(port), f"--num_speculative_tokens={k}"]
    if adaptive:
        cmd.append("--speculative_adaptive=true")
    if args.model:
        cmd += ["--model", args.model]
    return cmd + shlex.split(args.server_args)


def bench_argv(
    args, base_url: str, concurrency: int, raw: Path, name: str, extra_body: dict | None = None
) -> list[str]:
    p = PRESETS[args.scale]
    argv = [
        "--base-url", base_url,
        "--dataset-name", "sharegpt",
        "--num-prompts", str(args.num_prompts or p["prompts"](concurrency)),
        "--max-concurrency", str(concurrency),
        "--input-len", str(args.input_len or p["input_len"]),
        "--output-len", str(args.output_len or p["output_len"]),
        "--ignore-eos",
        "--temperature", "0",
        "--seed", str(args.seed),
        "--save-result",
        "--result-dir", str(raw),
        "--result-filename", f"{name}.json",
        "--disable-tqdm",
    ]  # fmt: skip
    if args.model:
        argv += ["--tokenizer", args.model]
    if extra_body:
        argv += ["--extra-body", json.dumps(extra_body)]
    return argv


@dataclass
class Method:
    """One row group of the table: a server started by `cmd`, polled at `ready_path`, and
    fields every request to it carries (`extra_body`)."""

    name: str
    tag: str  # file names: server_{tag}.log, raw/{tag}_c{concurrency}.json
    cmd: list[str]
    ready_path: str = "/health"
    env: dict[str, str] | None = None
    extra_body: dict | None = None


def llama_cpp_method(args, input_len: int, output_len: int) -> tuple[Method, dict]:
    """llama.cpp's OpenAI server (llama-cpp-python) on the same model, converted to GGUF
    with llama.cpp's converter (perf/llama_cpp_peer.py); and the greedy agreement of its
    tokens with ours on held-out prompts."""
    from perf import llama_cpp_peer as peer

    model = Path(args.model or bundled_model())
    gguf = peer.convert(model, peer.CACHE_DIR / "gguf")  # ~46 MB: not among the results
    print(f"== llama.cpp: {gguf.name}; greedy agreement on {args.peer_prompts} prompts", flush=True)
    prompts = peer.sharegpt_prompts(args.peer_prompts, model)
    agreement = peer.greedy_agreement(gguf, model, prompts, args.peer_tokens)
    cmd = peer.server_command(gguf, args.port, input_len + output_len + 64, peer.server_threads())
    method = Method(
        "llama.cpp (no MTP)",
        "llama_cpp",
        cmd,
        ready_path=peer.READY_PATH,
        env=peer.server_env(),
        extra_body=peer.extra_request_body(model),
    )
    return method, {"gguf": str(gguf), "agreement": agreement}


def hf_peer(args, n: int) -> dict:
    """The first n benchmark prompts through HF transformers `generate`, one at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    from xllm_py.assets import bundled_model

    path = args.model or str(bundled_model())
    p = PRESETS[args.scale]
    prompts = bench_serving.sample_prompts(
        bench_argv(args, "http://unused", 1, Path("/tmp"), "peer")
    )[:n]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    out_len = args.output_len or p["output_len"]
    tokens = seconds = 0.0
    ttfts = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            ttfts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False)
            seconds += time.perf_counter() - t0
            tokens += out_len
    mean_ttft = sum(ttfts) / len(ttfts)
    return {
        "method": "HF transformers generate (offline, concurrency 1)",
        "num_prompts": len(prompts),
        "output_throughput": tokens / seconds,
        "mean_ttft_ms": 1000 * mean_ttft,
        "mean_tpot_ms": 1000 * (seconds / len(prompts) - mean_ttft) / (out_len - 1),
    }


def table(rows: list[dict], peer: dict | None) -> str:
    head = (
        "| method | concurrency | mean TPOT (ms) | mean TTFT (ms) | output tok/s | "
        "total tok/s | speedup | acceptance length | ceiling | failed |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        acc, ceil = r.get("spec_decode_acceptance_length"), r.get("ceiling")
        lines.append(
            f"| {r['method']} | {r['concurrency']} | {r['mean_tpot_ms']:.1f} | "
            f"{r['mean_ttft_ms']:.1f} | {r['output_throughput']:.1f} | "
            f"{r['total_token_throughput']:.1f} | {r['speedup']:.2f}x | "
            f"{'' if acc is None else f'{acc:.2f}'} | {'' if ceil is None else f'{ceil:.2f}x'} | "
            f"{r['failed']} |"
        )
    out = head + "\n".join(lines) + "\n"
    if peer:
        out += (
            f"\nPeer: {peer['method']} on the first {peer['num_prompts']} prompts: "
            f"{peer['output_throughput']:.1f} output tok/s, mean TTFT "
            f"{peer['mean_ttft_ms']:.1f} ms, mean TPOT {peer['mean_tpot_ms']:.1f} ms.\n"
        )
    return out


def add_ceiling(args, rows: list[dict], input_len: int, output_len: int) -> dict | None:
    """Each MTP row's `ceiling` (perf/step_cost.py) at its k and measured acceptance length,
    the KV read over input_len + output_len / 2 tokens; routing statistics from
    --ceiling-routing, else measured here on the model (which must then fit this machine).
    A failure leaves the column empty rather than losing the sweep."""
    rows_k = [(r, re.fullmatch(r"MTP k=(\d+)", r["method"])) for r in rows]
    rows_k = [(r, int(m.group(1))) for r, m in rows_k if m and r["spec_decode_acceptance_length"]]
    if args.no_ceiling or not rows_k:
        return None
    try:
        model = args.model or bundled_model()
        flags = shlex.split(args.server_args)
        draft = flag_value(flags, "draft_model")
        vocab = int(flag_value(flags, "speculative_draft_vocab_size") or 0)
        bm = step_cost.byte_model(model, draft_model=draft, draft_vocab=vocab)
        if args.ceiling_routing:
            routing = json.loads(args.ceiling_routing.read_text())["routing"]
        else:
            window = max(k for _, k in rows_k) + 1
            routing = step_cost.routing_stats(model, args.ceiling_prompts, 32, window, draft)
        context = input_len + output_len // 2
        for r, k in rows_k:
            acc = r["spec_decode_acceptance_length"]
            r["ceiling"] = step_cost.ceiling_row(bm, routing, k, acc, context)["ceiling"]
    except Exception as e:  # noqa: BLE001 - the column is an extra, the sweep is the result
        print(f"ceiling column left empty: {type(e).__name__}: {e}", flush=True)
        return None
    return {"context": context, "routing": routing, "byte_model": bm.__dict__}


def peer_note(peer_engine: dict | None) -> str:
    """The footer on --peer: whether the other engine computes what ours does."""
    if not peer_engine:
        return ""
    a = peer_engine["agreement"]
    return (
        f"\nllama.cpp ({Path(peer_engine['gguf']).name}, the target model only: its converter "
        f"drops the MTP layer) against ours, greedy, {a['num_prompts']} held-out prompts x "
        f"{a['max_tokens']} tokens: {100 * a['mean_identical_fraction']:.1f}% of tokens "
        f"identical, {100 * a['prompts_identical']:.0f}% of prompts identical throughout, "
        f"matching prefixes {100 * a['prefix_agreement']:.1f}% of all tokens. It serves one "
        "request at a time, so its rows above concurrency 1 measure queueing.\n"
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == method]
        c = [r["concurrency"] for r in rs]
        a.plot(c, [r["output_throughput"] for r in rs], marker="o", label=method)
        b.plot(c, [r["mean_tpot_ms"] for r in rs], marker="o", label=method)
    for ax, title in ((a, "output tokens/s"), (b, "mean TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scale", choices=sorted(PRESETS), default="cpu", help="length/count preset")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: bundled)")
    ap.add_argument("--k", type=int, nargs="+", default=[1], help="MTP draft counts to sweep")
    ap.add_argument(
        "--concurrency", type=int, nargs="+", default=DEFAULT_CONCURRENCY, help="levels"
    )
    ap.add_argument("--num-prompts", type=int, default=0, help="override the preset's count")
    ap.add_argument("--input-len", type=int, default=0, help="override the preset's input")
    ap.add_argument("--output-len", type=int, default=0, help="override the preset's output")
    ap.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    ap.add_argument("--port", type=int, default=8711, help="port for the daemon")
    ap.add_argument(
        "--server-args", default="", help="extra flags for our daemon (one quoted string)"
    )
    ap.add_argument(
        "--launch",
        default=None,
        help="command that starts another server instead, with {port} and {k} placeholders",
    )
    ap.add_argument(
        "--launch-stop",
        default=None,
        help="with --launch: command that stops what it started (for launchers that return, "
        "e.g. 'scripts/launch_cluster.sh stop')",
    )
    ap.add_argument(
        "--adaptive",
        action="store_true",
        help="also run MTP with --speculative_adaptive (k chosen per step, up to the largest --k)",
    )
    ap.add_argument("--no-ceiling", action="store_true", help="leave out the ceiling column")
    ap.add_argument(
        "--ceiling-routing",
        type=Path,
        default=None,
        help="a perf/step_cost.py JSON of this model whose routing statistics the ceiling "
        "uses (default: measured here, which loads the model in this process)",
    )
    ap.add_argument(
        "--ceiling-prompts", type=int, default=4, help="held-out prompts to measure routing on"
    )
    ap.add_argument(
        "--peer",
        choices=["llama.cpp"],
        default=None,
        help="also serve the model with another engine and benchmark it the same way: "
        "llama.cpp's OpenAI server (pip install -e .[llamacpp]; perf/llama_cpp_peer.py), "
        "with its greedy agreement with ours on --peer-prompts held-out prompts",
    )
    ap.add_argument("--peer-prompts", type=int, default=8, help="prompts for the agreement")
    ap.add_argument("--peer-tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--hf-peer", action="store_true", help="also time HF transformers generate")
    ap.add_argument("--hf-peer-prompts", type=int, default=8, help="prompts for the HF peer figure")
    ap.add_argument(
        "--result-dir", type=Path, default=ROOT / "perf/results/mtp_sweep", help="output folder"
    )
    args = ap.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]  # before anything can change sys.argv
    if args.adaptive and args.launch:
        ap.error("--adaptive runs our daemon with --speculative_adaptive; not with --launch")
    raw = args.result_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    p = PRESETS[args.scale]
    input_len, output_len = args.input_len or p["input_len"], args.output_len or p["output_len"]
    methods = [Method("baseline", "k0", server_command(args, 0, args.port))]
    methods += [Method(f"MTP k={k}", f"k{k}", server_command(args, k, args.port)) for k in args.k]
    if args.adaptive:
        top = max(args.k)
        cmd = server_command(args, top, args.port, adaptive=True)
        methods.append(Method(f"MTP adaptive k<={top}", "adaptive", cmd))
    peer_engine = None
    if args.peer == "llama.cpp":
        method, peer_engine = llama_cpp_method(args, input_len, output_len)
        methods.append(method)
    stop = shlex.split(args.launch_stop) if args.launch and args.launch_stop else None
    results: dict[str, dict[int, dict]] = {}
    for m in methods:
        print(f"== {m.name}: starting the server", flush=True)
        ours = m.ready_path == "/health"  # --launch-stop is for our launcher's servers
        log = args.result_dir / f"server_{m.tag}.log"
        daemon = Daemon(m.cmd, args.port, log, m.ready_path, m.env, stop if ours else None,
                        group=True, startup_timeout=STARTUP_TIMEOUT_S)  # fmt: skip
        try:
            warm_up(daemon.url, m.extra_body)
            for c in args.concurrency:
                argv = bench_argv(args, daemon.url, c, raw, f"{m.tag}_c{c}", m.extra_body)
                res = bench_serving.run(argv)
                name = m.name
                results.setdefault(name, {})[c] = res
                print(
                    f"   concurrency {c:>3}: {res['output_throughput']:8.1f} output tok/s, "
                    f"TPOT {res['mean_tpot_ms']:7.1f} ms, TTFT {res['mean_ttft_ms']:7.1f} ms, "
                    f"failed {res['failed']}",
                    flush=True,
                )
        finally:
            daemon.stop()
    rows = []
    for c in args.concurrency:
        base = results["baseline"][c]["output_throughput"]
        for m in methods:
            name, r = m.name, results[m.name][c]
            rows.append(
                {
                    "method": name,
                    "concurrency": c,
                    "speedup": r["output_throughput"] / base,
                    "ttft_ratio": r["mean_ttft_ms"] / results["baseline"][c]["mean_ttft_ms"],
                    "ceiling": None,
                    **{
                        key: r.get(key)
                        for key in (
                            "mean_tpot_ms",
                            "mean_ttft_ms",
                            "output_throughput",
                            "total_token_throughput",
                            "failed",
                            "completed",
                            "spec_decode_acceptance_length",
                            "spec_decode_acceptance_rate",
                        )
                    },
                }
            )
    peer = hf_peer(args, args.hf_peer_prompts) if args.hf_peer else None
    command = " ".join(["python", "-m", "perf.mtp_sweep", *given])
    ceiling = add_ceiling(args, rows, input_len, output_len)
    summary = {
        "command": command,
        "scale": args.scale,
        "input_len": input_len,
        "output_len": output_len,
        "machine": machine(),
        "rows": rows,
        "hf_peer": peer,
        "peer_engine": peer_engine,
        "ceiling": ceiling,
    }
    (args.result_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    md = (
        f"# MTP sweep ({args.scale})\n\n`{command}`\n\n"
        f"Machine: {json.dumps(summary['machine'])}\n\n"
        f"ShareGPT prompts cut/extended to {summary['input_len']} input tokens, "
        f"{summary['output_len']} output tokens (ignore_eos), greedy; the same prompts and "
        "settings for every method. Speedup = output tok/s over the baseline at the same "
        "concurrency, measured in this run. Ceiling = the batch-1 bandwidth bound on that "
        "speedup at the row's k and acceptance length (perf/step_cost.py; perf/README.md "
        "says how to read it).\n\n" + table(rows, peer) + peer_note(peer_engine)
    )
    (args.result_dir / "results.md").write_text(md)
    plot(rows, args.result_dir / "sweep.png")
    print(md)
    return summary


if __name__ == "__main__":
    main()
