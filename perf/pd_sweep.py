"""Prefill/decode disaggregation against colocated serving, in one run.

    python -m perf.pd_sweep                                   # bundled model, c = 4 and 16
    python -m perf.pd_sweep --concurrency 8 --num-prompts 64 --k 0

Each deployment is started on this host with scripts/launch_cluster.sh, warmed up, sent
the same ShareGPT requests (perf/bench_serving.py: the prompts at their own lengths, long
and short mixed, --output-len tokens each, greedy, ignore_eos; other prompts at each
--concurrency, none found in a prefix cache from the level before) and stopped:
    1 daemon     one instance that prefills and decodes
    2 replicas   two colocated instances behind one front (--dp_size=2)
    PD 1P+1D     a prefill and a decode instance behind the PD router (docs/pd.md)
Reported: output tok/s, TTFT and TPOT p50/p99, and for PD where the time goes: the KV
bytes moved per request and the time from the decode instance's ask to the blocks'
arrival (the prefill instance's compute and the transfer), from the decode instance's
/metrics. Writes --result-dir results.md, sweep.json, sweep.png and raw/ (bench_serving's).
On a 2-core host the deployments share the cores, so PD is not expected to win there:
this shows its costs.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from perf import bench_serving
from perf.common import RESULTS, ROOT, command, machine, md_table, parser, write_results
from perf.daemon import HTTP, Daemon, free_port_range, samples, warm_up

FLAGS = [  # (flag, type, default, help)
    ("--concurrency", int, [4, 16], "concurrency levels"),
    ("--k", int, 1, "MTP draft tokens of every instance"),
    ("--num-prompts", int, 48, "requests per level"),
    ("--output-len", int, 64, "output tokens of each request"),
    ("--model", str, None, "checkpoint directory (None: the bundled model)"),
    ("--seed", int, 0, "prompt sampling seed"),
    ("--extra-args", str, "--enable_graph=false", "more flags for every instance "
     "(launch_cluster.sh's EXTRA_ARGS); eager by default: graph mode's background compiles "
     "of every instance would share the cores with the benchmark"),
    ("--result-dir", Path, RESULTS / "pd", "output folder"),
]  # fmt: skip

DEPLOYMENTS = {  # name -> launch_cluster.sh settings
    "1 daemon": {"NNODES": "1"},
    "2 replicas": {"NNODES": "2", "DP_SIZE": "2", "EP_SIZE": "1"},
    "PD 1P+1D": {"PD_PREFILL": "1", "PD_DECODE": "1"},
}
PD_TOTALS = ("xllm:pd_kv_bytes_total", "xllm:pd_transfers_total",
             "xllm:pd_transfer_seconds_sum", "xllm:pd_transfer_failures_total")  # fmt: skip


def start(args, name: str, port: int) -> Daemon:
    tag = name.lower().replace(" ", "_").replace("+", "")
    env = {
        "NUM_SPECULATIVE_TOKENS": str(args.k), "START_PORT": str(port),
        "MASTER_NODE_ADDR": f"127.0.0.1:{free_port_range(2)}", "MODEL_PATH": args.model or "",
        "LOG_DIR": str(Path(tempfile.gettempdir()) / f"xllm-pd-sweep-{tag}"),
        "EXTRA_ARGS": args.extra_args,
        # each instance's KV cache: 0.2 of this host's memory, not 0.9 each
        "MAX_MEMORY_UTILIZATION": "0.2", **DEPLOYMENTS[name],
    }  # fmt: skip
    words = ["env", *(f"{a}={b}" for a, b in env.items()), "bash"]
    script = str(ROOT / "scripts" / "launch_cluster.sh")
    log = args.result_dir / f"launch_{tag}.log"
    return Daemon([*words, script], port, log, stop_cmd=[*words, script, "stop"], group=True,
                  startup_timeout=600)  # fmt: skip


def pd_totals(url: str) -> dict[str, float]:
    """The decode instance's PD_TOTALS now."""
    page = HTTP.get(url + "/metrics", timeout=10).text
    return {n: sum(v for name, _, v in samples(page) if name == n) for n in PD_TOTALS}


