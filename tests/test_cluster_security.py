"""The cluster's control plane is authenticated, a worker obeys only its own master, TLS
serves a real cluster, a worker's SIGTERM drains the cluster cleanly, and the chat
template cannot reach Python internals.

In-process (fast): the token interceptor on both services, the worker's session check,
the flags' errors. Real `python -m xllm_py` processes: a 2-node tensor-parallel cluster
with a token (strangers and a second master are refused, then a worker's SIGTERM drains
it mid-stream) and a 2-node data-parallel cluster over mutual TLS with certificates made
here, whose output equals one node's."""

from __future__ import annotations

import concurrent.futures
import datetime
import ipaddress
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from tests.server_utils import ROOT, free_port, free_port_range
from tests.test_cluster import HTTP, MODEL, PROMPTS, Node, complete, wait_healthy
from xllm_py.cli import build_parser, check
from xllm_py.cluster import cluster_pb2 as pb
from xllm_py.cluster import cluster_pb2_grpc as pb_grpc
from xllm_py.cluster.coordinator import Coordinator, serve_coordinator
from xllm_py.cluster.layout import ClusterLayout, options_from_args
from xllm_py.cluster.ray_launch import node_argv
from xllm_py.cluster.security import (
    SESSION_KEY,
    ClusterSecurity,
    TlsFiles,
    load_security,
)
from xllm_py.cluster.worker_node import WorkerService, serve_worker

TOKEN = "s3cret-" + "ab" * 16
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED
MASTER_ONLY = ("InitModel", "AllocateCache", "ExecuteStep", "Shutdown")


# ---- calling every RPC ------------------------------------------------------------------


def worker_calls(stub: pb_grpc.WorkerStub) -> dict:
    """Every Worker RPC, with an empty (harmless) request."""
    return {
        "InitModel": lambda: stub.InitModel(pb.InitModelRequest(), timeout=10),
        "AllocateCache": lambda: stub.AllocateCache(pb.AllocateCacheRequest(), timeout=10),
        "Health": lambda: stub.Health(pb.HealthRequest(), timeout=10),
        "ExecuteStep": lambda: stub.ExecuteStep(pb.ExecuteStepRequest(), timeout=10),
        "Shutdown": lambda: stub.Shutdown(pb.ShutdownRequest(reason="intruder"), timeout=10),
    }


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def strangers(address: str) -> dict[str, grpc.Channel]:
    """Channels to `address` without the token and with a wrong one."""
    return {
        "no token": grpc.insecure_channel(address),
        "wrong token": ClusterSecurity(token=TOKEN[:-1] + "x").channel(address),
    }


def register_call(channel: grpc.Channel):
    """Register as node 1 through `channel` (a call to pass to code_of)."""
    request = pb.RegisterRequest(node_rank=1, address="127.0.0.1:1", layout=pb.Layout(nnodes=2))
    return lambda: pb_grpc.CoordinatorStub(channel).Register(request, timeout=10)


# ---- in-process: the token on both services, the worker's session ------------------------


@pytest.fixture
def worker_service():
    """A WorkerService (no model) behind the token, and its address."""
    service = WorkerService(None, 60.0)
    address = f"127.0.0.1:{free_port()}"
    server = serve_worker(service, address, "test", ClusterSecurity(token=TOKEN))
    yield service, address
    server.stop(0)


def test_every_rpc_without_the_token_is_unauthenticated_and_changes_nothing(worker_service):
    service, w_addr = worker_service
    coordinator = Coordinator(ClusterLayout(2, 2), pb.ModelFingerprint())
    registered = []
    coordinator.on_register = registered.append
    m_addr = f"127.0.0.1:{free_port()}"
    server = serve_coordinator(m_addr, coordinator, ClusterSecurity(token=TOKEN))
    contact = service.last_contact
    try:
        for who, channel in strangers(w_addr).items():
            for name, call in worker_calls(pb_grpc.WorkerStub(channel)).items():
                assert code_of(call) == UNAUTHENTICATED, (who, name)
        for who, channel in strangers(m_addr).items():
            assert code_of(register_call(channel)) == UNAUTHENTICATED, who
        # nothing changed: no contact, no step, no shutdown, no registration
        assert service.last_contact == contact and service.steps == 0
        assert not service.stopped.is_set() and service.session is None
        assert coordinator.members == {} and registered == []
        # the token opens the door (Health needs no session)
        with ClusterSecurity(token=TOKEN).channel(w_addr) as ch:
            assert pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=10).steps == 0
    finally:
        server.stop(0)


