"""Prefill/decode disaggregation served (docs/pd.md): a prefill daemon (--pd_role=prefill)
and a decode daemon (--pd_role=decode --pd_prefill URL), real processes on loopback, the
prompts' blocks moved by Mooncake's transfer engine. Through the decode daemon, greedy
completions equal a colocated daemon's, tokens and logprobs, with MTP (k = 2), and as many
drafts are accepted: the decode daemon found every moved block in its prefix cache (its
/metrics), so it computed only each prompt's last partial block. A decode daemon of
another block size is refused at its first request, the field named (an error event in
the client's stream under --pd_on_transfer_failure=error), and computes its prompts
itself; so does the first one once the prefill daemon is gone, with the same answers. A
prefill call without the cluster token is refused; a router's choice of prefill instance
counts only with the token and only among the decode daemon's --pd_prefill. With the
cluster's TLS files the instances serve HTTPS to mutual-TLS clients only (the router and
the decode daemon present their certificates).

The router (--pd_role=router) in front of a prefill and two decode daemons serves the
openai client: completions and chat equal a decode daemon's own answers, streamed and
not, and a required tool call comes back parsed; requests are spread over both decode
daemons; a stored response (Responses API) is read, continued with previous_response_id
and deleted through the router, twice, on the daemon that holds it. A decode daemon
killed mid-stream ends its client's stream with an error event and [DONE], and the next
requests go to the other; the prefill daemon killed during a burst of requests leaves
every one of them completing with its answer.

The acceptance runs, through 1 prefill + 1 decode daemon + the router, prompts prefilled
in chunks: 32 held-out prompts give a colocated daemon's greedy tokens and logprobs at k = 0
and k = 2 (the same drafts accepted), as do 4 of them cut short, whose blocks the decode
daemon finds in its own prefix cache; at k = 2 the T = 1 distribution of the first four
tokens equals the colocated daemon's (chi-square, 1,008 samples an arm)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import ssl
import sys
import time
import types

import httpx
import openai
import pytest

from perf.daemon import samples
from tests.chisquare import ALPHA, homogeneity
from tests.server_utils import HTTP, Daemon, Server, free_port, spec_totals, wait_healthy
from tests.test_cluster_security import make_certs
from xllm_py import LLM
from xllm_py.config import PDConfig
from xllm_py.pd import transfer
from xllm_py.pd.compat import PREFILL_HEADER, PREFILL_ROUTE, TOKEN_HEADER, credentials
from xllm_py.sharegpt import held_out_user_turns

try:
    transfer.transfer_engine_class()
except RuntimeError as e:  # no Mooncake wheel, or no rdma-core (make setup fetches both)
    pytest.skip(str(e), allow_module_level=True)

BLOCK = 16
FLAGS = ("--dtype=float32", f"--block_size={BLOCK}", "--num_speculative_tokens=2",
         "--max_cache_size=16000000", "--speculative_confidence=off")  # fmt: skip
TOKEN = "pd-test-token-0123456789"
HITS = "xllm:prefix_cache_hits_total"
BLOCK_BYTES = 9 * BLOCK * 96 * 4  # layers (8 target + 1 MTP) x block x latent + rope x fp32


@pytest.fixture(scope="module")
def prompts():
    tok = LLM(dtype="float32", max_cache_size=1 << 20).get_tokenizer()
    texts = held_out_user_turns(4, 100, 600)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def complete(url: str, ids: list[int], headers=None) -> tuple[list[str], list[float]]:
    body = {"prompt": ids, "max_tokens": 16, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    r = HTTP.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def assert_same(got, want):
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


def cut(p: list[int]) -> list[int]:
    """Another prompt: p less its last half block (its full blocks all but the last)."""
    return p[: -BLOCK // 2]


@pytest.fixture(scope="module")
def colocated(prompts) -> dict[str, list]:
    """A colocated daemon's greedy answers to the prompts, whole and cut."""
    with Server(*FLAGS) as s:
        whole = [complete(s.url, p) for p in prompts[:3]]
        drafts = spec_totals(s.url)[:2]  # draft and accepted tokens of the first three
        whole += [complete(s.url, p) for p in prompts[3:]]
        return {"whole": whole, "cut": [complete(s.url, cut(p)) for p in prompts],
                "drafts": drafts}  # fmt: skip