def bench(args, url: str, c: int, raw: Path, name: str) -> dict:
    """bench_serving at concurrency c; each level its own prompts (--seed + its index), so
    no level finds the one before's prompts in the prefix caches."""
    seed = args.seed + args.concurrency.index(c)
    argv = ["--base-url", url, "--num-prompts", str(args.num_prompts), "--max-concurrency",
            str(c), "--output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--save-result", "--result-dir", str(raw),
            "--result-filename", f"{name}.json", "--disable-tqdm"]  # fmt: skip
    return bench_serving.run(argv + (["--tokenizer", args.model] if args.model else []))


def run_deployment(args, name: str, port: int, raw: Path) -> list[dict]:
    print(f"== {name}: starting", flush=True)
    daemon = start(args, name, port)
    decode_url = f"http://127.0.0.1:{port + 2}"  # PD: the decode instance (router, P, D)
    rows = []
    try:
        warm_up(daemon.url)
        for c in args.concurrency:
            before = pd_totals(decode_url) if name.startswith("PD") else None
            res = bench(args, daemon.url, c, raw, f"{name.replace(' ', '_')}_c{c}")
            row = {"deployment": name, "concurrency": c, **{k: res[k] for k in (
                "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "p99_tpot_ms", "completed", "failed", "total_input_tokens")}}  # fmt: skip
            if before is not None:
                moved = {k: v - before[k] for k, v in pd_totals(decode_url).items()}
                n = moved["xllm:pd_transfers_total"] or 1
                row |= {"kv_mb_per_request": moved["xllm:pd_kv_bytes_total"] / n / 1e6,
                        "transfer_ms_mean": 1e3 * moved["xllm:pd_transfer_seconds_sum"] / n,
                        "transfers": moved["xllm:pd_transfers_total"],
                        "transfer_failures": moved["xllm:pd_transfer_failures_total"]}  # fmt: skip
            rows.append(row)
            print(f"   concurrency {c:>3}: {row['output_throughput']:8.1f} output tok/s, TTFT "
                  f"p50 {row['median_ttft_ms']:.0f} ms, TPOT p50 {row['median_tpot_ms']:.1f} ms",
                  flush=True)  # fmt: skip
    finally:
        daemon.stop()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for name in DEPLOYMENTS:
        rs = [r for r in rows if r["deployment"] == name]
        c = [r["concurrency"] for r in rs]
        for ax, key in zip(axes, ("output_throughput", "median_ttft_ms", "median_tpot_ms")):
            ax.plot(c, [r[key] for r in rs], marker="o", label=name)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (ms)", "TPOT p50 (ms)")):
        ax.set(xlabel="concurrency", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, FLAGS).parse_args(argv)
    (raw := args.result_dir / "raw").mkdir(parents=True, exist_ok=True)
    port = free_port_range(3)  # router or node 0, then the instances
    rows = [r for name in DEPLOYMENTS for r in run_deployment(args, name, port, raw)]
    cmd = command("pd_sweep", argv)
    summary = {"command": cmd, "k": args.k, "output_len": args.output_len,
               "num_prompts": args.num_prompts, "machine": machine(), "rows": rows}  # fmt: skip
    (args.result_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    plot(rows, args.result_dir / "sweep.png")
    head = ["deployment", "concurrency", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
            "TPOT p50 ms", "TPOT p99 ms", "KV MB/request", "ask-to-arrival ms",
            "failed"]  # fmt: skip
    table = md_table(head, [
        [r["deployment"], r["concurrency"], f"{r['output_throughput']:.1f}",
         f"{r['median_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}", f"{r['median_tpot_ms']:.1f}",
         f"{r['p99_tpot_ms']:.1f}", f"{r['kv_mb_per_request']:.2f}" if "transfers" in r else "",
         f"{r['transfer_ms_mean']:.0f}" if "transfers" in r else "", r["failed"]]
        for r in rows])  # fmt: skip
    note = (f"ShareGPT prompts at their own lengths, {args.output_len} output tokens each "
            f"(ignore_eos), greedy, MTP k={args.k}, instances eager; every deployment in this "
            "run, on the same prompts (other ones at each concurrency).")  # fmt: skip
    write_results(args.result_dir, "Prefill/decode disaggregation against colocated serving",
                  cmd, summary["machine"], note, table)  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
