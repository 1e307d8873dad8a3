"""Do two load generators agree? guidellm (the vLLM project's load tester, run as users
run it) and perf/bench_serving.py against one daemon, the same workload, interleaved.

    .venv/bin/python perf/client_agreement.py            # about 4 minutes here

Same workload: bench_serving builds --requests random prompts of --input-len tokens
(--seed); guidellm reads the very same prompts from a JSON file, so both send identical
text and MTP's acceptance, which depends on the text, is the same for both. Both ask for
--output-len tokens (ignore_eos) at each concurrency, greedy (bench_serving's default; guidellm gets
`temperature: 0` through its backend `extras`, else the server's default 1.0 would
sample, and MTP accepts fewer drafts when sampling). Same warm-up: bench_serving sends
`concurrency` warm-up requests before it starts its clock; guidellm's first
`concurrency` requests (copies of the first prompt) are left out of its figure, which is
output tokens / (last end - first start) of the rest, from its own per-request records.

Same machine share: with --pin (the default where there are 2+ cores) the daemon runs
on core 0 (its one torch thread, the default there) and the clients on the other
cores, so neither client's own CPU use slows the server it measures. Each client runs
--rounds times, alternating; the ratio of medians is reported, and guidellm's CPU
seconds per run. --guidellm-stream false has guidellm ask for whole responses rather
than token streams (its per-chunk work is the cost). Two benchmarks that measure the
same server within a few percent are both honest; one that disagrees is measuring
itself. Writes perf/results/client_agreement.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
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


def bench_argv(url: str, concurrency: int, args) -> list[str]:
    return [
        "--base-url", url, "--dataset-name", "random", "--tokenizer", str(bundled_model()),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--ignore-eos", "--num-prompts", str(args.requests), "--num-warmups", str(concurrency),
        "--max-concurrency", str(concurrency), "--seed", str(args.seed), "--disable-tqdm",
    ]  # fmt: skip


def write_prompts(url: str, concurrency: int, args, path: Path) -> None:
    """bench_serving's prompts for this run, after `concurrency` copies of the first (the
    warm-up), in guidellm's data-file columns."""
    args_ = bench_serving.parse_args(bench_argv(url, concurrency, args))
    requests = bench_serving.build_workload(args_, bench_serving.load_tokenizer(args_.tokenizer))
    # and one spare: guidellm 0.8.1 at times stops one row short of the end of its data
    rows = [requests[0]] * concurrency + requests + [requests[-1]]
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": r.prompt,
                    "prompt_tokens_count": r.prompt_len,
                    "output_tokens_count": r.output_len,
                }
            )
            + "\n"
            for r in rows
        )
    )


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def guidellm_tok_s(url: str, concurrency: int, args, work: Path) -> tuple[float, float]:
    """(output tokens/s after the warm-up requests, guidellm's CPU seconds)."""
    data, out = work / f"prompts_c{concurrency}.jsonl", work / f"guidellm_c{concurrency}.json"
    write_prompts(url, concurrency, args, data)
    n = args.requests + concurrency
    backend = {
        "kind": "openai_http",
        "target": url,
        "request_format": "/v1/completions",
        "stream": args.guidellm_stream,
        "extras": {"body": {"temperature": 0}},  # greedy, as bench_serving sends by default
    }
    cmd = [
        *args.client_prefix, str(GUIDELLM), "run", "--backend", json.dumps(backend),
        "--profile", f"kind=concurrent,streams={concurrency}",
        "--data", f"kind=json_file,path={data}",
        "--tokenizer", f"kind=huggingface_auto,model={bundled_model()}",
        "--output", f"kind=json,path={out}", "--disable-console-interactive",
    ]  # fmt: skip
    cpu = children_cpu_s()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=work)
    cpu = children_cpu_s() - cpu
    if r.returncode != 0:
        raise RuntimeError(f"guidellm failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    (b,) = json.loads(out.read_text())["benchmarks"]
    done = sorted(b["requests"]["successful"], key=lambda x: x["request_start_time"])
    if b["requests"].get("errored") or len(done) < n:
        raise RuntimeError(f"guidellm: {len(done)} of {n} requests succeeded")
    if any(x["output_tokens"] != args.output_len for x in done):
        raise RuntimeError("guidellm: a request got a different number of output tokens")
    measured = done[concurrency:n]  # the spare, when guidellm sent it, is not counted
    span = max(x["request_end_time"] for x in measured) - measured[0]["request_start_time"]
    return sum(x["output_tokens"] for x in measured) / span, cpu


@contextlib.contextmanager
def on_cores(cores: set[int] | None):
    """Run this process (bench_serving runs in it) on `cores` meanwhile."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def bench_serving_tok_s(url: str, concurrency: int, args, work: Path) -> float:
    with on_cores(args.client_cores):
        result = bench_serving.run([*bench_argv(url, concurrency, args), "--result-dir", str(work)])
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
    cores = os.cpu_count() or 1
    p.add_argument("--pin", type=lambda v: v.lower() in ("1", "true", "yes"),
                   default=cores >= 2, metavar="{true,false}",
                   help="daemon on core 0, the clients on the others (needs 2+ cores)")  # fmt: skip
    p.add_argument("--guidellm-stream", type=lambda v: v.lower() in ("1", "true", "yes"),
                   default=True, metavar="{true,false}",
                   help="stream tokens (guidellm default) or ask for whole answers")  # fmt: skip
    p.add_argument("--output", default=str(ROOT / "perf/results/client_agreement.json"))
    args = p.parse_args(argv)
    if args.pin and cores < 2:
        p.error("--pin needs at least 2 cores")
    args.client_cores = set(range(1, cores)) if args.pin else None
    args.client_prefix = ["taskset", "-c", f"1-{cores - 1}"] if args.pin else []
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="client-agreement-"))
    cmd = [sys.executable, "-m", "xllm_py", "--port", str(port), *args.server_args.split()]
    if args.pin:
        cmd = ["taskset", "-c", "0", *cmd]
    daemon = Daemon(cmd, work / "server.log", port)
    rows = []
    try:
        warm_up(daemon.url)
        for c in args.concurrency:
            g, cpu, b = [], [], []
            for _ in range(args.rounds):
                tok_s, seconds = guidellm_tok_s(daemon.url, c, args, work)
                g.append(tok_s)
                cpu.append(seconds)
                b.append(bench_serving_tok_s(daemon.url, c, args, work))
            row = {
                "concurrency": c,
                "guidellm_output_tok_s": g,
                "guidellm_cpu_s": cpu,
                "bench_serving_output_tok_s": b,
                "ratio_of_medians": statistics.median(g) / statistics.median(b),
            }
            rows.append(row)
            print(
                f"concurrency {c:3d}: guidellm {statistics.median(g):7.1f} output tok/s "
                f"({statistics.median(cpu):.1f} CPU s a run), bench_serving "
                f"{statistics.median(b):7.1f}, ratio {row['ratio_of_medians']:.3f}",
                flush=True,
            )
    finally:
        daemon.stop()
    result = {
        "command": "python perf/client_agreement.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "settings": {
            k: v
            for k, v in vars(args).items()
            if k not in ("output", "client_cores", "client_prefix")
        },
        "rows": rows,
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
