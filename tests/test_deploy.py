"""deploy/: every command line in it is one the daemon accepts, the paths its probes name
are routes the server has, and its YAML is well formed. Containers cannot run here, so
this is how the images, units and manifests are checked (deploy/README.md)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import pytest
import yaml

from tests.server_utils import ROOT
from xllm_py.cli import build_parser, check

DEPLOY = ROOT / "deploy"
# Values for the variables the files use (an env file, the LWS-injected ones, the pod IP).
ENV = {
    "MODEL_PATH": "/models/DeepSeek-V3",
    "NNODES": "16",
    "MASTER_NODE_ADDR": "10.0.0.1:42123",
    "API_HOST": "0.0.0.0",
    "API_PORT": "8000",
    "WORKER_HOST": "10.0.0.2",
    "WORKER_BASE_PORT": "13220",
    "DEVICE_TYPE": "cuda",
    "DEVICES_PER_HOST": "8",
    "NUM_SPECULATIVE_TOKENS": "1",
    "LWS_GROUP_SIZE": "16",
    "LWS_WORKER_INDEX": "3",
    "LWS_LEADER_ADDRESS": "xllm-deepseek-v3-0.xllm-deepseek-v3",
    "POD_IP": "10.1.2.3",
    "MODEL_DIR": "/models/model",
}
ENTRY = ["/opt/xllm/.venv/bin/python", "-m", "xllm_py"]


def accepted(flags: list[str]) -> object:
    """The daemon's own parsing and start-up checks (what `python -m xllm_py` runs first)."""
    args = build_parser().parse_args(flags)
    check(args)
    return args


def fill(text: str) -> str:
    """$(VAR) (Kubernetes) and ${VAR} (systemd, compose, with :-defaults) substituted."""
    text = re.sub(r"\$\((\w+)\)", lambda m: ENV[m.group(1)], text)
    return re.sub(r"\$\{(\w+)(:-[^}]*)?\}", lambda m: ENV[m.group(1)], text)


def dockerfiles() -> list:
    return sorted((DEPLOY / "docker").glob("Dockerfile.*"))


def instruction(path, name: str) -> str:
    """The (last) instruction `name` of a Dockerfile, continuation lines joined."""
    text = path.read_text().replace("\\\n", " ")
    found = re.findall(rf"^{name}\s+(.*)$", text, flags=re.M)
    assert found, f"{path.name}: no {name}"
    return found[-1]


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.name)
def test_dockerfile_entrypoint_and_cmd_are_accepted(path):
    entry = json.loads(instruction(path, "ENTRYPOINT"))
    cmd = json.loads(instruction(path, "CMD"))
    if entry[0] == "/bin/bash":  # the Ascend wrapper: source CANN, then exec the daemon "$@"
        assert "set_env.sh" in entry[2] and 'python -m xllm_py "$@"' in entry[2]
    else:
        assert entry == ENTRY
    args = accepted(cmd)
    assert args.model == "/models/model" and args.host == "0.0.0.0"
    assert re.search(rf"^EXPOSE {args.port}$", path.read_text(), flags=re.M)
    run = instruction(path, "RUN")  # the runtime extras only, never the test tools
    assert re.search(r"\.\[structured(,npu)?\]", run) and ".[dev]" not in run
    assert re.search(r"^USER (?!root)\w+", path.read_text(), flags=re.M)


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.name)
def test_dockerfile_healthcheck_hits_a_route(path, routes):
    check = " ".join(json.loads(instruction(path, "HEALTHCHECK --interval=30s").split("CMD", 1)[1]))
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", check)
    assert url and url.group(2) in routes
    assert int(url.group(1)) == accepted(json.loads(instruction(path, "CMD"))).port


def test_compose_commands_are_a_two_node_cluster():
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    master = accepted([fill(w) for w in compose["services"]["master"]["command"]])
    worker = accepted([fill(w) for w in compose["services"]["worker"]["command"]])
    assert (master.nnodes, master.node_rank, worker.node_rank) == (2, 0, 1)
    assert master.master_node_addr == worker.master_node_addr == "master:42123"
    assert worker.host == "worker"  # the name the master dials


def exec_start(name: str, rank: str = "") -> list[str]:
    """The unit's ExecStart as words: `%i` filled in, variables from the env file, and a
    `/bin/sh -c` line evaluated by a real shell (printing its words instead of exec'ing)."""
    text = (DEPLOY / "systemd" / name).read_text()
    line = re.search(r"^ExecStart=(.*)$", text, flags=re.M).group(1).replace("%i", rank)
    env_file = DEPLOY / "systemd" / "xllm.env"
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    assert set(env) <= set(ENV)
    if line.startswith("/bin/sh -c "):
        script = shlex.split(line)[2].replace("exec " + " ".join(ENTRY), "printf '%s\\n'")
        out = subprocess.run(["sh", "-c", script], env={**os.environ, **env}, text=True,
                             capture_output=True, check=True)  # fmt: skip
        return out.stdout.splitlines()
    words = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], w) for w in shlex.split(line)]
    assert words[:3] == ENTRY
    return words[3:]