def test_decode_through_a_prefill_instance_is_colocated_decoding(prompts, colocated):
    env = {"XLLM_CLUSTER_TOKEN": TOKEN}
    want = colocated["whole"]
    with Server(*FLAGS, "--pd_role=prefill", env=env) as prefill:
        with Server(*FLAGS, "--pd_role=decode", f"--pd_prefill={prefill.url}", env=env) as dec:
            for p, w in zip(prompts[:3], want):
                assert_same(complete(dec.url, p), w)
            moved = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts[:3])  # full blocks' tokens
            assert dec.metric(HITS) == moved > 0  # every full block arrived, none computed
            # the same drafts accepted: the MTP layer's blocks and the last hidden state too
            assert spec_totals(dec.url)[:2] == colocated["drafts"]
            blocks = moved // BLOCK
            for side in (dec, prefill):  # received, written
                assert side.metric("xllm:pd_kv_blocks_total") == blocks
                assert side.metric("xllm:pd_kv_bytes_total") == blocks * BLOCK_BYTES
            assert dec.metric("xllm:pd_transfers_total") == 3
            assert dec.metric("xllm:pd_transfer_seconds_count") == 3
            assert dec.metric("xllm:pd_transfer_failures_total") == 0
            # the TTFT split: queue (the transfer's wait included) and prefill, one each
            for split in ("queue", "prefill"):
                assert dec.metric(f"xllm:request_{split}_time_seconds_count") == 3
            refused = HTTP.post(prefill.url + PREFILL_ROUTE, json={}, timeout=10)
            assert refused.status_code == 401
            # a router's choice of prefill instance counts only from a caller with the
            # token, and only among --pd_prefill; "" (none live) has the prompt computed here
            fresh = (prompts[0] * 3)[::-1]  # blocks nobody has seen, 40 tokens a prompt
            spoofed = {PREFILL_HEADER: "http://127.0.0.1:9", TOKEN_HEADER: TOKEN}
            complete(dec.url, fresh[:40], spoofed)  # not one of --pd_prefill: its own choice
            assert dec.metric("xllm:pd_transfers_total") == 4
            complete(dec.url, fresh[40:80], {PREFILL_HEADER: ""})  # without the token
            assert dec.metric("xllm:pd_transfers_total") == 5
            complete(dec.url, fresh[80:120], {PREFILL_HEADER: "", TOKEN_HEADER: TOKEN})
            assert dec.metric("xllm:pd_transfers_total") == 5  # computed here, nobody asked
            assert dec.metric("xllm:pd_transfer_failures_total") == 0
            hits = dec.metric(HITS)
            # another block size: refused at the first request, naming the field (an error
            # event in the client's stream under --pd_on_transfer_failure=error), and the
            # decode daemon computes its prompts itself from then on
            other = [f for f in FLAGS if not f.startswith("--block_size")] + ["--block_size=32"]
            with Server(*other, "--pd_role=decode", f"--pd_prefill={prefill.url}",
                        "--pd_on_transfer_failure=error", env=env) as odd:  # fmt: skip
                body = {"prompt": prompts[0], "max_tokens": 4, "stream": True}
                with HTTP.stream("POST", odd.url + "/v1/completions", json=body,
                                 timeout=120) as r:  # fmt: skip
                    events = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
                assert events[-1] == "[DONE]"  # the stream's last event before it: the error
                error = json.loads(events[-2])["error"]["message"]
                assert "block_size: this instance has 16, the peer 32" in error
                assert_same(complete(odd.url, prompts[0]), want[0])
                assert "block_size: this instance has 16, the peer 32" in odd.output()
            assert "not compatible, not asked again" in odd.output()
            prefill.stop()
            for p, w in zip(prompts[3:], want[3:]):  # no prefill instance left: computed here
                assert_same(complete(dec.url, p), w)
            assert dec.metric(HITS) == hits
            assert "computed here, its transfer failed" in dec.output()
            assert dec.metric("xllm:pd_transfer_failures_total") >= 1


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}


