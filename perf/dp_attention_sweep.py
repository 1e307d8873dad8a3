"""DP attention against tensor parallelism on the same nodes, in one run.

    python -m perf.dp_attention_sweep                       # 2 CPU nodes, concurrency 16
    python -m perf.dp_attention_sweep --nnodes 4 --concurrency 16 32 --k 0 2

For each layout it starts the cluster with scripts/launch_cluster.sh on this host (the
bundled model unless --model), warms it up, runs perf/bench_serving.py at every
--concurrency on the same ShareGPT prompts (greedy, ignore_eos; perf/mtp_sweep.py's
presets) and stops it. Layouts, MTP k each:
    TP      --dp_size=1 --ep_size=nnodes: one replica, heads and experts split
    DP att. --dp_size=--ep_size=nnodes --enable_dp_attention: every node its own requests,
            the experts spread over all, tokens exchanged by all-to-all
Writes --result-dir results.md, sweep.json and raw/ (bench_serving's), and prints the table:
output tok/s of each layout and DP attention's ratio over TP at the same concurrency.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from perf.common import RESULTS, ROOT, command, machine, md_table, parser, write_results
from perf.daemon import free_port_range
from perf.mtp_sweep import Method, lengths, run_method

FLAGS = [  # (flag, type, default, help)
    ("--nnodes", int, 2, "nodes (processes) of each cluster"),
    ("--k", int, [1], "MTP draft tokens per step (each k runs both layouts)"),
    ("--concurrency", int, [16], "concurrency levels"),
    ("--scale", ("cpu", "full"), "cpu", "length and request-count preset (perf/mtp_sweep.py)"),
    ("--model", str, None, "checkpoint directory (None: the bundled model)"),
    ("--num-prompts", int, 0, "requests per level (0: the preset's)"),
    ("--input-len", int, 0, "prompt tokens (0: the preset's)"),
    ("--output-len", int, 0, "output tokens (0: the preset's)"),
    ("--seed", int, 0, "prompt sampling seed"),
    ("--extra-args", str, "", "more flags for every node (launch_cluster.sh's EXTRA_ARGS)"),
    ("--result-dir", Path, RESULTS / "dp_attention", "output folder"),
]  # fmt: skip

LAYOUTS = {  # name -> launch_cluster.sh settings, given nnodes
    "TP": lambda n: {"DP_SIZE": "1", "EP_SIZE": str(n), "ENABLE_DP_ATTENTION": "false"},
    "DP attention": lambda n: {"DP_SIZE": str(n), "EP_SIZE": str(n), "ENABLE_DP_ATTENTION": "true"},
}  # fmt: skip


def method(args, layout: str, k: int, port: int) -> Method:
    tag = f"{layout.lower().replace(' ', '_')}_k{k}"
    env = {
        "NNODES": str(args.nnodes), "NUM_SPECULATIVE_TOKENS": str(k), "START_PORT": str(port),
        "MASTER_NODE_ADDR": f"127.0.0.1:{free_port_range(2)}", "MODEL_PATH": args.model or "",
        # the nodes' logs and the cluster token: outside the results
        "LOG_DIR": str(Path(tempfile.gettempdir()) / f"xllm-dp-sweep-{tag}"),
        "EXTRA_ARGS": args.extra_args,
        # the KV cache of each node: 0.2 of this host's memory, not 0.9 each
        "MAX_MEMORY_UTILIZATION": "0.2", **LAYOUTS[layout](args.nnodes),
    }  # fmt: skip
    words = ["env", *(f"{a}={b}" for a, b in env.items()), "bash"]
    script = str(ROOT / "scripts" / "launch_cluster.sh")
    return Method(f"{layout} k={k}", tag, [*words, script], [*words, script, "stop"])


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, FLAGS).parse_args(argv)
    if args.nnodes < 2:
        sys.exit(f"--nnodes={args.nnodes}: DP attention needs at least 2 nodes")
    (raw := args.result_dir / "raw").mkdir(parents=True, exist_ok=True)
    args.port = free_port_range(args.nnodes)  # node 0's HTTP port (START_PORT), for run_method
    rows = []
    for k in args.k:
        results = {}
        for layout in LAYOUTS:
            m = method(args, layout, k, args.port)
            results[layout], _ = run_method(args, m, raw, {})
        for c in args.concurrency:
            tp, dpa = results["TP"][c], results["DP attention"][c]
            rows.append({
                "k": k, "concurrency": c,
                "tp_output_tok_s": tp["output_throughput"],
                "dp_attention_output_tok_s": dpa["output_throughput"],
                "ratio": dpa["output_throughput"] / tp["output_throughput"],
                "tp_tpot_ms": tp["mean_tpot_ms"], "dp_attention_tpot_ms": dpa["mean_tpot_ms"],
                "failed": tp["failed"] + dpa["failed"],
            })  # fmt: skip
    input_len, output_len = lengths(args)
    cmd = command("dp_attention_sweep", argv)
    summary = {"command": cmd, "nnodes": args.nnodes, "input_len": input_len,
               "output_len": output_len, "machine": machine(), "rows": rows}  # fmt: skip
    (args.result_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    head = ["k", "concurrency", "TP output tok/s", "DP attention output tok/s", "DP att. / TP",
            "TP TPOT ms", "DP att. TPOT ms", "failed"]  # fmt: skip
    table = md_table(head, [
        [r["k"], r["concurrency"], f"{r['tp_output_tok_s']:.1f}",
         f"{r['dp_attention_output_tok_s']:.1f}", f"{r['ratio']:.2f}x",
         f"{r['tp_tpot_ms']:.1f}", f"{r['dp_attention_tpot_ms']:.1f}", r["failed"]]
        for r in rows])  # fmt: skip
    note = (
        f"ShareGPT prompts cut/extended to {input_len} input and {output_len} output "
        "tokens (ignore_eos), greedy; both layouts in this run, on the same prompts."
    )
    write_results(args.result_dir, f"DP attention against TP, {args.nnodes} nodes on one host",
                  cmd, summary["machine"], note, table)  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
