"""Every option of the engine and the `xllm` daemon, each declared once.

An `EngineArgs` field carries the option's default, its help text, the concern it belongs
to (its heading in `xllm --help`), its check, and whether the offline `LLM(...)` takes it:

    EngineArgs field --build_parser()--> `xllm` flags, grouped by concern
                     --EngineArgs.for_offline(**kw)--> what LLM(**kw) takes
                     --.engine_config()--> EngineConfig (ModelConfig, CacheConfig, ...)
    and, read from these fields by the layers that use them: ClusterOptions
    (cluster/layout.py), ProcessOptions (processes.py), ServerOptions (entrypoints/serve.py)

This module only declares: it imports no runtime package (tests/test_layering.py).
`check()` runs each field's own check and then the combinations that cannot run (one
ValueError naming the flags; LLM runs only `check_fields()`; a cluster node's layout and
security flags are checked by cluster/layout.py's `check_args`, which `xllm` runs next).
The frozen config dataclasses (config.py) still check their own invariants in
`__post_init__` when `engine_config()` builds them; a field's check here is the front
line, worded as the flag, for what must fail before anything loads (and for the options
no config holds).

Secrets (`--api_key`, `--cluster_token`) can also come from the environment, which is
preferred: a command line is visible to every user of the host (`ps`). They are never
shown in `--help`, in `repr(args)` or in `node_argv()`; `secret_env()` hands them to a
child process through its environment instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from xllm_py.config import ATTENTION_BACKENDS, MOE_BACKENDS

GROUPS = {  # concern -> heading of its flags in --help, in this order
    "model": "model and devices",
    "speculative": "speculative decoding (MTP)",
    "cache": "KV cache",
    "scheduler": "scheduler (continuous batching)",
    "server": "HTTP server",
    "structured": "structured outputs, reasoning and tool calls",
    "cluster": "cluster (one process per device; node 0 serves HTTP, nodes 1..N-1 only a worker)",
    "pd": "prefill/decode disaggregation (in progress: docs/pd.md)",
    "security": "secrets and TLS (prefer the environment or files: `ps` shows a command line)",
    "logging": "logging and test hooks",
}
ALIASES = {"device": "devices", "draft_device": "draft_devices"}  # LLM's older keywords


def option(default: Any, group: str, help: str, *, check=None, offline: bool = True, **kw):
    """One option. check(value) -> None, or what is wrong ("must be >= 1"); offline: LLM
    takes it; kw: choices, nargs, env (a variable read when the flag is not given: the
    value is then a secret, never shown)."""
    meta = dict(group=group, help=help, check=check, offline=offline, **kw)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, repr="env" not in kw, metadata=meta)


def _confidence(value: str) -> str | float | None:
    """--speculative_confidence as the engine takes it: "auto", None (off) or a threshold."""
    if value in ("auto", "off"):
        return None if value == "off" else "auto"
    try:
        threshold = float(value)
    except ValueError:
        return None
    return threshold if 0 < threshold < 1 else None


def _draft_vocab(value: str | int) -> int | None | str:
    """--speculative_draft_vocab_size as the engine takes it: None ("auto") or N >= 0;
    "bad" for anything else."""
    if value == "auto":
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        return "bad"
    return size if size >= 0 and str(size) == str(value).strip() else "bad"


def at_least(low: int, note: str = ""):
    return lambda v: None if v >= low else f"must be >= {low}{note}"


def positive(unit: str = ""):
    return lambda v: None if v > 0 else f"must be > 0{unit}"


def show(value: Any) -> str:
    """A value as the flag would be written."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


