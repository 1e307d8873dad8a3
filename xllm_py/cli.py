"""The `xllm` command (also `python -m xllm_py`): the OpenAI-compatible serving daemon.

Flags follow xLLM's names and accept `--flag=value` or `--flag value`;
booleans take `--flag=true|false` (a bare `--flag` means true). Without
`--model` it serves the bundled tiny DeepSeek-V3 + MTP checkpoint.

    xllm --model /models/DeepSeek-V3 --devices=cuda:0 --port 9977 \\
         --draft_model /models/DeepSeek-V3-MTP --draft_devices=cuda:0 --num_speculative_tokens 1

A data-parallel cluster: one process per device; node 0 serves HTTP and its own replica,
nodes 1..N-1 run a worker whose gRPC service listens on their --host:--port:

    xllm --nnodes=2 --dp_size=2 --node_rank=0 --master_node_addr=10.0.0.1:9900 --port 8000
    xllm --nnodes=2 --dp_size=2 --node_rank=1 --master_node_addr=10.0.0.1:9900 --port 9901

Give every node the same --cluster_token_file (and --cluster_tls_cert/_key/_ca for TLS):
without a token anyone who can reach the gRPC ports can join or drive the cluster.
Secrets are best given by the environment (XLLM_API_KEY, XLLM_CLUSTER_TOKEN) or files:
a command line is visible to every user of the host.

Every flag is declared once, in xllm_py/args.py (EngineArgs); this module only parses
and dispatches: to the HTTP daemon (entrypoints/serve.py), a cluster worker node
(cluster/worker_node.py), the Ray launcher (cluster/ray_launch.py) or the PD router
(pd/router.py).

Exit status: 0 after a clean shutdown (SIGTERM/SIGINT on the master, or on a cluster
worker, which asks the master to do the same: /health and new requests answer 503 while
in-flight requests get --shutdown_timeout seconds to finish; the rest are aborted with
an error naming the timeout);
1 when the engine failed (in-flight requests get an error first); 2 for bad flags or
unreadable token or certificate files.
"""

from __future__ import annotations

import logging
import sys

from xllm_py.args import EngineArgs
from xllm_py.args import build_parser as _build_parser
from xllm_py.cluster.layout import check_args as check_cluster_args
from xllm_py.entrypoints.serve import build_server, run
from xllm_py.formats.reasoning import PARSERS as REASONING_PARSERS
from xllm_py.formats.tool_parser import PARSERS as TOOL_CALL_PARSERS
from xllm_py.processes import ProcessOptions, cluster_options

__all__ = ["build_parser", "build_server", "check", "main", "run"]


def build_parser():
    """The `xllm` command line; parse_args returns EngineArgs."""
    return _build_parser(
        "xllm",
        __doc__.split("\n\n")[0].rstrip(".")
        + ". Serves /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.",
        {"reasoning": list(REASONING_PARSERS), "tool_call": list(TOOL_CALL_PARSERS)},
    )


def check(a: EngineArgs) -> None:
    """Every check the flags get before anything starts (ValueError naming the flag)."""
    a.check()
    if a.is_cluster:
        check_cluster_args(a)


def run_worker(a: EngineArgs) -> int:
    """Nodes 1..N-1: a worker only (no HTTP)."""
    from xllm_py.cluster.worker_node import run_worker_node

    ProcessOptions.from_args(a, threads=True).apply()
    config = a.engine_config()
    opts = cluster_options(a, config)
    return run_worker_node(opts, config, a.host, a.port, a.shutdown_timeout)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from xllm_py.cluster.grpc_executor import WorkerFailedError

    try:
        check(args)
        if args.launcher == "ray":
            from xllm_py.cluster.ray_launch import launch

            return launch(args)
        if args.nnodes > 1 and args.node_rank > 0:
            return run_worker(args)
        if args.pd_role == "router":
            from xllm_py.pd.router import run_router

            args.pd_config()  # checks the PD flags (ValueError)
            return run_router(args)
        server, engine = build_server(args)
    except (ValueError, FileNotFoundError) as e:  # configuration errors: one line, exit 2
        print(f"xllm: error: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, WorkerFailedError) as e:  # a cluster that could not start
        print(f"xllm: error: {e}", file=sys.stderr)
        return 1
    return run(server, engine)


if __name__ == "__main__":
    sys.exit(main())