def test_systemd_units_start_the_master_and_worker_i():
    master = accepted(exec_start("xllm-master.service"))
    worker = accepted(exec_start("xllm-worker@.service", "1"))
    assert (master.node_rank, worker.node_rank, master.nnodes) == (0, 1, 2)
    assert worker.port == 13221 and worker.devices == "cuda:1"  # base + rank, rank mod 8
    unit = (DEPLOY / "systemd" / "xllm-master.service").read_text()
    stop = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, flags=re.M).group(1))
    assert "KillSignal=SIGTERM" in unit and stop > master.shutdown_timeout
    assert "Restart=on-failure" in unit


def k8s_objects() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


REQUIRED = {
    "LeaderWorkerSet": ["leaderWorkerTemplate"],
    "Deployment": ["selector", "template"],
    "StatefulSet": ["selector", "template", "serviceName"],
    "Service": ["selector", "ports"],
    "ServiceMonitor": ["selector", "endpoints"],
}


def pod_specs(obj: dict) -> list[tuple[str, dict]]:
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [
            ("leader", lwt["leaderTemplate"]["spec"]),
            ("worker", lwt["workerTemplate"]["spec"]),
        ]
    if obj["kind"] in ("Deployment", "StatefulSet"):  # one process a pod: its node 0
        return [("leader", obj["spec"]["template"]["spec"])]
    return []


@pytest.mark.parametrize("name,obj", k8s_objects(), ids=[n for n, _ in k8s_objects()])
def test_kubernetes_objects_are_complete_and_their_commands_accepted(name, obj, routes):
    assert obj["apiVersion"] and obj["metadata"]["name"]
    for field in REQUIRED[obj["kind"]]:
        assert field in obj["spec"], f"{name}: {obj['kind']} without spec.{field}"
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart" and lwt["size"] > 1
    if obj["kind"] == "ServiceMonitor":
        assert all(e["path"] in routes for e in obj["spec"]["endpoints"])
    for role, spec in pod_specs(obj):
        (c,) = spec["containers"]
        assert c["image"] and c["command"] == ENTRY
        declared = {e["name"] for e in c.get("env", [])}
        used = set(re.findall(r"\$\((\w+)\)", " ".join(c["args"])))
        assert used <= declared | {"LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS"}
        args = accepted([fill(w) for w in c["args"]])
        assert (args.node_rank == 0) == (role == "leader")
        limits = c["resources"]["limits"] if "resources" in c else {}
        if args.pd_role == "router":  # no model, no device
            assert not limits and args.pd_config().decode_urls
        else:
            assert args.devices.split(":")[0] == (
                "npu" if "huawei.com/Ascend910" in limits else "cuda"
            )
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["path"] in routes
                assert c[probe]["httpGet"]["port"] == args.port
        if role == "leader":
            assert "readinessProbe" in c


@pytest.fixture(scope="module")
def routes():
    """The paths of the real app, built by the daemon's own build_server (not started)."""
    from xllm_py.entrypoints.serve import build_server

    flags = ["--dtype=float32", "--enable_graph=false"]
    server, engine = build_server(build_parser().parse_args(flags))
    try:
        return {r.path for r in server.config.app.routes if hasattr(r, "path")}
    finally:
        engine.shutdown()


def test_a_wrong_flag_is_caught():
    with pytest.raises(SystemExit):
        accepted(["--model", "/m", "--num_speculative_tokenz", "1"])
    with pytest.raises(ValueError, match="node_rank"):
        accepted(["--nnodes=2", "--node_rank=2", "--master_node_addr=h:1"])


def test_the_pd_example_names_every_instance_it_starts():
    """k8s/pd-gpu.yaml: the router's --pd_decode and --pd_prefill, and each decode
    instance's --pd_prefill, are exactly the StatefulSets' pods (name-i.service:port)."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "pd-gpu.yaml").read_text()) if d]
    pods, args = {}, {}
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            (c,) = d["spec"]["template"]["spec"]["containers"]
            a = accepted([fill(w) for w in c["args"]])
            args[a.pd_role] = a
        if d["kind"] == "StatefulSet":
            name, spec = d["metadata"]["name"], d["spec"]
            pods[name] = [f"http://{name}-{i}.{spec['serviceName']}:{a.port}"
                          for i in range(spec["replicas"])]  # fmt: skip
    assert args["router"].pd_decode == pods["xllm-decode"]
    assert args["router"].pd_prefill == args["decode"].pd_prefill == pods["xllm-prefill"]
    assert args["decode"].pd_transfer_host == args["prefill"].pd_transfer_host == ENV["POD_IP"]