def chat(client: openai.OpenAI, model: str, **kw):
    """One greedy chat answer's text, streamed or not."""
    ask = [{"role": "user", "content": "Name three colours."}]
    args = dict(model=model, messages=ask, max_tokens=24, temperature=0, **kw)
    if not kw.get("stream"):
        return client.chat.completions.create(**args).choices[0].message.content
    chunks = client.chat.completions.create(**args)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def kill_mid_stream(router, decodes) -> tuple[list[str], object]:
    """Stream a long completion through the router, kill the decode daemon serving it after
    the first event: (the stream's data lines, the daemon killed)."""
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    lines, killed = [], None
    with HTTP.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line[6:])
            if killed is None:
                busy = [d for d in decodes
                        if router.metric("xllm_router:in_flight", url=d.url) == 1]  # fmt: skip
                (killed,) = busy
                killed.stop(signal.SIGKILL)
    return lines, killed


def tls_instance(role: str, flags: list[str], client: httpx.Client) -> Daemon:
    """A PD daemon serving HTTPS (its TLS flags in `flags`), up once `client` reads 200
    from its /health."""
    port = free_port()
    cmd = [sys.executable, "-m", "xllm_py", "--port", str(port), *FLAGS, *flags,
           "--enable_graph=false", f"--pd_role={role}"]  # fmt: skip
    d = Daemon(cmd, port, ready_path=None, env={**os.environ, "XLLM_CLUSTER_TOKEN": TOKEN})
    d.url = f"https://127.0.0.1:{port}"
    if wait_healthy(d.url, d._exited, 120, client=client):
        return d
    d.stop()
    raise RuntimeError(f"{role} instance not up:\n{d.output()}")


def test_the_control_plane_over_mutual_tls(prompts, colocated, tmp_path):
    """With the cluster's TLS files (and token) on every process, the prefill and decode
    daemons serve HTTPS to clients whose certificate the CA signed: the router's health
    checks and forwarded requests, and the decode daemon's prefill calls, present theirs,
    and a completion through the router is the colocated daemon's, its blocks moved. A
    client without a certificate, or speaking plain HTTP, is refused at the handshake;
    an http:// instance URL is refused at start-up."""
    certs = make_certs(tmp_path)
    tls = [f"--cluster_tls_{name}={certs[name]}" for name in ("cert", "key", "ca")]
    context = ssl.create_default_context(cafile=str(certs["ca"]))
    context.load_cert_chain(certs["cert"], certs["key"])
    with httpx.Client(verify=context) as client:
        with tls_instance("prefill", tls, client) as prefill:
            with tls_instance("decode", [*tls, f"--pd_prefill={prefill.url}"], client) as dec:
                route = [f"--pd_decode={dec.url}", f"--pd_prefill={prefill.url}"]
                with Server("--pd_role=router", *tls, *route,
                            env={"XLLM_CLUSTER_TOKEN": TOKEN}) as router:  # fmt: skip
                    assert_same(complete(router.url, prompts[0]), colocated["whole"][0])
                page = client.get(dec.url + "/metrics", timeout=10).text
                moved = [v for n, _, v in samples(page) if n == "xllm:pd_transfers_total"]
                assert moved == [1]
                anonymous = ssl.create_default_context(cafile=str(certs["ca"]))
                with httpx.Client(verify=anonymous) as stranger:
                    with pytest.raises(httpx.TransportError):
                        stranger.get(dec.url + "/health", timeout=5)
                with pytest.raises(httpx.TransportError):
                    HTTP.get(f"http://127.0.0.1:{dec.port}/health", timeout=5)
    with pytest.raises(ValueError, match="must start with https://"):
        PDConfig(role="decode", prefill_urls=("http://127.0.0.1:1",), tls_cert="c", tls_key="k")
    with pytest.raises(ValueError, match="go together"):
        PDConfig(role="prefill", tls_cert="cert.pem")
    files = {"cluster_tls_cert": str(certs["cert"]), "cluster_tls_key": str(certs["ca"])}
    flags = types.SimpleNamespace(secret=lambda name: None, cluster_token_file=None,
                                  cluster_tls_ca=None, **files)  # fmt: skip
    with pytest.raises(ValueError, match=f"_key={certs['ca']}.*cannot load"):
        credentials(PDConfig(role="prefill"), flags)  # a certificate given as the key


