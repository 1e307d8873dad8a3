"""Master + workers over gRPC: the wire format, a 2-node data-parallel cluster of real
`python -m xllm_py` processes on loopback, registration refusals, a worker killed
mid-stream, and a master whose worker never comes.

Each cluster started here costs both cores about 10 s (three processes import torch and
load the model), and each can end only once: a test that ends one (SIGTERM, a kill, a
frozen rank) also checks, before that end, what a cluster of its layout serves."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest
import torch

from tests.server_utils import HTTP, ROOT, free_port, free_port_range, spec_totals, wait_healthy
from xllm_py import LLM, SamplingParams
from xllm_py.cluster import cluster_pb2 as pb
from xllm_py.cluster.health import POLL_INTERVAL_S
from xllm_py.cluster.layout import ClusterLayout
from xllm_py.cluster.wire import (
    output_from_pb,
    output_to_pb,
    sampling_from_pb,
    sampling_to_pb,
    sched_from_pb,
    sched_to_pb,
)
from xllm_py.entrypoints.llm import engine_config
from xllm_py.executor.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)
from xllm_py.formats.tool_parser import tool_call_grammar
from xllm_py.sampling_params import StructuredOutput
from xllm_py.sharegpt import held_out_user_turns

MODEL = "tiny-deepseek-v3-mtp"
PROMPTS = [  # 32 held-out ShareGPT first turns, in the bundled model's chat format
    f"<|bos|><|user|>\n{q}\n<|assistant|>\n" for q in held_out_user_turns(32, 20, 600)
]
MAX_TOKENS = 24
# What a cluster must answer exactly as one node does: 8 of the prompts at once (both
# replicas of a data-parallel cluster get some), MAX_TOKENS each.
GREEDY_PROMPTS = PROMPTS[:8]
# Each node's KV cache: 128 blocks of 128 tokens (with MTP; more without), room for the 32
# prompts at once or 8 streams of 1,500 tokens. Left to the engine, every node (and the
# offline reference) would zero room for 256 full-length requests, 1.8 GB, at each start.
KV_BLOCK_BYTES = 9 * 128 * 96 * 4  # layers (8 target + 1 MTP) x block_size x kv dim x fp32
CACHE_BYTES = 128 * KV_BLOCK_BYTES
CACHE = f"--max_cache_size={CACHE_BYTES}"
# The product's promise: a node that dies is noticed within --heartbeat_timeout seconds.
# Measured from the kill, the tests allow on top of it: the master's health checks come
# every POLL_INTERVAL_S with a deadline of as much (a verdict up to two polls after the
# timeout), and 5 s for a loaded machine to react (the worker's own 0.5 s check and 1 s
# gRPC grace, process teardown, thread scheduling on 2 shared cores).
HEARTBEAT_TIMEOUT_S = 3.0
DETECTION_MARGIN_S = 2 * POLL_INTERVAL_S + 5.0


# ---- (a) the wire format ----------------------------------------------------------------------


def test_sampling_params_round_trip():
    for sp in (
        SamplingParams(),
        SamplingParams(
            max_tokens=None,
            min_tokens=3,
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            min_p=0.05,
            seed=-12345678901,
            stop=["\n\n", "END"],
            stop_token_ids=[1, 2],
            ignore_eos=True,
            logprobs=0,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
        ),
        SamplingParams(temperature=0, seed=0, logprobs=None),
        SamplingParams(max_tokens=0, prompt_logprobs=0),  # 0s are values, not "unset"
        SamplingParams(prompt_logprobs=5),
        SamplingParams(structured=StructuredOutput("json", '{"type": "object"}', strict=False)),
        SamplingParams(structured=StructuredOutput("json_object")),
        # tool_choice "required": a structural tag, DeepSeek's tool tokens and all
        SamplingParams(
            structured=StructuredOutput(
                "structural_tag", tool_call_grammar([{"function": {"name": "f"}}], None, True)
            )
        ),
    ):
        assert sampling_from_pb(sampling_to_pb(sp)) == sp


def test_scheduler_output_round_trip():
    sched = SchedulerOutput(
        new_requests=[
            NewRequestData("b", [5, 6, 7], 2, SamplingParams(seed=3, logprobs=2), [4, 1], 0),
            NewRequestData("a", [9], 1, SamplingParams(temperature=0), [], 0),
        ],
        cached_requests=[CachedRequestData("c", [11, 12], [], 40)],
        num_scheduled_tokens={"c": 3, "b": 3, "a": 1},  # scheduling order, not sorted
        spec_token_ids={"c": [12, 13]},
        finished_req_ids={"x", "y"},
        num_draft_tokens=0,  # adaptive speculation's k; 0 is a value, not "unset"
    )
    back = sched_from_pb(pb.ExecuteStepRequest.FromString(sched_to_pb(sched).SerializeToString()))
    assert back == sched
    assert list(back.num_scheduled_tokens) == ["c", "b", "a"]
    assert sched_from_pb(sched_to_pb(SchedulerOutput())) == SchedulerOutput()


def test_model_runner_output_round_trip():
    out = ModelRunnerOutput(
        req_ids=["c", "b", "a"],
        sampled_token_ids=[[12, 40], [], [7]],
        # the chosen token first, then the top N (its order is meaningful)
        logprobs=[[{40: -0.25, 3: -1.5}, {12: -2.0, 40: -0.1}], None, [{7: -float("inf")}]],
        draft_token_ids=[[41], [], [8]],
        draft_scores=[[0.625], [], [0.03125]],  # what the confidence policy calibrates
        # a prompt chunk scored from position 3: each token's logprob, then the top N
        prompt_logprobs=[None, PromptLogprobs(3, [{5: -1.0, 9: -0.5}, {6: -3.0}], [2, 70]), None],
    )
    back = output_from_pb(pb.ExecuteStepReply.FromString(output_to_pb(out).SerializeToString()))
    assert back == out
    assert list(back.prompt_logprobs[1].logprobs[0]) == [5, 9]
    assert [list(d) for d in back.logprobs[0]] == [[40, 3], [12, 40]]
    plain = ModelRunnerOutput(["a"], [[1]], [None])  # speculation off: no drafts at all
    assert output_from_pb(output_to_pb(plain)) == plain
    assert output_from_pb(output_to_pb(ModelRunnerOutput([], [], [], []))).draft_token_ids == []


def test_layout_errors_name_the_numbers():
    with pytest.raises(ValueError, match="--nnodes=3 is not divisible by --dp_size=2"):
        ClusterLayout(3, 2)
    with pytest.raises(ValueError, match="--ep_size=2: must be 1 or the ranks per replica"):
        ClusterLayout(2, 2, 2)
    model = engine_config().model  # the bundled model's: 4 heads, 8 routed experts
    with pytest.raises(ValueError, match="num_attention_heads=4 .* not divisible by the 3 ranks"):
        ClusterLayout(3, 1).check_model(model)
    six_heads = types.SimpleNamespace(num_attention_heads=6, n_routed_experts=8, path="m")
    with pytest.raises(ValueError, match="n_routed_experts=8 .* not divisible by --ep_size=3"):
        ClusterLayout(3, 1, 3).check_model(six_heads)
    assert ClusterLayout(4, 2).ranks_of(1) == [2, 3]
    with pytest.raises(ValueError, match="--enable_dp_attention needs --dp_size and --ep_size"):
        ClusterLayout(2, 1, 2, dp_attention=True)  # TP inside a DP rank: not implemented
    assert ClusterLayout(4, 4, 4, dp_attention=True).to_pb().dp_attention


def test_cli_refuses_bad_cluster_flags():
    def err(*flags):
        r = subprocess.run(
            [sys.executable, "-m", "xllm_py", *flags], cwd=ROOT, capture_output=True, text=True
        )
        assert r.returncode == 2, r.stderr
        return r.stderr

    assert "--node_rank=2: must be in 0..nnodes-1" in err("--nnodes=2", "--node_rank=2")
    assert "--master_node_addr" in err("--nnodes=2", "--dp_size=2")
    assert "--process_group_timeout=0.0: must be > 0" in err(
        "--nnodes=2", "--master_node_addr=127.0.0.1:1", "--process_group_timeout=0"
    )
    assert "not divisible by --dp_size=2" in err(
        "--nnodes=3", "--dp_size=2", "--master_node_addr=127.0.0.1:1"
    )
    assert "num_attention_heads=4" in err("--nnodes=3", "--master_node_addr=127.0.0.1:1")
    dpa = ("--nnodes=2", "--master_node_addr=127.0.0.1:1", "--enable_dp_attention")
    assert "--enable_dp_attention needs --dp_size and --ep_size equal to --nnodes" in err(*dpa)


# ---- real processes -----------------------------------------------------------------------------


class Node:
    """One `python -m xllm_py` process of a cluster, its output in a log file."""

    def __init__(self, name: str, *flags: str) -> None:
        self.log_path = Path(f"/tmp/xllm-test-cluster-{name}-{os.getpid()}.log")
        self.log = open(self.log_path, "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xllm_py", *flags],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Cluster:
    """Master (node 0, HTTP on `url`) and one worker, as a test would start them by hand."""

    def __init__(
        self,
        *flags: str,
        worker_flags: tuple[str, ...] = (),
        worker: bool = True,
        layout: tuple[str, ...] = ("--dp_size=2",),
    ):
        self.http, self.worker_port = free_port(), free_port()
        self.master_port = free_port_range(2)  # + 1: the torch.distributed rendezvous
        self.url = f"http://127.0.0.1:{self.http}"
        common = ("--nnodes=2", *layout, f"--master_node_addr=127.0.0.1:{self.master_port}")
        self.master = Node("master", f"--port={self.http}", "--node_rank=0", *common, *flags)
        self.worker = None
        if worker:
            self.worker = Node(
                "worker",
                f"--port={self.worker_port}",
                "--node_rank=1",
                *common,
                *flags,
                *worker_flags,
            )

    def wait_healthy(self, timeout: float = 120.0) -> None:
        def gone() -> str | None:
            m = self.master
            return None if m.proc.poll() is None else f"master exited:\n{m.output()}"

        if not wait_healthy(self.url, gone, timeout):
            raise RuntimeError(f"cluster did not come up:\n{self.master.output()}")

    def kill(self) -> None:
        for node in (self.master, self.worker):
            if node is not None:
                node.kill()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def offline_answers(prompts: list[str], cache_bytes: int = CACHE_BYTES) -> list[str]:
    """The offline API's greedy answers (MAX_TOKENS each) on one node, with one torch
    thread, as a node of a 2-node cluster on 2 cores has: two threads beside other busy
    processes spin-wait for each other (8 prompts: 13 s of CPU instead of 1 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(dtype="float32", max_cache_size=cache_bytes)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    finally:
        torch.set_num_threads(threads)
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def offline_greedy():
    return offline_answers(GREEDY_PROMPTS)


def completion(url: str, prompt: str) -> dict:
    r = HTTP.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()


def complete(url: str, prompt: str) -> str:
    return completion(url, prompt)["choices"][0]["text"]


def replica_steps(cluster: Cluster) -> int:
    """ExecuteStep calls the worker (replica 1) has served, from its Health RPC."""
    import grpc

    from xllm_py.cluster import cluster_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{cluster.worker_port}") as ch:
        return pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=5).steps


