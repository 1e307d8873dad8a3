#!/usr/bin/env python3
"""Cluster overheads, measured: the per-step gRPC control cost, and 1 node vs 2 nodes.

    python -m perf.bench_rpc                    # writes perf/results/bench_rpc.json

1. Control overhead. A real worker process (node 1) registers with an in-process
   coordinator and loads the model; the master side then times ExecuteStep round trips
   through `GrpcExecutor` (the path every step of a remote replica takes) with an empty
   step and with a 32-request step message, plus the raw blocking stub call and the cost
   of converting + serialising a 32-request decode step. Nothing is computed by the
   model in these steps, so what is measured is protocol, gRPC and thread hand-off.
2. Throughput. The same serving benchmark (perf/bench_serving.py: held-out ShareGPT
   text cut to --input-len tokens, --output-len tokens out, greedy, --concurrency
   requests in flight) against one node, a 2-node tensor-parallel cluster and a 2-node
   data-parallel cluster, with MTP off and on, all in this one run. On one machine the
   nodes share its cores, so this measures the cost of splitting, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from perf import bench_serving
from perf.daemon import ROOT, Daemon, free_port, free_port_range, machine, warm_up


def timed(fn, n: int) -> dict:
    for _ in range(min(50, n)):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return {
        "median_us": 1e6 * statistics.median(ts),
        "p90_us": 1e6 * ts[int(0.9 * (n - 1))],
        "samples": n,
    }


def control_overhead(n: int) -> dict:
    from xllm_py.cli import build_config, build_parser
    from xllm_py.cluster import cluster_pb2 as pb
    from xllm_py.cluster.coordinator import Coordinator, serve_coordinator
    from xllm_py.cluster.grpc_executor import GrpcExecutor, WorkerClient
    from xllm_py.cluster.layout import ClusterLayout, model_fingerprint
    from xllm_py.cluster.wire import sched_to_pb
    from xllm_py.executor.messages import CachedRequestData, SchedulerOutput

    master_port, worker_port = free_port(), free_port()
    config = build_config(build_parser().parse_args(["--dtype=float32"]))
    coordinator = Coordinator(ClusterLayout(2, 2), model_fingerprint(config))
    server = serve_coordinator(f"127.0.0.1:{master_port}", coordinator)
    worker = Daemon(
        [
            sys.executable, "-m", "xllm_py", "--nnodes=2", "--dp_size=2", "--node_rank=1",
            f"--master_node_addr=127.0.0.1:{master_port}", f"--port={worker_port}",
            "--dtype=float32", "--heartbeat_timeout=120", "--log_level=warning",
        ],
        log="/tmp/xllm-bench-rpc-worker.log", ready_path=None,
    )  # fmt: skip
    try:
        reg = coordinator.wait_all(120)[1]
        client = WorkerClient(1, reg.address, coordinator.session)
        init = pb.InitModelRequest(world_size=2, dp_size=2, tp_size=1, ep_size=1, replica=1)
        ex = GrpcExecutor([client], init, 60)
        ex.determine_num_blocks()
        ex.init_cache(64)
        decode = SchedulerOutput(
            cached_requests=[CachedRequestData(f"r{i}", [5], [], 100) for i in range(32)],
            num_scheduled_tokens={f"r{i}": 1 for i in range(32)},
        )
        forget = SchedulerOutput(finished_req_ids={f"r{i}" for i in range(32)})
        empty_pb = sched_to_pb(SchedulerOutput())
        out = {
            "empty_step_via_executor": timed(lambda: ex.execute(SchedulerOutput()), n),
            "step_with_32_finished_ids_via_executor": timed(lambda: ex.execute(forget), n),
            "raw_blocking_stub_call": timed(
                lambda: client.stub.ExecuteStep(empty_pb, timeout=10), n
            ),
            "convert_and_serialise_32_request_decode_step": timed(
                lambda: sched_to_pb(decode).SerializeToString(), n
            ),
        }
        ex.shutdown("benchmark done")
        return out
    finally:
        worker.stop(timeout=15)  # the executor's shutdown has stopped it already
        server.stop(0)


def throughput(args) -> list[dict]:
    http = free_port()
    setups = {
        "1 node": [[]],
        "2-node TP": [["--nnodes=2", "--dp_size=1"], ["--nnodes=2", "--dp_size=1"]],
        "2-node DP": [["--nnodes=2", "--dp_size=2"], ["--nnodes=2", "--dp_size=2"]],
    }
    rows = []
    for k in args.k:
        for name, nodes in setups.items():
            master = free_port_range(2)  # + 1: torch.distributed rendezvous
            daemons = []
            try:
                for rank in reversed(range(len(nodes))):  # workers first, master last
                    port = http if rank == 0 else free_port()
                    cmd = [
                        sys.executable, "-m", "xllm_py", f"--port={port}",
                        f"--num_speculative_tokens={k}", "--dtype=float32", *nodes[rank],
                    ]  # fmt: skip
                    if len(nodes) > 1:
                        cmd += [f"--node_rank={rank}", f"--master_node_addr=127.0.0.1:{master}"]
                    log = args.log_dir / f"{name.replace(' ', '_')}_k{k}_node{rank}.log"
                    ready = "/health" if rank == 0 else None  # a worker node has no HTTP
                    daemons.append(Daemon(cmd, port, log, ready_path=ready))
                url = daemons[-1].url
                warm_up(url)
                res = bench_serving.run(
                    [
                        "--base-url",
                        url,
                        "--num-prompts",
                        str(args.num_prompts),
                        "--max-concurrency",
                        str(args.concurrency),
                        "--input-len",
                        str(args.input_len),
                        "--output-len",
                        str(args.output_len),
                        "--ignore-eos",
                        "--temperature",
                        "0",
                        "--disable-tqdm",
                    ]  # fmt: skip
                )
                rows.append(
                    {
                        "setup": name,
                        "k": k,
                        "output_throughput": res["output_throughput"],
                        "mean_tpot_ms": res["mean_tpot_ms"],
                        "mean_ttft_ms": res["mean_ttft_ms"],
                        "failed": res["failed"],
                    }
                )
                print(
                    f"{name:10s} k={k}: {res['output_throughput']:7.1f} output tok/s, "
                    f"TPOT {res['mean_tpot_ms']:6.1f} ms, failed {res['failed']}",
                    flush=True,
                )
            finally:
                for d in reversed(daemons):
                    d.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=500, help="timed round trips per case")
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1], help="MTP draft counts")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per setup")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens")
    ap.add_argument(
        "--output", type=Path, default=ROOT / "perf/results/bench_rpc.json", help="JSON file"
    )
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/xllm-bench-rpc"), help="node logs")
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    overhead = control_overhead(args.steps)
    for name, r in overhead.items():
        print(f"{name}: median {r['median_us']:.0f} us, p90 {r['p90_us']:.0f} us", flush=True)
    rows = throughput(args)
    args.output.write_text(
        json.dumps(
            {
                "command": " ".join(["python", *sys.argv]),
                "machine": machine(),
                "control_overhead": overhead,
                "throughput": rows,
                "workload": {
                    "concurrency": args.concurrency,
                    "num_prompts": args.num_prompts,
                    "input_len": args.input_len,
                    "output_len": args.output_len,
                },
            },
            indent=2,
        )
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