def test_the_router_serves_the_openai_client_and_routes_around_a_dead_decode_daemon(
    prompts, colocated
):
    env = {"XLLM_CLUSTER_TOKEN": TOKEN}
    tools = ("--tool_call_parser=deepseek_v3", "--enable_auto_tool_choice")
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(Server(*FLAGS, "--pd_role=prefill", env=env))
        decode = ["--pd_role=decode", f"--pd_prefill={prefill.url}"]
        decodes = [stack.enter_context(Server(*FLAGS, *tools, *decode, env=env)) for _ in "ab"]
        router = stack.enter_context(Server("--pd_role=router", "--pd_decode",
            *(d.url for d in decodes), "--pd_prefill", prefill.url,
            "--pd_health_interval=0.5"))  # fmt: skip
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        direct = openai.OpenAI(base_url=decodes[0].url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id

        assert_same(complete(router.url, prompts[0]), complete(decodes[0].url, prompts[0]))
        text = client.completions.create(model=model, prompt="Hello", max_tokens=8,
                                         temperature=0).choices[0].text  # fmt: skip
        assert text == direct.completions.create(model=model, prompt="Hello", max_tokens=8,
                                                 temperature=0).choices[0].text  # fmt: skip
        want = chat(direct, model)
        assert chat(client, model) == want == chat(client, model, stream=True)
        call = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=64,
            temperature=0,
        )  # fmt: skip
        (tc,) = call.choices[0].message.tool_calls
        assert tc.function.name == "get_weather" and "city" in json.loads(tc.function.arguments)
        for d in [*decodes, prefill]:  # least loaded, ties in turn: both decoders served
            assert router.metric("xllm_router:requests_total", url=d.url) > 0
        # a stored response lives on one decode daemon: reading it, continuing it and
        # deleting it through the router reach that one, whichever the router would pick
        first = client.responses.create(model=model, input="Name a colour.",
                                        max_output_tokens=8, temperature=0)  # fmt: skip
        for _ in range(2):
            assert client.responses.retrieve(first.id).output_text == first.output_text
            more = client.responses.create(model=model, input="And another?", temperature=0,
                                           previous_response_id=first.id,
                                           max_output_tokens=8)  # fmt: skip
            assert more.previous_response_id == first.id
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError, match="no live decode instance holds"):
            client.responses.retrieve(first.id)

        lines, killed = kill_mid_stream(router, decodes)
        assert (
            lines[-1] == "[DONE]"
            and "failed mid-answer" in json.loads(lines[-2])["error"]["message"]
        )
        assert len(lines) < 500  # cut short, not finished
        assert router.metric("xllm_router:instance_up", url=killed.url) == 0
        for _ in range(2):  # both to the live one
            assert chat(client, model) == want
        assert HTTP.get(router.url + "/health", timeout=10).json() == {"decode": 1, "prefill": 1}

        # the prefill daemon killed during a burst of long prompts: every request completes
        # with its answer (the decode daemon computes what did not arrive), none hangs
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            burst = [pool.submit(complete, router.url, cut(p)) for p in prompts]
            prefill.stop(signal.SIGKILL)
            for f, w in zip(burst, colocated["cut"]):
                assert_same(f.result(timeout=120), w)
        # and the router takes it out of rotation at a health check (every 0.5 s here; the
        # burst may be over first): within a few intervals and a loaded machine's slack
        deadline = time.monotonic() + 3 * 0.5 + 5
        while router.metric("xllm_router:instance_up", url=prefill.url) != 0:
            assert time.monotonic() < deadline, "the router still counts the prefill as live"
            time.sleep(0.1)