LAYOUTS = {
    "dp": ("--dp_size=2",),  # two full replicas
    "tp": ("--dp_size=1",),  # one replica over two ranks: heads and expert columns split
    "ep": ("--dp_size=1", "--ep_size=2"),  # experts partitioned between the two ranks
    # DP attention: each rank its own requests and KV, the experts partitioned, all-to-all
    "dpa": ("--dp_size=2", "--ep_size=2", "--enable_dp_attention=true"),
}


def assert_serves_as_one_node(c: Cluster, k: int, offline_greedy: list[str]) -> None:
    """The GREEDY_PROMPTS at once: every output is the offline API's; the worker served
    steps (as replica 1, or as rank 1 of the one replica); with MTP (k drafts), each
    answer's usage.speculative (from whichever replica served it) adds up to the merged
    /metrics; without, no answer has one (no drafts on the wire)."""
    with concurrent.futures.ThreadPoolExecutor(len(GREEDY_PROMPTS)) as pool:
        got = list(pool.map(lambda p: completion(c.url, p), GREEDY_PROMPTS))
    assert [g["choices"][0]["text"] for g in got] == offline_greedy
    spec = [g["usage"].get("speculative") for g in got]
    if k:
        drafts, accepted, finished, _ = spec_totals(c.url)
        assert sum(s["draft_tokens"] for s in spec) == drafts > 0
        assert sum(s["accepted_tokens"] for s in spec) == accepted
        assert finished == sum(s["draft_tokens"] > 0 for s in spec)
    else:
        assert spec == [None] * len(GREEDY_PROMPTS)
    assert replica_steps(c) > 0, "the worker served no step"