def test_a_worker_obeys_only_the_master_it_registered_with(worker_service):
    service, address = worker_service
    service.registered("session-of-the-master")
    contact = service.last_contact
    for session in ("", "session-of-another-master"):
        metadata = [(SESSION_KEY, session)] if session else []
        with ClusterSecurity(token=TOKEN).channel(address, metadata=metadata) as ch:
            calls = worker_calls(pb_grpc.WorkerStub(ch))
            for name in MASTER_ONLY:
                assert code_of(calls[name]) == PERMISSION_DENIED, (session, name)
            assert code_of(calls["Health"]) == grpc.StatusCode.OK  # answered, but no contact
    assert service.last_contact == contact and not service.stopped.is_set()
    master = [(SESSION_KEY, "session-of-the-master")]
    with ClusterSecurity(token=TOKEN).channel(address, metadata=master) as ch:
        calls = worker_calls(pb_grpc.WorkerStub(ch))
        assert code_of(calls["Health"]) == grpc.StatusCode.OK
        assert service.last_contact > contact  # the master's Health is contact
        assert code_of(calls["Shutdown"]) == grpc.StatusCode.OK
    assert service.stopped.is_set() and service.exit_code == 0


def test_the_masters_first_call_may_overtake_its_register_reply(worker_service):
    """The master calls the worker as soon as it recorded the registration; the worker
    waits for the session in its RegisterReply instead of refusing its own master."""
    service, address = worker_service
    waiting = threading.Event()  # set once the early call waits for the session
    from_master = service._from_master

    def observed(context, wait_s: float = 0.0) -> bool:
        if wait_s and service.session is None:
            waiting.set()
        return from_master(context, wait_s)

    service._from_master = observed
    master = [(SESSION_KEY, "session-of-the-master")]
    with ClusterSecurity(token=TOKEN).channel(address, metadata=master) as ch:
        early = pb_grpc.WorkerStub(ch).AllocateCache.future(pb.AllocateCacheRequest(), timeout=10)
        assert waiting.wait(10), "the early call never reached the worker's session check"
        service.registered("session-of-the-master")  # the RegisterReply arrives
        with pytest.raises(grpc.RpcError) as e:
            early.result()
    # past the session check: refused only because no model is loaded
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_draining_worker_gives_up_on_a_silent_master(monkeypatch, worker_service):
    """After a signal the worker waits for the master's Shutdown for --shutdown_timeout (+
    a margin, 0 here) and then exits 1; a second signal ends the wait at once; the
    master's Shutdown during the drain is a clean exit."""
    from xllm_py.cluster import worker_node

    monkeypatch.setattr(worker_node, "DRAIN_MARGIN_S", 0.0)
    opts = options_from_args(cluster_args("--heartbeat_timeout=600"))
    service, address = worker_service
    service.registered("session-of-the-master")
    service.draining, service.signals = True, 1
    with ClusterSecurity(token=TOKEN).channel(address) as ch:  # Health says so
        assert pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=10).draining
    t0 = time.monotonic()
    assert worker_node._serve(service, opts, drain_s=1.0) == 1  # returned: it gave up
    assert time.monotonic() - t0 >= 1.0  # after waiting the drain out, not before
    service.signals = 2
    assert worker_node._serve(service, opts, drain_s=600.0) == 1
    service.signals = 1
    master = [(SESSION_KEY, "session-of-the-master")]
    with ClusterSecurity(token=TOKEN).channel(address, metadata=master) as ch:
        shutdown = worker_calls(pb_grpc.WorkerStub(ch))["Shutdown"]
        master_says = threading.Timer(0.5, shutdown)
        master_says.start()
        assert worker_node._serve(service, opts, drain_s=600.0) == 0
        master_says.join()