@dataclass
class EngineArgs:
    # ---- model and devices
    model: str | None = option(None, "model", "checkpoint directory (config.json, safetensors, "
        "tokenizer); default: the bundled tiny DeepSeek-V3 + MTP model")  # fmt: skip
    served_model_name: str | None = option(None, "model", "the model name clients send and "
        "/v1/models lists; default: the directory name", offline=False)  # fmt: skip
    devices: str = option("cpu", "model", "device of this process: cpu, cuda:N or npu:N (one "
        "device per process; LLM also takes it as device=)",
        check=lambda v: "one device per process (start one process per device)" if "," in v
        else None)  # fmt: skip
    dtype: str = option("auto", "model", "float32, bfloat16 or float16; auto = bfloat16 on "
        "accelerators, float32 on CPU")  # fmt: skip
    weight_dtype: str = option("auto", "model", "how a quantised checkpoint's weights are "
        "held: fp8 (FP8 checkpoints: resident with their block scales; block-scaled FP8 GEMM "
        "on CUDA where available, else dequantised per matmul), int4 (INT4 pack-quantized "
        "routed experts, Kimi-K2-Thinking's: kept packed with their group scales, about 0.28 "
        "of their bf16 bytes, unpacked per matmul), fp4 (DeepSeek-V4's FP4 routed experts: "
        "kept packed, about 0.27 of their bf16 bytes, unpacked per matmul), bf16 or float32 "
        "(dequantised at load; must equal --dtype); auto = fp8 where the device has a "
        "block-scaled FP8 GEMM, int4 on CUDA (both with graph mode off), else dequantised "
        "at load (DeepSeek-V4's weights always)")  # fmt: skip
    attention_backend: str = option("auto", "model", "MLA attention kernel: torch (block-"
        "wise over the paged cache), triton (the Triton paged-MLA kernel, in place, split-KV), "
        "flashinfer or flashmla (named, adapters not written yet). auto = triton on CUDA (and "
        "on NPU with triton-ascend), torch on CPU; triton on CPU needs TRITON_INTERPRET=1 (a "
        "correctness check, very slow)", choices=list(ATTENTION_BACKENDS))  # fmt: skip
    moe_backend: str = option("auto", "model", "routed-expert kernel: torch (grouped loop "
        "over the active experts) or triton (fused MoE: sorted on the device, grouped GEMMs, "
        "bf16, block FP8, packed INT4 or FP4). auto = triton on CUDA (and on NPU with "
        "triton-ascend), torch on CPU", choices=list(MOE_BACKENDS))  # fmt: skip
    enable_mla: bool = option(True, "model", "use MLA attention (required: DeepSeek-V3 has only "
        "MLA)", check=lambda v: None if v else "DeepSeek-V3 models use MLA attention; it must "
        "be true")  # fmt: skip
    seed: int = option(0, "model", "seed of the sampler's default generator")
    enable_graph: bool | None = option(None, "model", "graph mode: run decode, draft-"
        "verification and MTP drafting steps as compiled fixed-shape graphs (torch.compile/"
        "Inductor; every rank of a TP/EP replica, all-reduces inside the graphs). Unset (auto): "
        "on where it was measured to pay, a one-node daemon on CPU in float32; off on CUDA "
        "and in bfloat16 (not measured to pay yet), on NPU (not supported) and in the "
        "offline LLM")  # fmt: skip
    graph_warm_up: str = option("background", "model", "with graph mode, when the graphs "
        "compile. background: the server answers at once, steps run eager and each compiled "
        "bucket is used as soon as it is ready (the log says when all are); startup: compile "
        "every bucket before serving (the offline LLM's default). A tensor-parallel replica's "
        "ranks compile together at start-up either way",
        choices=["background", "startup"])  # fmt: skip
    compile_cache_dir: str = option("~/.cache/xllm_py/inductor", "model",
        "Inductor's on-disk cache of compiled graphs (TORCHINDUCTOR_CACHE_DIR; a variable "
        "set in the environment is kept when this flag is not given): a restart with the "
        "same model and options loads its graphs from here")  # fmt: skip
    graph_batch_sizes: list[int] = option([1, 2, 4, 8], "model", "with --enable_graph: batch "
        "sizes compiled; a step is padded to the smallest that holds it, larger steps run "
        "eager", nargs="+")  # fmt: skip
    cpu_threads: int = option(0, "model", "torch threads on --devices=cpu; 0 = one fewer than "
        "the cores (at least 1), so the HTTP loop keeps a core: on 2 cores, 2 threads made "
        "decode 1.8x slower (LLM leaves torch's threads to its caller)",
        check=at_least(0, " (0 = automatic)"), offline=False)  # fmt: skip

    # ---- speculative decoding
    draft_model: str | None = option(None, "speculative", "checkpoint holding the MTP layer "
        "(e.g. from tools/export_deepseek_mtp.py); default: the MTP layer inside "
        "--model")  # fmt: skip
    draft_devices: str | None = option(None, "speculative", "device of the draft; must equal "
        "--devices (LLM also takes it as draft_device=)")  # fmt: skip
    num_speculative_tokens: int = option(0, "speculative", "MTP draft tokens per step (0 = "
        "speculative decoding off)", check=at_least(0))  # fmt: skip
    speculative_disable_batch_size: int = option(0, "speculative", "above this many running "
        "requests, decode without drafts (0 = never; not with --speculative_adaptive, which "
        "decides this from measured step costs)")  # fmt: skip
    speculative_adaptive: bool = option(False, "speculative", "choose the drafts per step (0 .. "
        "--num_speculative_tokens) from the running acceptance per draft position and the step "
        "costs measured at the current batch size, for the most tokens per second (metric "
        "xllm:spec_decode_adaptive_k)")  # fmt: skip
    speculative_draft_vocab_size: str = option("auto", "speculative", "draft from the N most "
        "frequent target tokens only (a cheaper draft head; verification still uses the whole "
        "vocabulary, so outputs are unchanged); needs a token map (tools/build_draft_vocab.py). "
        "0 = the whole vocabulary; 'auto' = the fewest hot tokens that cover 99.5 percent of the "
        "token map's counts, at least 512, when the model ships a map (the bundled models: 512 "
        "of 8208), else the whole vocabulary", check=lambda v: None if _draft_vocab(v) != "bad" else
        "expected 'auto' or an integer >= 0")  # fmt: skip
    speculative_draft_sampling: str = option("sampled", "speculative", "how a sampled "
        "request (temperature > 0) drafts: 'sampled' draws each draft from the draft's "
        "distribution after the request's own processing (kept with probability 1 - TV(p, q); "
        "a seeded request races on its own noise and emits what it would without drafts), "
        "'greedy' takes the draft's argmax (kept with probability p(d)); greedy requests "
        "always draft greedily; outputs are exact either way",
        choices=["sampled", "greedy"])  # fmt: skip
    speculative_confidence: str = option("auto", "speculative", "confidence-scheduled draft "
        "length, per request and step: a request stops verifying its drafts once the "
        "estimated chance that its whole run so far is accepted (the top probability of each "
        "draft's distribution, calibrated by the measured acceptance per position; never the "
        "drawn token's own, which would bias sampled output) falls below this threshold; "
        "'auto' picks the threshold per step from load and the measured step costs, and "
        "skips drafting altogether at batch sizes where steps measure faster without it; "
        "'off' drafts --num_speculative_tokens every step; a number in (0, 1) fixes the "
        "threshold",
        check=lambda v: None if _confidence(v) is not None or v == "off" else
        "expected 'auto', 'off' or a number in (0, 1)")  # fmt: skip
    report_speculative_usage: bool = option(True, "speculative", "add usage.speculative "
        "{draft_tokens, accepted_tokens} of each request to its answer (extra keys the "
        "OpenAI clients keep)", offline=False)  # fmt: skip
    speculative_token_map: str | None = option(None, "speculative", "the token map for "
        "--speculative_draft_vocab_size (default: draft_vocab.safetensors in the --draft_model "
        "or --model directory)")  # fmt: skip

    # ---- KV cache
    block_size: int = option(128, "cache", "tokens per KV cache block", check=at_least(1))
    max_memory_utilization: float = option(0.9, "cache", "on a GPU/NPU: the fraction of the "
        "device's total memory this process may use; what is in use after loading the weights "
        "and the activation peak of a profiling forward of the largest step "
        "(--max_tokens_per_batch tokens) are taken off, and the rest holds the KV cache (the "
        "split is logged at start-up). On CPU: the fraction of the RAM still available after "
        "loading that the KV cache may take. Ignored when --max_cache_size is set")  # fmt: skip
    max_cache_size: int = option(0, "cache", "KV cache size in bytes (0 = derive from "
        "--max_memory_utilization)")  # fmt: skip
    enable_prefix_cache: bool = option(True, "cache", "reuse KV blocks of shared prompt prefixes")

    # ---- scheduler
    max_tokens_per_batch: int = option(8192, "scheduler", "tokens per engine step",
        check=at_least(1))  # fmt: skip
    max_seqs_per_batch: int = option(256, "scheduler", "requests per engine step",
        check=at_least(1))  # fmt: skip
    max_model_len: int = option(0, "scheduler", "context length limit (0 = the model's "
        "max_position_embeddings)")  # fmt: skip
    enable_chunked_prefill: bool = option(True, "scheduler", "split long prompts across steps")

    # ---- HTTP server
    host: str = option("127.0.0.1", "server", "address the HTTP server binds to (a cluster "
        "worker: its gRPC service)", offline=False)  # fmt: skip
    port: int = option(8000, "server", "HTTP port of the OpenAI-compatible API (a cluster "
        "worker: of its gRPC service)", offline=False,
        check=lambda v: None if 0 < v < 65536 else "must be in 1..65535")  # fmt: skip
    max_concurrent_requests: int = option(256, "server", "HTTP requests in flight before new "
        "ones get 429", check=at_least(1), offline=False)  # fmt: skip
    max_request_body_bytes: int = option(1 << 20, "server", "larger request bodies get 413",
        check=at_least(1), offline=False)  # fmt: skip
    strict_request_fields: bool = option(False, "server", "true: a request field this server "
        "does not declare is a 400; false (default): fields neither OpenAI nor vLLM defines are "
        "ignored with one warning per name (docs/api_fields.md lists every field)",
        offline=False)  # fmt: skip
    stream_stall_timeout: float = option(300.0, "server", "seconds a streaming client may go "
        "without reading while its request has output waiting; then the request is aborted and "
        "its memory freed", check=positive(" seconds"), offline=False)  # fmt: skip
    responses_store_max: int = option(1000, "server", "responses /v1/responses keeps (store: "
        "true) for previous_response_id and GET /v1/responses/{id}, each with its conversation "
        "(at most a context's worth of text); the oldest go first; 0 keeps none",
        check=at_least(0), offline=False)  # fmt: skip
    responses_store_ttl: float = option(3600.0, "server", "seconds a stored response is kept "
        "after it was made", check=positive(" seconds"), offline=False)  # fmt: skip
    http_keep_alive_timeout: float = option(65.0, "server", "seconds an idle HTTP "
        "connection is kept open for its next request; longer than the clients' own idle "
        "expiry (httpx and the openai client: 5 s), so a client never sends on a connection "
        "the server is closing", check=positive(" seconds"), offline=False)  # fmt: skip
    shutdown_timeout: float = option(30.0, "server", "on SIGTERM, seconds in-flight requests may "
        "take before they are aborted (on a cluster worker: SIGTERM drains the whole cluster, "
        "and the worker waits this long plus 15 s for the master to shut it down)",
        check=at_least(0), offline=False)  # fmt: skip

    engine_core_process: bool = option(True, "server", "run the engine core (scheduler, "
        "executor, model) in a process of its own, so tokenising, detokenising and streaming "
        "never share a GIL with the step; false: on a thread of the HTTP process",
        offline=False)  # fmt: skip

    # ---- structured outputs, reasoning and tool calls
    chat_template: str = option("auto", "structured", "how chat messages become the prompt: "
        "auto (the checkpoint's chat template; for a checkpoint whose config.json model_type "
        "is deepseek_v32 or deepseek_v4 and that ships none, that model's encoding), "
        "deepseek_v32 (DeepSeek-V3.2's encoding_dsv32 rules, which have no Jinja template) or "
        "deepseek_v4 (DeepSeek-V4's encoding_dsv4 rules: tool results as user turns, the "
        "tool_calls DSML section); thinking mode when chat_template_kwargs set thinking or "
        "enable_thinking true (V4: reasoning_effort max adds its instruction)",
        choices=["auto", "deepseek_v32", "deepseek_v4"], offline=False,
        check=lambda v: None if v in ("auto", "deepseek_v32", "deepseek_v4") else "must be "
        "auto, deepseek_v32 or deepseek_v4")  # fmt: skip
    reasoning_parser: str = option("", "structured", "chat answers carry the model's "
        "<think>...</think> text as message.reasoning_content (delta.reasoning_content when "
        "streaming), the rest as content. deepseek_r1: every answer thinks; deepseek_v3 "
        "(DeepSeek-V3.1's and V3.2's hybrid thinking): only requests whose "
        "chat_template_kwargs set thinking (or enable_thinking) true, other answers are all "
        "content; kimi_k2 (Kimi-K2-Thinking): unless thinking (or enable_thinking) is false, "
        "and the thinking also ends where a section of tool calls begins; default: off (the "
        "thinking stays in content)", offline=False, registry="reasoning")  # fmt: skip
    tool_call_parser: str = option("", "structured", "the model's tool-call format: "
        "deepseek_v3 (DeepSeek-V3, R1), deepseek_v31 (DeepSeek-V3.1: NAME<sep>JSON, no fence), "
        "kimi_k2 (Kimi-K2: functions.NAME:IDX, which is the tool_call id), deepseek_v32 "
        "(DeepSeek-V3.2's DSML: XML-ish parameters, read into JSON arguments) or deepseek_v4 "
        "(DeepSeek-V4's DSML, its section named tool_calls). Chat requests "
        "may carry tools; the model's tool-call tokens come back as OpenAI tool_calls "
        '(streamed as id and name, then argument fragments) with finish_reason "tool_calls"; '
        'tool_choice "required" or a named function is enforced by a grammar; default: off '
        "(tools other than with tool_choice none are a 400)", offline=False,
        registry="tool_call")  # fmt: skip
    enable_auto_tool_choice: bool = option(False, "structured", 'with --tool_call_parser: allow '
        'tool_choice "auto" (the default when a request gives tools), where the model decides '
        "whether to call", offline=False)  # fmt: skip
    grammar_compile_timeout: float = option(10.0, "structured", "seconds a structured-output "
        "grammar (JSON schema, regex, ...) the server has not seen before may take to compile; a "
        "longer one is a 400 naming the field, and its compile process is killed and restarted. "
        "Compiles run off the event loop, one at a time: a new schema waits at most for one "
        "other compile's timeout; grammars already compiled never wait",
        check=positive(" seconds"),
        offline=False)  # fmt: skip
    grammar_cache_bytes: int = option(256 << 20, "structured", "bytes of compiled "
        "structured-output grammars kept per process; the least recently used are evicted "
        "beyond it (a grammar evicted is compiled again when next asked for)",
        check=at_least(0))  # fmt: skip

    # ---- cluster
    master_node_addr: str | None = option(None, "cluster", "host:port of node 0's coordination "
        "service (needed when --nnodes > 1); a worker node's own gRPC service listens on its "
        "--host:--port", offline=False)  # fmt: skip
    launcher: str = option("process", "cluster", "process: this process is node --node_rank "
        "(start one per device, e.g. with scripts/launch_cluster.sh); ray: start all --nnodes "
        "nodes on a Ray cluster, one placement-group bundle each, node 0 on this host (pip "
        "install 'xllm_py[ray]')", choices=["process", "ray"], offline=False)  # fmt: skip
    ray_address: str = option("auto", "cluster", "with --launcher=ray: the Ray cluster "
        "(host:port); auto = this host's, else a local one started for the run; local = always "
        "a new local one", offline=False)  # fmt: skip
    ray_cpus_per_node: int = option(1, "cluster", "with --launcher=ray and --devices=cpu: CPUs "
        "each node's bundle reserves", check=at_least(1), offline=False)  # fmt: skip
    nnodes: int = option(1, "cluster", "number of processes (one device each)",
        check=at_least(1), offline=False)  # fmt: skip
    node_rank: int = option(0, "cluster", "this process's rank (0 = master)", offline=False)
    ep_size: int = option(1, "cluster", "expert-parallel size: 1 = every routed expert is split "
        "over the ranks of a replica like the dense MLP; nnodes / dp_size = each rank of a "
        "replica holds n_routed_experts / ep_size whole experts", check=at_least(1),
        offline=False)  # fmt: skip
    dp_size: int = option(1, "cluster", "data-parallel replicas of the model, each of nnodes / "
        "dp_size ranks (tensor parallel inside a replica); the master schedules requests over "
        "them", check=at_least(1), offline=False)  # fmt: skip
    enable_dp_attention: bool = option(False, "cluster", "DP attention (SGLang's name; vLLM: "
        "--data-parallel-size with --enable-expert-parallel): each of the nnodes ranks runs "
        "attention and the dense layers whole for its own requests, with its own KV cache, "
        "and the routed experts are spread over all ranks, tokens sent to their experts' "
        "ranks by all-to-all; needs --dp_size=--ep_size=--nnodes", offline=False)  # fmt: skip
    cluster_timeout: float = option(120.0, "cluster", "seconds the master waits for every worker "
        "to register (and a worker for the master to answer)", offline=False)  # fmt: skip
    heartbeat_timeout: float = option(5.0, "cluster", "a worker silent to the master's health "
        "checks for this long is dead (the engine fails); a worker that hears nothing from the "
        "master for this long exits 1", offline=False)  # fmt: skip
    step_timeout: float = option(300.0, "cluster", "deadline of one engine step on a remote "
        "worker", offline=False)  # fmt: skip
    process_group_timeout: float = option(600.0, "cluster", "torch.distributed timeout, the same "
        "on every rank: joining the process groups, and a collective waiting for a rank (graph "
        "compilation included)", offline=False)  # fmt: skip

    # ---- prefill/decode disaggregation (docs/pd.md)
    pd_role: str = option("both", "pd", "both = prefill and decode (no disaggregation); "
        "prefill = compute prompts for decode instances and write their KV blocks into them "
        "(Mooncake's transfer engine); decode = have each prompt's full blocks prefilled by "
        "--pd_prefill; router = no model: forward each API request to the least loaded live "
        "decode instance of --pd_decode", choices=["both", "prefill", "decode", "router"],
        offline=False)  # fmt: skip
    pd_prefill: list[str] = option([], "pd", "with --pd_role=decode or router: the prefill "
        "instances' URLs (http://host:port); a decode instance asks the one it has fewest "
        "prompts out with, and leaves one that failed alone for a while", nargs="+",
        offline=False)  # fmt: skip
    pd_decode: list[str] = option([], "pd", "with --pd_role=router: the decode instances' URLs "
        "(http://host:port)", nargs="+", offline=False)  # fmt: skip
    pd_health_interval: float = option(2.0, "pd", "seconds between the router's /health checks "
        "of each instance; one that fails a check, or a connection, gets no new requests until "
        "it passes one", offline=False)  # fmt: skip
    pd_transfer_host: str = option("127.0.0.1", "pd", "the address this instance's transfer "
        "engine listens on: a trusted-network data plane, as NCCL's is", offline=False)  # fmt: skip
    pd_transfer_timeout: float = option(30.0, "pd", "seconds a decode instance waits for one "
        "prompt's blocks; a transfer that fails or takes longer is recomputed here",
        offline=False)  # fmt: skip
    pd_on_transfer_failure: str = option("recompute", "pd", "what a decode instance does with a "
        "request whose prompt's blocks did not arrive (a failed, refused or late transfer): "
        "recompute = compute the prompt here; error = fail the request, naming why",
        choices=["recompute", "error"], offline=False)  # fmt: skip

    # ---- secrets and TLS
    api_key: str | None = option(None, "security", "if set, /v1/* requires 'Authorization: "
        "Bearer KEY'; prefer the environment variable XLLM_API_KEY, read when the flag is not "
        "given (a command line shows in `ps`)", env="XLLM_API_KEY", offline=False)  # fmt: skip
    cluster_token_file: str | None = option(None, "security", "file holding the shared secret "
        "every cluster RPC must carry (the same on every node; preferred over --cluster_token). "
        "Without a token, anyone who can reach the gRPC ports can join or drive the cluster",
        offline=False)  # fmt: skip
    cluster_token: str | None = option(None, "security", "the shared secret itself (visible in "
        "`ps`: prefer --cluster_token_file or the environment variable XLLM_CLUSTER_TOKEN, read "
        "when neither flag is given)", env="XLLM_CLUSTER_TOKEN", offline=False)  # fmt: skip
    cluster_tls_cert: str | None = option(None, "security", "PEM certificate of this node: every "
        "gRPC service and channel uses TLS, and a PD instance serves HTTPS (the router and "
        "other instances dial it so); it must name the address the others dial "
        "(--master_node_addr's host, a worker's --host). Needs --cluster_tls_key",
        offline=False)  # fmt: skip
    cluster_tls_key: str | None = option(None, "security", "PEM private key of --cluster_tls_cert",
        offline=False)  # fmt: skip
    cluster_tls_ca: str | None = option(None, "security", "PEM CA certificate(s): mutual TLS, "
        "every node verifies its peers against it and presents its own certificate (without "
        "it: no client certificates, and servers are verified against the system's roots)",
        offline=False)  # fmt: skip

    # ---- logging and test hooks
    log_level: str = option("info", "logging", "logging level",
        choices=["debug", "info", "warning", "error"], offline=False)  # fmt: skip
    enable_test_hooks: bool = option(False, "logging", "arm the fault-injection hook (env "
        "XLLM_FAULT_INJECT, engine/faults.py) for fault-isolation tests; never on a production "
        "server: a prompt carrying the marker fails requests or the engine")  # fmt: skip

    # ---- building from the offline API ---------------------------------------------------

    @classmethod
    def for_offline(cls, **kwargs: Any) -> EngineArgs:
        """The options of LLM(**kwargs), checked. Only the engine's options are taken: the
        HTTP server's, the cluster's, the secrets and logging are refused (TypeError)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        given = {ALIASES.get(k, k): v for k, v in kwargs.items()}
        for name in given:
            if name not in fields:
                raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
            if not fields[name].metadata["offline"]:
                raise TypeError(
                    f"LLM({name}=...): --{name} is an option of the `xllm` daemon "
                    f"({GROUPS[fields[name].metadata['group']]}), not of the offline engine"
                )
        # Offline, graph mode is asked for, and then compiled before the first request.
        given.setdefault("enable_graph", False)
        given.setdefault("graph_warm_up", "startup")
        args = cls(**given)
        args.check_fields()
        return args

    # ---- checks ------------------------------------------------------------------------------

    def check_fields(self) -> None:
        """Each option's own check: ValueError naming the flag and the value."""
        for f in dataclasses.fields(self):
            check, value = f.metadata["check"], getattr(self, f.name)
            if check is not None and (why := check(value)) is not None:
                raise ValueError(f"--{f.name}={show(value)}: {why}")

    def check(self) -> None:
        """Every option, then every combination that cannot run (one line naming the
        flags)."""
        self.check_fields()
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(
                "--enable_auto_tool_choice needs a --tool_call_parser (the model's tool-call "
                "format) to read the calls"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node_rank={self.node_rank}: must be in 0..nnodes-1 (--nnodes={self.nnodes})"
            )
        if self.launcher == "ray" and self.node_rank != 0:
            raise ValueError(
                f"--node_rank={self.node_rank}: --launcher=ray starts every node itself"
            )
        if self.nnodes > 1 and not self.master_node_addr and self.launcher != "ray":
            raise ValueError(
                f"--nnodes={self.nnodes}: --master_node_addr=host:port of node 0 is required"
            )

    # ---- what the options build -------------------------------------------------------------

    @property
    def is_cluster(self) -> bool:
        return self.nnodes > 1 or self.ep_size > 1 or self.dp_size > 1 or self.enable_dp_attention

    @property
    def graph_mode(self) -> bool:
        """--enable_graph, or where it is unset, whether graph mode pays here: measured on
        CPU in float32 (one node; decode 2.66 vs 3.69 ms per step on the bundled model)."""
        if self.enable_graph is not None:
            return self.enable_graph
        on_cpu = self.devices.startswith("cpu") and self.dtype in ("auto", "float32")
        return on_cpu and not self.is_cluster and self.weight_dtype not in ("fp8", "int4", "fp4")

    def engine_config(self):
        """The layered EngineConfig (each part checks itself; a cluster checks that the
        model splits over its layout when it starts)."""
        from xllm_py.assets import bundled_model
        from xllm_py.config import (
            CacheConfig,
            DeviceConfig,
            EngineConfig,
            ModelConfig,
            SchedulerConfig,
        )

        model = ModelConfig.from_pretrained(self.model or bundled_model())
        # graph mode where it pays and was not asked for: only for models it can run
        graph = self.graph_mode and (self.enable_graph is not None or model.graphable)
        config = EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                max_memory_utilization=self.max_memory_utilization,
                max_cache_size=self.max_cache_size,
                enable_prefix_cache=self.enable_prefix_cache,
            ),
            scheduler=SchedulerConfig(
                max_tokens_per_batch=self.max_tokens_per_batch,
                max_seqs_per_batch=self.max_seqs_per_batch,
                enable_chunked_prefill=self.enable_chunked_prefill,
                max_model_len=self.max_model_len,
            ),
            device=DeviceConfig(
                device=self.devices,
                dtype=self.dtype,
                seed=self.seed,
                enable_graph=graph,
                graph_warm_up=self.graph_warm_up,
                graph_batch_sizes=tuple(self.graph_batch_sizes),
                weight_dtype=self.weight_dtype,
                attention_backend=self.attention_backend,
                moe_backend=self.moe_backend,
            ),
            spec=self._spec_config(),
            pd=self.pd_config(),
        )
        return config

    def pd_config(self):
        """The PD flags as a PDConfig (no credentials: pd/compat.py's credentials adds them)."""
        from xllm_py.config import PDConfig

        return PDConfig(
            role=self.pd_role,
            prefill_urls=tuple(self.pd_prefill),
            decode_urls=tuple(self.pd_decode),
            transfer_host=self.pd_transfer_host,
            transfer_timeout=self.pd_transfer_timeout,
            on_transfer_failure=self.pd_on_transfer_failure,
            health_interval=self.pd_health_interval,
        )

    def _spec_config(self):
        from xllm_py.config import SpecConfig

        return SpecConfig(
            num_speculative_tokens=self.num_speculative_tokens,
            draft_model=self.draft_model,
            speculative_disable_batch_size=self.speculative_disable_batch_size,
            adaptive=self.speculative_adaptive,
            draft_device=self.draft_devices,
            draft_vocab_size=_draft_vocab(self.speculative_draft_vocab_size),
            token_map=self.speculative_token_map,
            draft_sampling=self.speculative_draft_sampling,
            confidence=_confidence(self.speculative_confidence),
        )

    def secret(self, name: str) -> str | None:
        """A secret option: the flag's value, else its environment variable's."""
        value = getattr(self, name)
        if value is None:
            value = os.environ.get(_FIELDS[name].metadata["env"]) or None
        return value

    def secret_env(self) -> dict[str, str]:
        """Every secret that is set, as the environment variables a child process reads."""
        out = {}
        for name, f in _FIELDS.items():
            if "env" in f.metadata and (value := self.secret(name)) is not None:
                out[f.metadata["env"]] = value
        return out

    def node_argv(self) -> list[str]:
        """These options as a command line (only those not at their default), less the
        secrets: what a child process started with `secret_env()` needs."""
        out = []
        for name, f in _FIELDS.items():
            value = getattr(self, name)
            if "env" in f.metadata or value == _default(f):
                continue
            if isinstance(value, list):
                out += [f"--{name}", *map(str, value)]
            else:
                out.append(f"--{name}={show(value)}")
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