def assert_sigterm_stops_both(c: Cluster) -> None:
    """SIGTERM on the master stops the worker too, both exit 0."""
    c.master.proc.send_signal(signal.SIGTERM)
    assert c.master.wait(60) == 0
    assert c.worker.wait(30) == 0, c.worker.output()


# Every layout with MTP: "dp", "ep" and "dpa" here, "tp" in
# test_replica_allocates_the_smallest_capacity_its_ranks_measured; plain decoding in "dp"
# and "dpa": test_worker_killed_mid_stream_fails_every_client.
@pytest.mark.parametrize(
    "layout, k",
    [("dp", 1), ("ep", 1), ("dpa", 2)],
    ids=["mtp-dp", "mtp-ep", "mtp2-dp-attention"],
)
def test_two_node_greedy_equals_one_node(layout, k, offline_greedy):
    """assert_serves_as_one_node, then assert_sigterm_stops_both."""
    flags = ("--dtype=float32", CACHE, f"--num_speculative_tokens={k}")
    with Cluster(*flags, layout=LAYOUTS[layout]) as c:
        c.wait_healthy()
        assert_serves_as_one_node(c, k, offline_greedy)
        assert_sigterm_stops_both(c)


@pytest.mark.slow  # both ranks compile 3 graphs: 2-4 minutes of a 2-core machine
def test_two_node_graph_mode_equals_one_node(offline_greedy):
    """Graph mode on both ranks of a TP replica with partitioned experts (the "ep" layout:
    all-reduces of attention and MoE inside the graphs), MTP k = 1: the offline API's output."""
    # Compiling can keep a loaded 2-core machine's health-check threads from answering for
    # longer than the default 5 s heartbeat (CI: "silent for 5.5 s" mid-compile)
    flags = ("--dtype=float32", CACHE, "--num_speculative_tokens=1", "--enable_graph=true",
             "--heartbeat_timeout=60")  # fmt: skip
    with Cluster(*flags, "--graph_batch_sizes", "4", layout=LAYOUTS["ep"]) as c:
        # both ranks compile 3 graphs first: over 400 s on a loaded 2-core machine
        c.wait_healthy(timeout=900)
        with concurrent.futures.ThreadPoolExecutor(len(GREEDY_PROMPTS)) as pool:
            got = list(pool.map(lambda p: complete(c.url, p), GREEDY_PROMPTS))
        assert got == offline_greedy
        for node in (c.master, c.worker):
            assert "graph mode: 2 target graphs compiled" in node.output()
            assert "graph mode: 1 MTP layer 0 graphs compiled" in node.output()
        c.master.proc.send_signal(signal.SIGTERM)
        assert c.master.wait(60) == 0
        assert c.worker.wait(30) == 0, c.worker.output()