# ---- the flags ---------------------------------------------------------------------------


def cluster_args(*flags: str):
    args = build_parser().parse_args(
        ["--nnodes=2", "--node_rank=1", "--master_node_addr=127.0.0.1:1", *flags]
    )
    check(args)
    return args


def test_security_flags_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--cluster_token and --cluster_token_file: give one"):
        cluster_args("--cluster_token=a", "--cluster_token_file=f")
    with pytest.raises(ValueError, match="--cluster_tls_cert and --cluster_tls_key go together"):
        cluster_args("--cluster_tls_cert=c.pem")
    with pytest.raises(ValueError, match="--cluster_tls_ca .* needs this node's own"):
        cluster_args("--cluster_tls_ca=ca.pem")
    missing = tmp_path / "no-such-token"
    args = cluster_args(f"--cluster_token_file={missing}")  # files are read at start-up
    with pytest.raises(ValueError, match=f"--cluster_token_file={missing}: cannot read it"):
        options_from_args(args, read_secrets=True)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="--cluster_token_file=.*: the token is empty"):
        load_security(token_file=str(empty))
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="--cluster_tls_cert=.*: not a PEM file"):
        load_security(cert=str(not_pem), key=str(not_pem))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert load_security(token_file=str(token_file)).token == TOKEN
    assert TOKEN not in repr(load_security(token=TOKEN))


def test_an_unreadable_token_file_stops_a_worker_with_exit_2(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "xllm_py", "--nnodes=2", "--node_rank=1",
         "--master_node_addr=127.0.0.1:1", f"--cluster_token_file={tmp_path}/nope"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert f"--cluster_token_file={tmp_path}/nope: cannot read it" in r.stderr


def test_ray_nodes_get_the_token_by_environment_not_argv():
    argv = ["--nnodes=2", "--cluster_token", TOKEN, "--cluster_token_file=/t", "--port=1"]
    words = node_argv(build_parser().parse_args(argv), 1, "10.0.0.1:9", "cpu")
    assert TOKEN not in words and not any(w.startswith("--cluster_token") for w in words)
    assert "--port=1" in words and "--node_rank=1" in words


# ---- real clusters -----------------------------------------------------------------------


class Cluster:
    """Master (HTTP on `url`) and one worker, with their own log files."""

    def __init__(self, tag: str, *flags: str, layout: str = "--dp_size=1") -> None:
        self.http, self.worker_port = free_port(), free_port()
        master_port = free_port_range(2)  # + 1: the torch.distributed rendezvous
        self.url = f"http://127.0.0.1:{self.http}"
        self.worker_addr = f"127.0.0.1:{self.worker_port}"
        self.master_addr = f"127.0.0.1:{master_port}"
        common = ("--nnodes=2", layout, f"--master_node_addr={self.master_addr}", *flags)
        self.master = Node(f"{tag}-master", f"--port={self.http}", "--node_rank=0", *common)
        self.worker = Node(f"{tag}-worker", f"--port={self.worker_port}", "--node_rank=1", *common)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        def gone() -> str | None:
            m = self.master
            return None if m.proc.poll() is None else f"master exited:\n{m.output()}"

        if not wait_healthy(self.url, gone, timeout):
            raise RuntimeError(f"cluster did not come up:\n{self.master.output()}")

    def kill(self) -> None:
        self.master.kill()
        self.worker.kill()


SMALL = ("--dtype=float32", "--max_cache_size=16000000")  # a small KV cache starts faster


def worker_steps(channel: grpc.Channel) -> int:
    return pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=10).steps


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    """A tensor-parallel 2-node cluster (every step needs the worker) with a token file."""
    token_file = tmp_path_factory.mktemp("token") / "cluster.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    flags = (*SMALL, "--num_speculative_tokens=1", f"--cluster_token_file={token_file}")
    c = Cluster("sec-token", *flags, "--shutdown_timeout=120")
    try:
        c.wait_healthy()
        yield c
    finally:
        c.kill()