# ---- the command line ------------------------------------------------------------------------


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


class ArgsParser(argparse.ArgumentParser):
    """parse_args returns EngineArgs (not yet checked: `check()`)."""

    def parse_args(self, args=None, namespace=None) -> EngineArgs:  # type: ignore[override]
        ns = vars(super().parse_args(args, namespace))
        return EngineArgs(**{k: v for k, v in ns.items() if k in _FIELDS})


def build_parser(
    prog: str = "xllm", description: str = "", registries: dict[str, list[str]] | None = None
) -> ArgsParser:
    """The command line of EngineArgs: one flag per field, under its concern's heading.
    registries: the choices of the options that name an implementation ("reasoning",
    "tool_call": the parsers the entry points register)."""
    p = ArgsParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("command", nargs="?", default="serve", choices=["serve"], help="what to run")
    groups = {key: p.add_argument_group(title) for key, title in GROUPS.items()}
    hints = typing.get_type_hints(EngineArgs)
    for name, f in _FIELDS.items():
        kw = _flag_kwargs(f, hints[name], (registries or {}).get(f.metadata.get("registry")))
        groups[f.metadata["group"]].add_argument(f"--{name}", **kw)
    return p


def _flag_kwargs(f: dataclasses.Field, hint: Any, registry: list[str] | None) -> dict:
    meta = f.metadata
    kw: dict[str, Any] = {"default": _default(f), "help": meta["help"]}
    if typing.get_origin(hint) is list:
        base = list
    else:  # X | None: X
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    if base is bool:
        kw.update(type=parse_bool, nargs="?", const=True, metavar="BOOL")
    elif base is list:
        kw.update(type=typing.get_args(hint)[0], nargs=meta["nargs"])
    else:
        kw["type"] = base
    if "choices" in meta:
        kw["choices"] = meta["choices"]
    if registry is not None:
        kw["choices"] = ["", *registry]
    if "env" in meta:  # a secret: never shown, the variable is read at use (EngineArgs.secret)
        kw["default"] = None
        kw["metavar"] = "SECRET"
    return kw
