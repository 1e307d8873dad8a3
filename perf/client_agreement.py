"""Do two load generators agree? guidellm (the vLLM project's load tester, run as users
run it) and perf/bench_serving.py against one daemon, the same workload, interleaved.

    .venv/bin/python perf/client_agreement.py            # about 3 minutes here

Both send synthetic prompts of --input-len tokens and ask for --output-len tokens
(ignore_eos) at each concurrency, --requests each; each client runs --rounds times,
alternating, and the output tokens/s of the two are compared per round and over the
medians. Two benchmarks that measure the same server within a few percent are both
honest; one that disagrees is measuring itself. Writes perf/results/client_agreement.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perf import bench_serving  # noqa: E402
from perf.mtp_sweep import Daemon, machine, warm_up  # noqa: E402
from tests.server_utils import free_port  # noqa: E402
from xllm_py.assets import bundled_model  # noqa: E402

GUIDELLM = Path(sys.executable).parent / "guidellm"


def guidellm_tok_s(url: str, concurrency: int, args, work: Path) -> float:
    out = work / f"guidellm_c{concurrency}.json"
    cmd = [
        str(GUIDELLM), "run",
        "--backend", f"kind=openai_http,target={url},request_format=/v1/completions",
        "--profile", f"kind=concurrent,streams={concurrency}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},"
                  f"output_tokens={args.output_len}",
        "--tokenizer", f"kind=huggingface_auto,model={bundled_model()}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--output", f"kind=json,path={out}",
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=work)
    if r.returncode != 0:
        raise RuntimeError(f"guidellm failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    (b,) = json.loads(out.read_text())["benchmarks"]
    totals = b["metrics"]["request_totals"]
    if totals["errored"] or totals["successful"] != args.requests:
        raise RuntimeError(f"guidellm: {totals}")
    tokens = sum(x["output_tokens"] for x in b["requests"]["successful"])
    return tokens / b["duration"]


def bench_serving_tok_s(url: str, concurrency: int, args, work: Path) -> float:
    result = bench_serving.run(
        [
            "--base-url", url, "--dataset-name", "random",
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--ignore-eos", "--num-prompts", str(args.requests),
            "--max-concurrency", str(concurrency), "--seed", str(args.seed),
            "--disable-tqdm", "--result-dir", str(work),
        ]
    )  # fmt: skip
    if result["completed"] != args.requests:
        raise RuntimeError(f"bench_serving: {result['completed']} of {args.requests} completed")
    return result["output_throughput"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--requests", type=int, default=16, help="requests per run and level")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="runs of each client, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="--num_speculative_tokens=1",
                   help="flags of the daemon under test")  # fmt: skip
    p.add_argument("--output", default=str(ROOT / "perf/results/client_agreement.json"))
    args = p.parse_args(argv)
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="client-agreement-"))
    cmd = [sys.executable, "-m", "xllm_py", "--port", str(port), *args.server_args.split()]
    daemon = Daemon(cmd, work / "server.log", port)
    rows = []
    try:
        warm_up(daemon.url)
        for c in args.concurrency:
            g, b = [], []
            for _ in range(args.rounds):
                g.append(guidellm_tok_s(daemon.url, c, args, work))
                b.append(bench_serving_tok_s(daemon.url, c, args, work))
            row = {
                "concurrency": c,
                "guidellm_output_tok_s": g,
                "bench_serving_output_tok_s": b,
                "ratio_of_medians": statistics.median(g) / statistics.median(b),
            }
            rows.append(row)
            print(
                f"concurrency {c:3d}: guidellm {statistics.median(g):7.1f} output tok/s, "
                f"bench_serving {statistics.median(b):7.1f}, ratio {row['ratio_of_medians']:.3f}",
                flush=True,
            )
    finally:
        daemon.stop()
    result = {
        "command": "python perf/client_agreement.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "rows": rows,
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