def test_worker_with_other_config_is_refused_then_the_master_times_out():
    """A worker with another --block_size is refused (exit 2, both logs say why); the
    master goes on waiting for a good node 1, and at --cluster_timeout exits 1 naming the
    rank that never registered."""
    # 20 s: a worker's start (imports, the registration call) takes a few seconds even on
    # a loaded machine, and the master idles out the rest of the timeout
    flags = ("--dtype=float32", CACHE, "--cluster_timeout=20")
    with Cluster(*flags, worker_flags=("--block_size=32",)) as c:
        assert c.worker.wait(60) == 2
        out = c.worker.output()
        assert "registration refused" in out and "block_size: master 128, worker 32" in out
        assert "block_size: master 128, worker 32" in c.master.output()
        assert c.master.proc.poll() is None  # still waiting for a good node 1
        assert c.master.wait(90) == 1
        assert "no worker registered for node rank(s) 1 within --cluster_timeout=20 s" in (
            c.master.output()
        )


def stream_until_error(url: str, prompt: str, started) -> tuple[list[dict], bool]:
    """SSE events of one streamed completion: (json events, saw [DONE]); `started()` is
    called at the first token."""
    events, done = [], False
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1500,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with HTTP.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            events.append(json.loads(data))
            if len(events) == 1:
                started()
    return events, done


def unhealthy(url: str) -> bool:
    """/health answers 503, or nothing answers any more (the master exited)."""
    try:
        return HTTP.get(url + "/health", timeout=5).status_code == 503
    except httpx.TransportError:
        return True


@pytest.mark.parametrize("layout", ["dp", "dpa"])
def test_worker_killed_mid_stream_fails_every_client(layout, offline_greedy):
    """Plain decoding first: assert_serves_as_one_node. Then eight whole streams (1500
    tokens: still running at the kill, by construction) over both replicas; the worker is
    killed: every client gets an error event and [DONE] within --heartbeat_timeout (+
    margin), /health is not 200, the master exits 1. With DP attention ("dpa") the
    master's own rank waits for the dead one in the experts' exchange."""
    flags = ("--dtype=float32", CACHE, f"--heartbeat_timeout={HEARTBEAT_TIMEOUT_S:g}")
    with Cluster(*flags, layout=LAYOUTS[layout]) as c:
        c.wait_healthy()
        assert_serves_as_one_node(c, 0, offline_greedy)
        started = concurrent.futures.Future()
        counter = []

        def on_first():
            counter.append(1)
            if len(counter) == 8 and not started.done():
                started.set_result(None)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(stream_until_error, c.url, p, on_first) for p in PROMPTS[:8]]
            started.result(60)  # every stream has its first token: both replicas are busy
            killed = time.monotonic()
            c.worker.proc.kill()
            concurrent.futures.wait(futs, timeout=120)  # guards against a hang only
            elapsed = time.monotonic() - killed
            results = [f.result(0) for f in futs]
        assert elapsed <= HEARTBEAT_TIMEOUT_S + DETECTION_MARGIN_S
        for events, done in results:
            assert "error" in events[-1], events[-1]
            assert done
        messages = [e[-1]["error"]["message"] for e, _ in results]
        assert any("worker rank 1" in m for m in messages), messages
        assert unhealthy(c.url)
        assert c.master.wait(60) == 1
        assert c.worker.proc.poll() is not None