def test_strangers_are_unauthenticated_on_every_rpc_of_a_live_cluster(token_cluster):
    c = token_cluster
    with ClusterSecurity(token=TOKEN).channel(c.worker_addr) as ch:
        steps = worker_steps(ch)
        for who, channel in strangers(c.worker_addr).items():
            for name, call in worker_calls(pb_grpc.WorkerStub(channel)).items():
                assert code_of(call) == UNAUTHENTICATED, (who, name)
        for who, channel in strangers(c.master_addr).items():
            assert code_of(register_call(channel)) == UNAUTHENTICATED, who
        assert worker_steps(ch) == steps  # nothing ran on the worker
        assert complete(c.url, PROMPTS[0])  # the cluster serves as before
        assert worker_steps(ch) > steps
    assert c.worker.proc.poll() is None
    assert "missing or wrong cluster token" in c.worker.output()


def test_a_second_master_cannot_drive_a_registered_worker(token_cluster):
    """Right token, its own session: every master-only RPC is PERMISSION_DENIED, the
    worker keeps running, and its rank cannot be registered again."""
    c = token_cluster
    intruder = ClusterSecurity(token=TOKEN).channel(
        c.worker_addr, metadata=[(SESSION_KEY, "0" * 32)]
    )
    with intruder:
        steps = worker_steps(intruder)
        calls = worker_calls(pb_grpc.WorkerStub(intruder))
        for name in MASTER_ONLY:
            assert code_of(calls[name]) == PERMISSION_DENIED, name
        assert worker_steps(intruder) == steps
    with ClusterSecurity(token=TOKEN).channel(c.master_addr) as ch:
        assert code_of(register_call(ch)) == grpc.StatusCode.ALREADY_EXISTS
    # the refusal is logged before the call returns; a Shutdown taken would log its reason
    log = c.worker.output()
    assert "refused Shutdown" in log and "shutdown requested by the master" not in log
    assert complete(c.url, PROMPTS[1])  # tensor parallel: every step runs on the worker too
    assert c.worker.proc.poll() is None and c.master.proc.poll() is None


