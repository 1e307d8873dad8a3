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

Exit status: 0 after a clean shutdown (SIGTERM/SIGINT on the master, or on a cluster
worker, which asks the master to do the same: /health and new requests answer 503 while
in-flight requests get --shutdown_timeout seconds to finish; the rest are aborted with
an error naming the timeout);
1 when the engine failed (in-flight requests get an error first); 2 for bad flags or
unreadable token or certificate files.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

from xllm_py.entrypoints.reasoning import PARSERS as REASONING_PARSERS
from xllm_py.entrypoints.tool_parser import PARSERS as TOOL_CALL_PARSERS

DEFAULT_PORT = 8000
FAILURE_EXIT_DELAY_S = 2.0
SHUTDOWN_FLUSH_S = 5.0
logger = logging.getLogger("xllm")


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xllm",
        description=__doc__.split("\n\n")[0]
        + ". Serves /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("command", nargs="?", default="serve", choices=["serve"], help="what to run")

    def flag(name, **kw):
        p.add_argument(f"--{name}", **kw)

    def boolean(name, default, help):
        flag(
            name, type=parse_bool, nargs="?", const=True, default=default, metavar="BOOL", help=help
        )

    g = "model and devices: "
    flag(
        "model",
        default=None,
        help=g + "checkpoint directory (config.json, safetensors, "
        "tokenizer); default: the bundled tiny DeepSeek-V3 + MTP model",
    )
    flag(
        "served_model_name",
        default=None,
        help="the model name clients send and /v1/models lists; default: the directory name",
    )
    flag(
        "devices",
        default="cpu",
        help="device of this process: cpu, cuda:N or npu:N (one device per process)",
    )
    flag(
        "dtype",
        default="auto",
        help="float32, bfloat16 or float16; auto = bfloat16 on accelerators, float32 on CPU",
    )
    flag(
        "weight_dtype",
        default="auto",
        help="how an FP8 checkpoint's weights are held: fp8 (resident with their block "
        "scales; block-scaled FP8 GEMM on CUDA where available, else dequantised per matmul), "
        "bf16 or float32 (dequantised at load; must equal --dtype); auto = fp8 where the "
        "device has a block-scaled FP8 GEMM and graph mode is off, else dequantised at load",
    )
    boolean("enable_mla", True, "use MLA attention (required: DeepSeek-V3 has only MLA)")

    flag("host", default="127.0.0.1", help="address the HTTP server binds to")
    flag("port", type=int, default=DEFAULT_PORT, help="HTTP port of the OpenAI-compatible API")
    flag(
        "api_key",
        default=os.environ.get("XLLM_API_KEY"),
        help="if set, /v1/* requires 'Authorization: Bearer KEY' (env XLLM_API_KEY)",
    )
    flag(
        "max_concurrent_requests",
        type=int,
        default=256,
        help="HTTP requests in flight before new ones get 429",
    )
    flag("max_request_body_bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    flag(
        "strict_request_fields",
        type=parse_bool,
        default=False,
        help="true: a request field this server does not declare is a 400; false (default): "
        "fields neither OpenAI nor vLLM defines are ignored with one warning per name "
        "(docs/api_fields.md lists every field)",
    )
    flag(
        "reasoning_parser",
        default="",
        choices=["", *REASONING_PARSERS],
        help="deepseek_r1: chat answers carry the model's <think>...</think> text as "
        "message.reasoning_content (delta.reasoning_content when streaming), the rest as "
        "content; default: off (the thinking stays in content)",
    )
    flag(
        "tool_call_parser",
        default="",
        choices=["", *TOOL_CALL_PARSERS],
        help="deepseek_v3: chat requests may carry tools; the model's tool-call tokens come back "
        "as OpenAI tool_calls (streamed as id and name, then argument fragments) with "
        'finish_reason "tool_calls"; tool_choice "required" or a named function is enforced '
        "by a grammar; default: off (tools other than with tool_choice none are a 400)",
    )
    boolean(
        "enable_auto_tool_choice",
        False,
        'with --tool_call_parser: allow tool_choice "auto" (the default when a request gives '
        "tools), where the model decides whether to call",
    )
    flag(
        "grammar_compile_timeout",
        type=float,
        default=10.0,
        help="seconds a structured-output grammar (JSON schema, regex, ...) the server has not "
        "seen before may take to compile; a longer one is a 400 naming the field. Compiles run "
        "off the event loop, one at a time, so a slow one never holds up other requests",
    )
    flag(
        "grammar_cache_bytes",
        type=int,
        default=256 << 20,
        help="bytes of compiled structured-output grammars kept per process; the least "
        "recently used are evicted beyond it (a grammar evicted is compiled again when next "
        "asked for)",
    )
    flag(
        "stream_stall_timeout",
        type=float,
        default=300.0,
        help="seconds a streaming client may go without reading while its request has output "
        "waiting; then the request is aborted and its memory freed",
    )
    boolean(
        "enable_test_hooks",
        False,
        "arm the fault-injection hook (env XLLM_FAULT_INJECT) for fault-isolation tests; "
        "never on a production server: a prompt carrying the marker fails requests or the engine",
    )
    flag(
        "shutdown_timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may take before they are aborted (on a "
        "cluster worker: SIGTERM drains the whole cluster, and the worker waits this long "
        "plus 15 s for the master to shut it down)",
    )

    flag(
        "draft_model",
        default=None,
        help="checkpoint holding the MTP layer (e.g. from tools/export_deepseek_mtp.py); "
        "default: the MTP layer inside --model",
    )
    flag("draft_devices", default=None, help="device of the draft; must equal --devices")
    flag(
        "num_speculative_tokens",
        type=int,
        default=0,
        help="MTP draft tokens per step (0 = speculative decoding off)",
    )
    flag(
        "speculative_disable_batch_size",
        type=int,
        default=0,
        help="above this many running requests, decode without drafts (0 = never; "
        "not with --speculative_adaptive, which decides this from measured step costs)",
    )
    boolean(
        "speculative_adaptive",
        False,
        "choose the drafts per step (0 .. --num_speculative_tokens) from the running "
        "acceptance per draft position and the step costs measured at the current batch "
        "size, for the most tokens per second (metric xllm:spec_decode_adaptive_k)",
    )
    flag(
        "speculative_draft_vocab_size",
        type=int,
        default=0,
        help="draft from the N most frequent target tokens only (a cheaper draft head; "
        "verification still uses the whole vocabulary, so outputs are unchanged); needs a "
        "token map (tools/build_draft_vocab.py). 0 = the whole vocabulary",
    )
    flag(
        "speculative_token_map",
        default=None,
        help="the token map for --speculative_draft_vocab_size (default: "
        "draft_vocab.safetensors in the --draft_model or --model directory)",
    )

    flag("block_size", type=int, default=128, help="tokens per KV cache block")
    flag(
        "max_memory_utilization",
        type=float,
        default=0.9,
        help="on a GPU/NPU: the fraction of the device's total memory this process may use; "
        "what is in use after loading the weights and the activation peak of a profiling forward "
        "of the largest step (--max_tokens_per_batch tokens) are taken off, and the rest holds "
        "the KV cache (the split is logged at start-up). "
        "On CPU: the fraction of the RAM still available after loading that the KV cache may "
        "take. Ignored when --max_cache_size is set",
    )
    flag(
        "max_cache_size",
        type=int,
        default=0,
        help="KV cache size in bytes (0 = derive from --max_memory_utilization)",
    )
    flag("max_tokens_per_batch", type=int, default=8192, help="tokens per engine step")
    flag("max_seqs_per_batch", type=int, default=256, help="requests per engine step")
    flag(
        "max_model_len",
        type=int,
        default=0,
        help="context length limit (0 = the model's max_position_embeddings)",
    )
    boolean("enable_prefix_cache", True, "reuse KV blocks of shared prompt prefixes")
    boolean("enable_chunked_prefill", True, "split long prompts across steps")
    flag("seed", type=int, default=0, help="seed of the sampler's default generator")
    boolean(
        "enable_graph",
        False,
        "graph mode: run decode, draft-verification and MTP drafting steps as compiled "
        "fixed-shape graphs (torch.compile/Inductor; every rank of a TP/EP replica, "
        "all-reduces inside the graphs; compiles every bucket at start-up)",
    )
    flag(
        "graph_batch_sizes",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="with --enable_graph: batch sizes compiled; a step is padded to the smallest "
        "that holds it, larger steps run eager",
    )
    flag(
        "cpu_threads",
        type=int,
        default=0,
        help="torch threads on --devices=cpu; 0 = one fewer than the cores (at least 1), so "
        "the HTTP loop keeps a core: on 2 cores, 2 threads made decode 1.8x slower",
    )

    g = "cluster (one process per device; node 0 serves HTTP, nodes 1..N-1 only a worker): "
    flag(
        "master_node_addr",
        default=None,
        help=g + "host:port of node 0's coordination service (needed when --nnodes > 1); "
        "a worker node's own gRPC service listens on its --host:--port",
    )
    flag(
        "launcher",
        default="process",
        choices=["process", "ray"],
        help=g + "process: this process is node --node_rank (start one per device, e.g. with "
        "scripts/launch_cluster.sh); ray: start all --nnodes nodes on a Ray cluster, one "
        "placement-group bundle each, node 0 on this host (pip install 'xllm_py[ray]')",
    )
    flag(
        "ray_address",
        default="auto",
        help=g + "with --launcher=ray: the Ray cluster (host:port); auto = this host's, else "
        "a local one started for the run; local = always a new local one",
    )
    flag(
        "ray_cpus_per_node",
        type=int,
        default=1,
        help=g + "with --launcher=ray and --devices=cpu: CPUs each node's bundle reserves",
    )
    flag("nnodes", type=int, default=1, help=g + "number of processes (one device each)")
    flag("node_rank", type=int, default=0, help=g + "this process's rank (0 = master)")
    flag("ep_size", type=int, default=1, help=g + "expert-parallel size (1 for now)")
    flag(
        "dp_size",
        type=int,
        default=1,
        help=g + "data-parallel replicas; nnodes / dp_size ranks per replica (1 for now)",
    )
    flag(
        "cluster_timeout",
        type=float,
        default=120.0,
        help=g + "seconds the master waits for every worker to register (and a worker for the "
        "master to answer)",
    )
    flag(
        "heartbeat_timeout",
        type=float,
        default=5.0,
        help=g + "a worker silent to the master's health checks for this long is dead (the "
        "engine fails); a worker that hears nothing from the master for this long exits 1",
    )
    flag(
        "step_timeout",
        type=float,
        default=300.0,
        help=g + "deadline of one engine step on a remote worker",
    )
    flag(
        "process_group_timeout",
        type=float,
        default=600.0,
        help=g + "torch.distributed timeout, the same on every rank: joining the process "
        "groups, and a collective waiting for a rank (graph compilation included)",
    )
    flag(
        "cluster_token_file",
        default=None,
        help=g + "file holding the shared secret every cluster RPC must carry (the same on "
        "every node; preferred over --cluster_token, which `ps` shows). Without a token, "
        "anyone who can reach the gRPC ports can join or drive the cluster",
    )
    flag(
        "cluster_token",
        default=None,
        help=g + "the shared secret itself (visible in `ps`: prefer --cluster_token_file or "
        "the environment variable XLLM_CLUSTER_TOKEN, read when neither flag is given)",
    )
    flag(
        "cluster_tls_cert",
        default=None,
        help=g + "PEM certificate of this node: every gRPC service and channel uses TLS; it "
        "must name the address the other nodes dial (--master_node_addr's host, a worker's "
        "--host). Needs --cluster_tls_key",
    )
    flag("cluster_tls_key", default=None, help=g + "PEM private key of --cluster_tls_cert")
    flag(
        "cluster_tls_ca",
        default=None,
        help=g + "PEM CA certificate(s): mutual TLS, every node verifies its peers against "
        "it and presents its own certificate (without it: no client certificates, and "
        "servers are verified against the system's roots)",
    )
    flag(
        "log_level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging level",
    )
    return p