# ---- the acceptance runs: 32 held-out prompts, k = 0 and 2, and sampled tokens ---------------

CHUNK = 64  # --max_tokens_per_batch: most of the 32 prompts take several prefill steps
SAMPLES = 1008  # per arm: 63 requests of n = 16
SAMPLE_TOKENS = 4


@pytest.fixture(scope="module")
def prompts32():
    tok = LLM(dtype="float32", max_cache_size=1 << 20).get_tokenizer()
    texts = held_out_user_turns(32, 200, 1200)
    assert len(texts) == 32
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def sampled(url: str, ids: list[int]) -> list[list[str]]:
    """SAMPLES unseeded continuations of `ids` at T = 1, SAMPLE_TOKENS tokens each."""
    body = {"prompt": ids, "max_tokens": SAMPLE_TOKENS, "temperature": 1.0, "n": 16,
            "ignore_eos": True, "logprobs": 0}  # fmt: skip

    def one(_) -> list[list[str]]:
        r = HTTP.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return [c["logprobs"]["tokens"] for c in r.json()["choices"]]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return [t for batch in pool.map(one, range(SAMPLES // 16)) for t in batch]


def greedy(url: str, prompts: list[list[int]]):
    """Greedy answers to the prompts, then to each of the first four cut short (the
    decode side's prefix cache has their full blocks: nothing moves)."""
    return [complete(url, p) for p in prompts] + [complete(url, cut(p)) for p in prompts[:4]]


@pytest.mark.parametrize("k", [0, 2])
def test_32_prompts_and_sampled_tokens_through_the_router_are_colocated_decodings(
    prompts32, shallow_model, k
):
    """1 prefill + 1 decode + the router, prompts in chunks of CHUNK tokens: the greedy
    tokens and logprobs of a colocated daemon on 32 held-out prompts (and on 4 prefix-cache
    hits on the decode side), with the same drafts accepted; at k = 2 also T = 1 samples
    whose distribution at every position is the colocated daemon's (chi-square). On the
    shallow copy of the bundled model (conftest.py: what is compared holds for any
    weights), with its MTP layer."""
    # a cache that holds every prompt's blocks (FLAGS's evicts the first ones by the last)
    flags = [f for f in FLAGS if not f.startswith(("--num_speculative", "--max_cache_size"))]
    flags += [f"--num_speculative_tokens={k}", f"--max_tokens_per_batch={CHUNK}",
              "--max_cache_size=64000000", "--model", shallow_model]  # fmt: skip
    with Server(*flags) as s:
        want, want_drafts = greedy(s.url, prompts32), spec_totals(s.url)[:2]
        want_samples = sampled(s.url, prompts32[0]) if k else None
    env = {"XLLM_CLUSTER_TOKEN": TOKEN}
    # another sampler seed than the colocated daemon's: with the same seed and the same
    # batches, the unseeded samples would repeat the colocated ones draw for draw
    flags.append("--seed=1")
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(Server(*flags, "--pd_role=prefill", env=env))
        decode = stack.enter_context(
            Server(*flags, "--pd_role=decode", f"--pd_prefill={prefill.url}", env=env)
        )
        router = stack.enter_context(Server("--pd_role=router", "--pd_decode", decode.url,
                                            "--pd_prefill", prefill.url))  # fmt: skip
        for g, w in zip(greedy(router.url, prompts32), want):
            assert_same(g, w)
        assert spec_totals(decode.url)[:2] == want_drafts  # (0, 0) at k = 0
        # every full block moved once: the cut prompts (and the samples) found them cached
        moved = sum((len(p) - 1) // BLOCK for p in prompts32)
        assert decode.metric("xllm:pd_kv_blocks_total") == moved
        assert decode.metric("xllm:pd_transfer_failures_total") == 0
        if k:
            got_samples = sampled(router.url, prompts32[0])
            for i in range(SAMPLE_TOKENS):
                v = homogeneity([t[i] for t in got_samples], [t[i] for t in want_samples])
                assert v.p_value > ALPHA, f"position {i}: {v}"
            assert got_samples != want_samples  # two samples, not one twice