def stream(url: str, max_tokens: int, started: threading.Event) -> tuple[list[dict], bool]:
    """One streamed completion of exactly max_tokens tokens: (json events, saw [DONE])."""
    body = {
        "model": MODEL,
        "prompt": PROMPTS[2],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    events, done = [], False
    with HTTP.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                started.set()
    return events, done


def test_worker_sigterm_mid_stream_drains_the_cluster(token_cluster):
    """SIGTERM on the worker of a TP replica while a long stream runs: the master is told
    by its health checks, stops admitting (/health 503), the stream finishes whole (its
    finish_reason, usage and [DONE]), then both processes exit 0. Ends the cluster."""
    c = token_cluster
    # Long enough: the master starts draining within about one health poll (1 s) of the
    # signal (0.8 s measured), these tokens take about 7 s on a loaded 2-core machine
    tokens = 150
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(stream, c.url, tokens, started)
        assert started.wait(60)
        c.worker.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while HTTP.get(c.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "the master never started draining"
            time.sleep(0.1)
        draining_before_end = not fut.done()
        events, done = fut.result(180)
    assert done, events[-1]
    assert not any("error" in e for e in events), events[-1]
    finish = [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]]
    assert finish == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == tokens
    assert draining_before_end, "the stream ended before the drain began: make it longer"
    assert c.master.wait(60) == 0, c.master.output()[-3000:]
    assert c.worker.wait(60) == 0, c.worker.output()[-3000:]
    assert "draining the cluster" in c.master.output()
    assert "shutdown requested by the master" in c.worker.output()


# ---- mutual TLS ------------------------------------------------------------------------


def make_certs(folder: Path) -> dict[str, Path]:
    """A CA and one node certificate it signed (SAN IP 127.0.0.1, server and client use),
    as PEM files."""
    pytest.importorskip("cryptography", reason="the TLS test makes its certificates with it")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool):
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
            usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            b = b.add_extension(san, critical=False)
            b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    node_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("xllm test CA", ca_key, "xllm test CA", ca_key, ca=True)
    node = cert("xllm node", node_key, "xllm test CA", ca_key, ca=False)
    paths = {name: folder / f"{name}.pem" for name in ("ca", "cert", "key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(node.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        node_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(paths["key"], 0o600)
    return paths


def test_mutual_tls_cluster_serves_what_one_node_does(tmp_path):
    """Both services and every channel over mutual TLS (plus the token): a data-parallel
    2-node cluster answers 4 prompts exactly as the offline API does on one node, the
    worker served steps, a client without a certificate gets nowhere, both exit 0."""
    from tests.test_cluster import offline_answers

    certs = make_certs(tmp_path)
    offline = offline_answers(PROMPTS[:4], 16000000)
    flags = [f"--cluster_tls_{name}={path}" for name, path in certs.items()]
    c = Cluster("sec-tls", *SMALL, f"--cluster_token={TOKEN}", *flags, layout="--dp_size=2")
    try:
        c.wait_healthy()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: complete(c.url, p), PROMPTS[:4]))
        assert got == offline
        tls = TlsFiles(*(certs[n].read_bytes() for n in ("cert", "key", "ca")))
        with ClusterSecurity(TOKEN, tls).channel(c.worker_addr) as ch:
            assert worker_steps(ch) > 0, "the worker (replica 1) served no step"
        plain = pb_grpc.WorkerStub(grpc.insecure_channel(c.worker_addr))
        assert code_of(lambda: plain.Health(pb.HealthRequest(), timeout=5)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        assert "mutual TLS" in c.master.output() and "mutual TLS" in c.worker.output()
        c.master.proc.send_signal(signal.SIGTERM)
        assert c.master.wait(60) == 0
        assert c.worker.wait(30) == 0, c.worker.output()[-3000:]
    finally:
        c.kill()


# ---- launch_cluster.sh -----------------------------------------------------------------


def test_launch_script_gives_every_node_a_token_file(tmp_path):
    script = ROOT / "scripts" / "launch_cluster.sh"
    env = os.environ | {"DRY_RUN": "1", "LOG_DIR": str(tmp_path / "log")}
    env.pop("CLUSTER_TOKEN_FILE", None)
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    nodes = [shlex.split(x) for x in r.stdout.splitlines() if "xllm_py" in x]
    assert len(nodes) == 2
    for words in nodes:
        assert f"--cluster_token_file={tmp_path}/log/cluster.token" in words
        assert not any(w.startswith("--cluster_token=") for w in words)
    assert not (tmp_path / "log").exists()  # a dry run makes no token
    given = tmp_path / "mine.token"
    given.write_text(TOKEN)
    r = subprocess.run(["bash", str(script)], env=env | {"CLUSTER_TOKEN_FILE": str(given)},
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0 and r.stdout.count(f"--cluster_token_file={given}") == 2
    r = subprocess.run(["bash", str(script)], env=env | {"CLUSTER_TOKEN_FILE": "/no/such"},
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0 and "CLUSTER_TOKEN_FILE=/no/such: cannot read it" in r.stderr


# ---- the chat template's sandbox ---------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from xllm_py.assets import bundled_model
    from xllm_py.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(bundled_model())


def with_template(tok, template: str):
    from xllm_py.engine.tokenizer import Tokenizer

    return Tokenizer(tok._tok, {**tok.config, "chat_template": template})


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",  # plain jinja2 would render this as an empty string
        "{{ messages[0]['content'].__class__.__base__.__subclasses__() }}",
        "{% set seen = [] %}{{ seen.append(1) }}",  # mutating a value
        "{{ messages.pop() }}",
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_chat_template_cannot_reach_python_internals(tokenizer, template):
    from xllm_py.engine.tokenizer import ChatTemplateRefused

    evil = with_template(tokenizer, template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateRefused, match="refused by the sandbox"):
        evil.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]  # nothing mutated


def test_bundled_chat_template_renders_as_plain_jinja2_does(tokenizer):
    import jinja2

    from xllm_py.engine.tokenizer import _token_text

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <there> & {{ you }}"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]
    plain = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    special = {k: _token_text(tokenizer.config.get(k)) or "" for k in ("bos_token", "eos_token")}
    for gen in (True, False):
        want = plain.from_string(tokenizer.chat_template).render(
            messages=messages, add_generation_prompt=gen, **special
        )
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=gen) == want