def check_args(a: argparse.Namespace) -> None:
    """One line naming the flag for every combination that cannot run."""

    def bad(msg: str) -> None:
        raise ValueError(msg)

    if not a.enable_mla:
        bad("--enable_mla=false: DeepSeek-V3 models use MLA attention; it must be true")
    if "," in a.devices:
        bad(f"--devices={a.devices}: one device per process (start one process per device)")
    if a.draft_devices is not None and a.draft_devices != a.devices:
        bad(f"--draft_devices={a.draft_devices} must equal --devices={a.devices}")
    if a.num_speculative_tokens < 0:
        bad(f"--num_speculative_tokens={a.num_speculative_tokens}: must be >= 0")
    if a.cpu_threads < 0:
        bad(f"--cpu_threads={a.cpu_threads}: must be >= 0 (0 = automatic)")
    if not a.grammar_compile_timeout > 0:
        bad(f"--grammar_compile_timeout={a.grammar_compile_timeout}: must be > 0 seconds")
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        bad("--enable_auto_tool_choice needs --tool_call_parser (deepseek_v3) to read the calls")
    if not 0 < a.port < 65536:
        bad(f"--port={a.port}: must be in 1..65535")
    for name in (
        "max_concurrent_requests",
        "max_request_body_bytes",
        "block_size",
        "max_tokens_per_batch",
        "max_seqs_per_batch",
        "nnodes",
        "ep_size",
        "dp_size",
    ):
        if getattr(a, name) < 1:
            bad(f"--{name}={getattr(a, name)}: must be >= 1")
    if not 0 <= a.node_rank < a.nnodes:
        bad(f"--node_rank={a.node_rank}: must be in 0..nnodes-1 (--nnodes={a.nnodes})")
    if a.launcher == "ray" and a.node_rank != 0:
        bad(f"--node_rank={a.node_rank}: --launcher=ray starts every node itself")
    if a.ray_cpus_per_node < 1:
        bad(f"--ray_cpus_per_node={a.ray_cpus_per_node}: must be >= 1")
    if a.nnodes > 1 and not a.master_node_addr and a.launcher != "ray":
        bad(f"--nnodes={a.nnodes}: --master_node_addr=host:port of node 0 is required")
    if a.nnodes > 1 or a.ep_size > 1 or a.dp_size > 1:
        cluster_options(a)  # the layout itself (divisibility, ep_size)
        from xllm_py.cluster.security import check_flags

        check_flags(*_security_flags(a))  # their files are read at start-up