@pytest.mark.parametrize("victim", ["worker", "master"])
def test_idle_node_killed_the_other_exits_nonzero(victim):
    """No request in flight: the master notices a dead worker by its health checks (503,
    exit 1); a worker notices a dead master by the silence (exit 1); either within
    --heartbeat_timeout (+ margin) of the kill."""
    with Cluster("--dtype=float32", CACHE, f"--heartbeat_timeout={HEARTBEAT_TIMEOUT_S:g}") as c:
        c.wait_healthy()
        killed = time.monotonic()
        if victim == "worker":
            c.worker.proc.kill()
            deadline = killed + 60  # guards against a hang only
            while not unhealthy(c.url):
                assert time.monotonic() < deadline, "the master never noticed"
                time.sleep(0.05)
            noticed = time.monotonic()
            assert c.master.wait(60) == 1
            assert "stopped answering health checks" in c.master.output()
        else:
            c.master.proc.kill()
            assert c.worker.wait(60) == 1
            noticed = time.monotonic()
            assert "no word from the master" in c.worker.output()
        assert noticed - killed <= HEARTBEAT_TIMEOUT_S + DETECTION_MARGIN_S


@pytest.mark.parametrize("layout", ["tp", "dpa"])
def test_rank_that_stops_participating_fails_the_cluster_within_the_heartbeat_timeout(layout):
    """Tensor parallel: the master's own rank waits in an all-reduce for the worker (DP
    attention: in an expert exchange). The worker is frozen (SIGSTOP) mid-stream, so that
    collective never completes; with a --process_group_timeout of 300 s, every client
    still gets its error within --heartbeat_timeout (+ margin): the master gives up on the
    hung step and aborts its process groups, and exits 1."""
    flags = (
        "--dtype=float32",
        CACHE,
        f"--heartbeat_timeout={HEARTBEAT_TIMEOUT_S:g}",
        "--process_group_timeout=300",
    )
    with Cluster(*flags, layout=LAYOUTS[layout]) as c:
        c.wait_healthy()
        started = concurrent.futures.Future()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            first = lambda: started.done() or started.set_result(None)  # noqa: E731
            futs = [pool.submit(stream_until_error, c.url, p, first) for p in PROMPTS[:4]]
            started.result(60)
            frozen = time.monotonic()
            c.worker.proc.send_signal(signal.SIGSTOP)
            concurrent.futures.wait(futs, timeout=120)  # guards against a hang only
            elapsed = time.monotonic() - frozen
            results = [f.result(0) for f in futs]
        assert elapsed <= HEARTBEAT_TIMEOUT_S + DETECTION_MARGIN_S, elapsed
        for events, done in results:
            assert "error" in events[-1], events[-1]
            assert done
        assert "aborting the process groups" in c.master.output()
        assert c.master.wait(60) == 1


def test_replica_allocates_the_smallest_capacity_its_ranks_measured(offline_greedy):
    """Two-phase start-up: each rank reports the KV blocks that fit after loading (here the
    worker is given a smaller --max_cache_size than the master), the replica allocates the
    minimum on both ranks and serves. The layout is "tp" with MTP: assert_serves_as_one_node
    (the GREEDY_PROMPTS fit in the 25 blocks at once), then assert_sigterm_stops_both."""
    per_block = KV_BLOCK_BYTES
    flags = ("--dtype=float32", "--num_speculative_tokens=1", f"--max_cache_size={40 * per_block}")
    worker = (f"--max_cache_size={25 * per_block}",)
    with Cluster(*flags, worker_flags=worker, layout=LAYOUTS["tp"]) as c:
        c.wait_healthy()
        assert "25 KV blocks fit after loading" in c.master.output()  # the worker's report
        for node in (c.master, c.worker):
            assert "KV cache: 25 blocks" in node.output(), node.output()
        assert_serves_as_one_node(c, 1, offline_greedy)
        assert_sigterm_stops_both(c)