def _security_flags(a: argparse.Namespace) -> tuple:
    return (
        a.cluster_token,
        a.cluster_token_file,
        a.cluster_tls_cert,
        a.cluster_tls_key,
        a.cluster_tls_ca,
    )


def cluster_options(a: argparse.Namespace, read_secrets: bool = False):
    """The cluster flags as ClusterOptions (ValueError naming the flag if inconsistent);
    with `read_secrets`, also the token and TLS files (read now)."""
    from xllm_py.cluster.layout import ClusterLayout, ClusterOptions
    from xllm_py.cluster.security import INSECURE, load_security

    return ClusterOptions(
        ClusterLayout(a.nnodes, a.dp_size, a.ep_size),
        a.node_rank,
        a.master_node_addr or "127.0.0.1:1",
        a.cluster_timeout,
        a.heartbeat_timeout,
        a.step_timeout,
        a.process_group_timeout,
        load_security(*_security_flags(a)) if read_secrets else INSECURE,
    )


def set_cpu_threads(a: argparse.Namespace) -> None:
    """--cpu_threads, or: one process, cores - 1 (the HTTP loop keeps one); a cluster of
    nnodes processes on one machine, cores // nnodes each."""
    if not a.devices.startswith("cpu"):
        return
    import torch

    cores = os.cpu_count() or 1
    auto = max(1, cores // a.nnodes) if a.nnodes > 1 else max(1, cores - 1)
    torch.set_num_threads(a.cpu_threads or auto)


def build_config(a: argparse.Namespace):
    """The engine config; in a cluster, also checks the model splits over the layout."""
    from xllm_py.assets import bundled_model
    from xllm_py.entrypoints.llm import engine_config

    config = engine_config(
        a.model or bundled_model(),
        device=a.devices,
        dtype=a.dtype,
        block_size=a.block_size,
        max_memory_utilization=a.max_memory_utilization,
        max_cache_size=a.max_cache_size,
        enable_prefix_cache=a.enable_prefix_cache,
        enable_chunked_prefill=a.enable_chunked_prefill,
        max_tokens_per_batch=a.max_tokens_per_batch,
        max_seqs_per_batch=a.max_seqs_per_batch,
        max_model_len=a.max_model_len,
        seed=a.seed,
        enable_graph=a.enable_graph,
        graph_batch_sizes=a.graph_batch_sizes,
        weight_dtype=a.weight_dtype,
        num_speculative_tokens=a.num_speculative_tokens,
        draft_model=a.draft_model,
        speculative_disable_batch_size=a.speculative_disable_batch_size,
        speculative_adaptive=a.speculative_adaptive,
        draft_device=a.draft_devices,
        speculative_draft_vocab_size=a.speculative_draft_vocab_size,
        speculative_token_map=a.speculative_token_map,
    )
    if a.nnodes > 1:
        cluster_options(a).layout.check_model(config.model)
    return config


def build_core(a: argparse.Namespace, config, on_worker_drain=lambda why: None):
    """The engine core: None (LLMEngine builds a one-node core), or on the master of a
    cluster, the data-parallel core once every worker has registered and loaded.
    on_worker_drain(why): a worker got SIGTERM (called from the health monitor's thread)."""
    if a.nnodes == 1:
        return None
    from xllm_py.cluster.master import Cluster

    cluster = Cluster(cluster_options(a, read_secrets=True), config, on_worker_drain)
    try:
        return cluster.start()
    except BaseException as e:
        cluster.shutdown(f"the master failed to start: {e}", failure=True)
        raise


def run_worker(a: argparse.Namespace) -> int:
    """Nodes 1..N-1: a worker only (no HTTP)."""
    from xllm_py.cluster.worker_node import run_worker_node

    set_cpu_threads(a)
    opts = cluster_options(a, read_secrets=True)
    return run_worker_node(opts, build_config(a), a.host, a.port, a.shutdown_timeout)


def build_server(a: argparse.Namespace):
    """The daemon, not yet running: (uvicorn server, AsyncEngine). `run` starts it; setting
    `server.should_exit` stops it as SIGTERM would."""
    import uvicorn

    from xllm_py.engine.llm_engine import LLMEngine
    from xllm_py.entrypoints.api_server import ServerOptions, build_app
    from xllm_py.entrypoints.async_engine import AsyncEngine
    from xllm_py.entrypoints.server_metrics import ServerMetrics

    set_cpu_threads(a)
    config = build_config(a)
    model = config.model.path
    name = a.served_model_name or os.path.basename(os.path.normpath(str(model)))
    worker_drains: list[str] = []  # appended by the health monitor, read by on_tick
    engine = AsyncEngine(LLMEngine(config, build_core(a, config, worker_drains.append)))
    metrics = ServerMetrics(name)
    metrics.attach(engine)
    app = build_app(
        engine,
        ServerOptions(
            name,
            a.api_key,
            a.max_concurrent_requests,
            a.max_request_body_bytes,
            a.strict_request_fields,
            a.reasoning_parser,
            a.tool_call_parser,
            a.enable_auto_tool_choice,
            a.grammar_compile_timeout,
            a.stream_stall_timeout,
        ),
        metrics,
    )

    api = app.state.server

    class Server(uvicorn.Server):
        """SIGTERM/SIGINT drains: the port stays open, /health and new requests answer 503,
        in-flight requests run until they end or --shutdown_timeout passes; the rest are
        then aborted with an error naming the timeout, and uvicorn shuts down. A second
        signal ends the drain at once, a third is uvicorn's own (SIGINT: force exit).
        A cluster worker's SIGTERM (reported by its health checks) starts the same drain;
        afterwards `run` shuts the workers down cleanly."""

        drain_deadline: float | None = None
        drain_logged = False

        def begin_drain(self) -> None:
            engine.draining = True  # /health turns 503 while in-flight requests finish
            self.drain_deadline = time.monotonic() + a.shutdown_timeout

        def handle_exit(self, sig, frame) -> None:
            if self.drain_deadline is None:
                self.begin_drain()
            elif not self.should_exit:
                self.drain_deadline = 0.0
            else:
                super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after shutting down (exit status -15); a drained
            # shutdown is a clean one here, so the process exits 0 instead.
            getattr(self, "_captured_signals", []).clear()

        async def on_tick(self, counter: int) -> bool:
            if worker_drains and self.drain_deadline is None:
                logger.warning("%s: draining the cluster", worker_drains[0])
                self.begin_drain()
            if self.drain_deadline is not None and not self.should_exit:
                self._drain()
            return await super().on_tick(counter)

        def _drain(self) -> None:
            if not self.drain_logged:
                self.drain_logged = True
                logger.info(
                    "shutting down: %d request(s) in flight get up to --shutdown_timeout=%g s",
                    api.in_flight,
                    a.shutdown_timeout,
                )
            if api.in_flight == 0:
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline:
                n = engine.abort_all(
                    f"request aborted: the server is shutting down and it did not finish "
                    f"within --shutdown_timeout={a.shutdown_timeout:g} s"
                )
                logger.warning("--shutdown_timeout passed: aborted %d request(s)", n)
                self.should_exit = True

    server = Server(
        uvicorn.Config(
            app,
            host=a.host,
            port=a.port,
            log_level=a.log_level,
            # after the drain: time for the last responses (and aborts' errors) to go out
            timeout_graceful_shutdown=SHUTDOWN_FLUSH_S,
            access_log=a.log_level == "debug",
        )
    )

    def on_failure(error: BaseException) -> None:
        # /health answers 503 for a moment (probes see why), then the process exits 1.
        logger.error("engine failed (%s); exiting in %.0f s", error, FAILURE_EXIT_DELAY_S)
        threading.Timer(FAILURE_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True)).start()

    engine.on_failure = on_failure
    spec = f", MTP k={a.num_speculative_tokens}" if a.num_speculative_tokens else ""
    if a.speculative_adaptive:
        spec = f", MTP adaptive k<={a.num_speculative_tokens}"
    logger.info("serving %s (%s%s) at http://%s:%d/v1", name, model, spec, a.host, a.port)
    return server, engine


def run(server, engine) -> int:
    """Serve until SIGTERM/SIGINT, `server.should_exit` or an engine failure; the exit code."""
    import asyncio

    engine.start()
    try:
        asyncio.run(server.serve())
    finally:
        engine.draining = True
        engine.shutdown()
        # a cluster's workers exit with the master: non-zero after a failure
        reason = f"the master's engine failed: {engine.dead}" if engine.dead else "master exiting"
        engine.engine.core.shutdown(reason, failure=engine.dead is not None)
    if engine.dead is not None:
        return 1
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from xllm_py.cluster.grpc_executor import WorkerFailedError

    try:
        check_args(args)
        if args.launcher == "ray":
            from xllm_py.cluster.ray_launch import launch

            return launch(args, sys.argv[1:] if argv is None else list(argv))
        if args.nnodes > 1 and args.node_rank > 0:
            return run_worker(args)
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
