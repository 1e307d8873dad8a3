"""The REST daemon, end to end: a real `python -m xllm_py` process on a loopback
port, the official `openai` client, raw HTTP for the bad-input matrix."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import openai
import pytest

from tests.server_utils import HTTP, Server, assert_spec_counted, spec_totals
from xllm_py import LLM, SamplingParams

PROMPTS = [
    "<|bos|><|user|>\nHow do I reverse a list in Python?\n<|assistant|>\n",
    "<|bos|><|user|>\nWrite a short poem about the sea.\n<|assistant|>\n",
    "<|bos|><|user|>\nWhat is the capital of France?\n<|assistant|>\n",
]
KEY = "test-secret"
MAX_LEN = 512
MODEL = "tiny-deepseek-v3-mtp"
# A request that cannot end on its own while a test looks at it: the whole context of
# generation (ignore_eos): a thousand engine steps or more on any machine.
LONG_PROMPT = [0, 100, 200, 300]
CONTEXT = 2048  # the bundled model's max_position_embeddings
LONG = {"prompt": LONG_PROMPT, "max_tokens": CONTEXT - len(LONG_PROMPT), "ignore_eos": True}


@pytest.fixture(scope="module")
def mtp_server():
    with Server(
        "--dtype", "float32", "--num_speculative_tokens=2", "--speculative_adaptive=true"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def plain_server():
    """MTP off, with an API key, small limits and strict request fields for the abuse
    tests."""
    with Server(
        "--dtype=float32",
        f"--api_key={KEY}",
        "--max_concurrent_requests=2",
        "--max_request_body_bytes=65536",
        f"--max_model_len={MAX_LEN}",
        "--enable_prefix_cache=false",
        "--strict_request_fields=true",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def offline_greedy():
    llm = LLM(dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    return [o.outputs[0].text for o in outs]


def client(server: Server, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.mark.parametrize("which", ["mtp_server", "plain_server"])
def test_greedy_completion_equals_offline_api(request, which, offline_greedy):
    server = request.getfixturevalue(which)
    c = client(server, KEY)
    got = [
        c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    assert got == offline_greedy


def test_chat_and_streaming_with_usage(mtp_server):
    c = client(mtp_server)
    model = c.models.list().data[0].id
    msgs = [{"role": "user", "content": "Tell me about the moon."}]
    before = spec_totals(mtp_server.url)
    full = c.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 20 and full.choices[0].finish_reason == "length"
    # usage.speculative: this request's drafts (adaptive k may be 0 throughout), as counted
    mid = spec_totals(mtp_server.url)
    assert_spec_counted(full.usage.speculative, before, mid)
    stream = c.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert_spec_counted(chunks[-1].usage.speculative, mid, spec_totals(mtp_server.url))
    # completions stream: same text as the non-streamed call
    one = c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    parts = c.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == one.choices[0].text


def test_seeded_sampling_repeats_and_n_choices(mtp_server):
    c = client(mtp_server)
    model = c.models.list().data[0].id

    def sample(seed):
        r = c.completions.create(
            model=model, prompt=PROMPTS[1], max_tokens=24, temperature=1.0, seed=seed, n=2
        )
        return [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]

    a, b, other = sample(7), sample(7), sample(8)
    assert a == b
    assert a != other
    assert a[0] != a[1]  # n choices are different samples


def test_batch_prompts_token_ids_logprobs_and_stop(mtp_server):
    c = client(mtp_server)
    model = c.models.list().data[0].id
    ids = LLM(dtype="float32").get_tokenizer().encode(PROMPTS[2])
    r = c.completions.create(
        model=model, prompt=[PROMPTS[2], PROMPTS[0]], max_tokens=8, temperature=0, logprobs=2
    )
    assert [ch.index for ch in r.choices] == [0, 1]
    by_ids = c.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == by_ids.choices[0].text  # text and token ids of one prompt agree
    assert r.choices[1].text != r.choices[0].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 8 and len(lp.token_logprobs) == 8
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) >= 2 for t in lp.top_logprobs)
    chat = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 5 and all(len(e.top_logprobs) == 3 for e in entries)
    # a stop string cuts the text exactly where the non-stopped text has it
    base = c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    word = base.choices[0].text.split()[3]
    cut = c.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[word]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base.choices[0].text[: base.choices[0].text.index(word)]


def test_models_health_openapi(mtp_server):
    models = HTTP.get(mtp_server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny-deepseek-v3-mtp"
    assert HTTP.get(mtp_server.url + "/health").json() == {"status": "ok"}
    paths = HTTP.get(mtp_server.url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/metrics"} <= set(paths)


def test_prometheus_metrics_after_traffic(mtp_server):
    c = client(mtp_server)
    model = c.models.list().data[0].id
    c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    text = HTTP.get(mtp_server.url + "/metrics").text
    for name in [
        "xllm:num_requests_running",
        "xllm:num_requests_waiting",
        "xllm:kv_cache_usage_perc",
        "xllm:num_preemptions_total",
        "xllm:prompt_tokens_total",
        "xllm:generation_tokens_total",
        "xllm:request_success_total",
        "xllm:time_to_first_token_seconds_bucket",
        "xllm:inter_token_latency_seconds_bucket",
        "xllm:e2e_request_latency_seconds_bucket",
        "xllm:request_queue_time_seconds_bucket",
        "xllm:request_prefill_time_seconds_bucket",
        "xllm:spec_decode_num_drafts_total",
        "xllm:spec_decode_num_draft_tokens_total",
        "xllm:spec_decode_num_accepted_tokens_total",
        "xllm:spec_decode_num_accepted_tokens_per_pos_total",
        "xllm:spec_decode_num_cut_draft_tokens_total",
        "xllm:spec_decode_num_undrafted_steps_total",
        "xllm:spec_decode_adaptive_k",
        "xllm:spec_decode_adaptive_steps_total",
        "xllm:spec_decode_request_acceptance_rate_bucket",
    ]:
        assert f"\n{name}{{" in text, name
    assert "# HELP xllm:spec_decode_num_drafts_total Verification passes" in text
    assert mtp_server.metric("xllm:spec_decode_num_drafts_total") > 0
    assert mtp_server.metric("xllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert mtp_server.metric("xllm:spec_decode_adaptive_k", replica="0") in (0, 1, 2)
    assert mtp_server.metric("xllm:spec_decode_adaptive_steps_total", k="2") > 0
    # per-request acceptance rates in [0, 1]: every finished request is in the le="1.0" bucket
    rates = "xllm:spec_decode_request_acceptance_rate"
    finished = mtp_server.metric(rates + "_count")
    assert finished >= 1 and mtp_server.metric(rates + "_bucket", le="1.0") == finished
    assert mtp_server.metric("xllm:request_success_total", finished_reason="length") >= 1
    assert mtp_server.metric("xllm:generation_tokens_total") >= 12


def _raw(server, path, body, headers=None, method="POST"):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"} | (headers or {})
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HTTP.request(method, server.url + path, content=data, headers=h, timeout=60)


P = "Hello there"
BAD_INPUTS = [
    # (path, body, expected status, param or None)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": P, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": P, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": P, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": P, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": P, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": P, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": P, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": P, "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": P, "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": P, "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": P, "logprobs": 100}, 400, "logprobs"),
    ("/v1/completions", {"prompt": P, "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": P, "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": P, "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": P, "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": P, "max_tokenz": 5}, 400, "max_tokenz"),
    # out of the engine's integer ranges: refused here, never a crash in the engine thread
    ("/v1/completions", {"prompt": P, "top_k": 2**64}, 400, "top_k"),
    ("/v1/completions", {"prompt": P, "seed": 2**63 - 1, "n": 2}, 400, "seed"),
    ("/v1/completions", {"prompt": P, "min_tokens": 5 * 10**9}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": P, "n": 3}, 400, "n"),  # > --max_concurrent_requests=2
    ("/v1/completions", {"prompt": P, "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": P, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": P, "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": P, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": P, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": P, "echo": True, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": P, "max_tokens": 0}, 400, "max_tokens"),  # without echo
    ("/v1/completions", {"prompt": P, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (
        "/v1/completions",
        {"prompt": [1] * (MAX_LEN + 1), "max_tokens": 0, "echo": True},
        400,
        "prompt",
    ),
    ("/v1/completions", {"prompt": P, "stream_options": {"include_usage": True}}, 400, "stream"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * MAX_LEN}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * 100, "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": P, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools",
    ),
    ("/v1/completions", {"prompt": "x" * 70000}, 413, None),
]


def test_bad_input_matrix(plain_server):
    for path, body, status, param in BAD_INPUTS:
        r = _raw(plain_server, path, body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], body
        if param is not None:
            assert err["param"] == param, (body, err)
    r = _raw(plain_server, "/v1/nowhere", {}, method="GET")
    assert r.status_code == 404 and r.json()["error"]["message"]
    # and the server keeps serving
    ok = _raw(plain_server, "/v1/completions", {"prompt": P, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert "speculative" not in ok.json()["usage"]  # MTP off


def test_api_key(plain_server):
    body = {"prompt": P, "max_tokens": 2}
    assert _raw(plain_server, "/v1/completions", body, {"Authorization": ""}).status_code == 401
    wrong = _raw(plain_server, "/v1/completions", body, {"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(plain_server, "nope").models.list()
    assert client(plain_server, KEY).models.list().data
    assert HTTP.get(plain_server.url + "/health").status_code == 200  # probes need no key


def test_too_many_requests(plain_server):
    """--max_concurrent_requests=2: a third request while two stream is refused with 429."""

    async def run():
        h = {"Authorization": f"Bearer {KEY}"}
        # whole-context streams: still running when the third request comes, by construction
        body = {"prompt": LONG_PROMPT, "max_tokens": MAX_LEN - len(LONG_PROMPT)}
        body |= {"stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=plain_server.url, headers=h, timeout=60) as ac:
            async with ac.stream("POST", "/v1/completions", json=body) as r1:
                async with ac.stream("POST", "/v1/completions", json=body) as r2:
                    lines1, lines2 = r1.aiter_lines(), r2.aiter_lines()  # (dropping one closes)
                    await anext(lines1)
                    await anext(lines2)
                    r3 = await ac.post("/v1/completions", json={"prompt": P, "max_tokens": 2})
                    assert r3.status_code == 429
                    assert r3.json()["error"]["type"] == "rate_limit_error"

    asyncio.run(run())
    deadline = time.monotonic() + 30  # the two abandoned streams are aborted, then it serves
    while time.monotonic() < deadline:
        r = _raw(plain_server, "/v1/completions", {"prompt": P, "max_tokens": 2})
        if r.status_code == 200:
            break
        time.sleep(0.2)
    assert r.status_code == 200


def in_engine(server: Server) -> float:
    return server.metric("xllm:num_requests_running") + server.metric("xllm:num_requests_waiting")


def wait_for(what: str, cond, timeout: float = 60.0) -> None:
    """Poll cond() until it holds; the deadline only guards against a hang."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


def sse_events(lines) -> tuple[list[dict], bool]:
    """The JSON events of an SSE stream and whether it ended with [DONE]."""
    events, done = [], False
    for ln in lines:
        if ln.startswith("data: "):
            if ln == "data: [DONE]":
                done = True
            else:
                events.append(json.loads(ln[6:]))
    return events, done


def _settled(server: Server, timeout: float = 60.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        running = server.metric("xllm:num_requests_running")
        waiting = server.metric("xllm:num_requests_waiting")
        usage = server.metric("xllm:kv_cache_usage_perc")
        if (running == 0 and waiting == 0 and usage == 0) or time.monotonic() > deadline:
            return running + waiting, usage
        time.sleep(0.2)


def test_disconnects_free_everything(mtp_server):
    """50 streaming requests dropped at random points, then 5 non-streaming ones dropped
    while they run: afterwards nothing runs and every KV block is free."""
    rng = random.Random(0)

    async def one(ac, i):
        body = {
            "prompt": PROMPTS[i % 3] * (1 + i % 4),
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.5,
        }
        stop_after = rng.randrange(0, 30)
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if n >= stop_after:
                    break

    async def streams():
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=mtp_server.url, timeout=120, limits=limits) as ac:
            await asyncio.gather(*[one(ac, i) for i in range(50)])

    async def dropped_while_running(n):
        # whole-context requests: still running when their clients go, by construction
        async with httpx.AsyncClient(base_url=mtp_server.url, timeout=120) as ac:
            posts = [asyncio.create_task(ac.post("/v1/completions", json=LONG)) for _ in range(n)]
            deadline = time.monotonic() + 60  # guards against a hang only
            while await asyncio.to_thread(in_engine, mtp_server) < n:
                assert time.monotonic() < deadline and not any(p.done() for p in posts)
                await asyncio.sleep(0.05)
            for p in posts:
                p.cancel()
            await asyncio.gather(*posts, return_exceptions=True)

    def aborted() -> float:
        return mtp_server.metric("xllm:request_success_total", finished_reason="abort")

    before = aborted()
    asyncio.run(streams())
    assert _settled(mtp_server) == (0, 0)
    after_streams = aborted()
    assert after_streams - before >= 40  # most were cut before their 200 tokens
    asyncio.run(dropped_while_running(5))
    assert _settled(mtp_server) == (0, 0)
    assert aborted() - after_streams == 5
    ok = client(mtp_server).completions.create(
        model=MODEL, prompt=P, max_tokens=3, extra_body={"ignore_eos": True}
    )  # (sampled: without ignore_eos it may end at EOS before 3 tokens)
    assert ok.usage.completion_tokens == 3


def test_sigterm_drains_503_until_in_flight_requests_end_then_exits_zero():
    """After SIGTERM, while requests are in flight: /health is 503 "draining", new requests
    are refused with 503, a running request still finishes normally; once the last one has
    ended (here: its client leaves) the daemon exits 0 by itself. Draining lasts by
    construction: a whole-context request keeps it going until the test drops it, and
    --shutdown_timeout is far longer than the test."""
    server = Server("--shutdown_timeout=600")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as long_r:
            long_lines = long_r.iter_lines()
            next(long_lines)  # it runs
            short = {"prompt": P, "max_tokens": 40, "stream": True, "ignore_eos": True}
            with c.stream("POST", "/v1/completions", json=short) as short_r:
                short_lines = short_r.iter_lines()
                first = next(short_lines)
                server.proc.send_signal(signal.SIGTERM)
                health = HTTP.get(server.url + "/health", timeout=10)
                assert health.status_code == 503 and health.json() == {"status": "draining"}
                refused = HTTP.post(server.url + "/v1/completions", json={"prompt": P}, timeout=10)
                assert refused.status_code == 503
                assert "shutting down" in refused.json()["error"]["message"]
                assert in_engine(server) >= 1  # the 503s were answered while requests ran
                events, done = sse_events([first, *short_lines])
            assert done and events[-1]["choices"][0]["finish_reason"] == "length"  # not cut
            assert server.proc.poll() is None  # the long request still holds the drain
        # the long request's client left: it is aborted, nothing is in flight
        assert server.proc.wait(60) == 0
    assert "Traceback" not in server.output()
    server.stop()


def test_sigterm_aborts_requests_that_outlive_shutdown_timeout():
    """--shutdown_timeout=1 and two whole-context requests in flight at SIGTERM: after the
    timeout both end with an error naming it (the stream as an SSE error event, then
    [DONE]; the plain request as a 503), and the daemon exits 0."""
    import threading

    server = Server("--shutdown_timeout=1")
    plain: dict = {}
    t = threading.Thread(
        target=lambda: plain.setdefault(
            "r", HTTP.post(server.url + "/v1/completions", json=LONG, timeout=120)
        )
    )
    with HTTP.stream(
        "POST", server.url + "/v1/completions", json=LONG | {"stream": True}, timeout=120
    ) as r:
        lines = r.iter_lines()
        first = next(lines)
        t.start()
        wait_for("both requests to run", lambda: in_engine(server) == 2)
        server.proc.send_signal(signal.SIGTERM)
        events, done = sse_events([first, *lines])
    t.join(120)
    assert done
    err = events[-1]["error"]
    assert err["type"] == "server_error" and "--shutdown_timeout=1" in err["message"], err
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    r = plain["r"]
    assert r.status_code == 503, r.text
    assert "--shutdown_timeout=1" in r.json()["error"]["message"]
    assert server.proc.wait(60) == 0
    assert "Traceback" not in server.output()
    server.stop()


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--enable_mla=false"], "--enable_mla"),
        (["--devices=cpu", "--draft_devices=cuda:0"], "--draft_devices"),
        (["--nnodes=2"], "--nnodes"),
        (["--num_speculative_tokens=-1"], "--num_speculative_tokens"),
        (["--enable_prefix_cache=maybe"], "--enable_prefix_cache"),
        (["--model=/nonexistent/ckpt"], "/nonexistent/ckpt"),
        (["--draft_model=/tmp", "--num_speculative_tokens=0"], "draft_model"),
    ],
)
def test_bad_flags_fail_at_start(flags, needle):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "xllm_py", *flags], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_help_explains_every_flag():
    from xllm_py.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, action.dest
    names = {s for a in parser._actions for s in a.option_strings}
    for flag in [
        "--model", "--devices", "--host", "--port", "--master_node_addr", "--nnodes",
        "--node_rank", "--draft_model", "--draft_devices", "--num_speculative_tokens",
        "--max_memory_utilization", "--max_cache_size", "--max_tokens_per_batch",
        "--max_seqs_per_batch", "--enable_mla", "--block_size", "--ep_size", "--dp_size",
        "--enable_prefix_cache", "--enable_chunked_prefill", "--max_concurrent_requests",
        "--api_key", "--served_model_name", "--dtype",
    ]:  # fmt: skip
        assert flag in names, flag


class InProcessServer:
    """The daemon on a thread of this process (cli.build_server + cli.run), so a test can
    patch the engine; `stop()` ends it as SIGTERM would."""

    def __init__(self, *flags: str) -> None:
        import threading

        from tests.server_utils import eager_unless_asked, free_port, wait_healthy
        from xllm_py import cli

        self.port, self.result = free_port(), {}
        self.url = f"http://127.0.0.1:{self.port}"
        args = cli.build_parser().parse_args(
            ["--port", str(self.port), "--dtype=float32", *eager_unless_asked(flags)]
        )
        self.server, engine = cli.build_server(args)
        self.thread = threading.Thread(
            target=lambda: self.result.setdefault("rc", cli.run(self.server, engine)), daemon=True
        )
        self.thread.start()
        if not wait_healthy(self.url, lambda: None, 120):
            raise RuntimeError("in-process server did not come up")

    def exit_code(self, timeout: float = 60) -> int | None:
        self.thread.join(timeout)
        return self.result.get("rc")

    def stop(self) -> int | None:
        self.server.should_exit = True
        return self.exit_code()


def test_engine_failure_fails_requests_and_exits_nonzero(monkeypatch):
    """A step that raises: the in-flight stream gets an error event and [DONE], /health turns
    503, and the daemon exits 1 instead of hanging."""
    from xllm_py.engine.llm_engine import LLMEngine

    real_step, calls = LLMEngine.step, {"n": 0}

    def failing_step(self):
        calls["n"] += 1
        if calls["n"] > 4:
            raise RuntimeError("device lost (injected by the test)")
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", failing_step)
    server = InProcessServer()
    body = {"prompt": P, "max_tokens": 50, "stream": True, "ignore_eos": True}
    with HTTP.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert "device lost" in err["message"] and err["type"] == "server_error"
    health = HTTP.get(server.url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert server.exit_code() == 1


def test_health_answers_while_a_step_runs(monkeypatch):
    """The engine runs on its own thread: while a step is stuck (here: a step that waits
    for the test's signal), /health and /metrics still answer. (MTP on, usage.speculative
    turned off: the answer's usage has no such key.)"""
    import threading

    from xllm_py.engine.llm_engine import LLMEngine

    real_step, in_step, release = LLMEngine.step, threading.Event(), threading.Event()

    def slow_step(self):
        if self.has_unfinished() and not release.is_set():
            in_step.set()
            release.wait(60)
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", slow_step)
    server = InProcessServer("--num_speculative_tokens=1", "--report_speculative_usage=false")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        done = {}
        t = threading.Thread(
            target=lambda: done.setdefault(
                "r", c.post("/v1/completions", json={"prompt": P, "max_tokens": 4})
            )
        )
        t.start()
        assert in_step.wait(30)
        assert HTTP.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
        metrics = HTTP.get(server.url + "/metrics", timeout=10).text
        assert "xllm:num_requests_running" in metrics
        assert "r" not in done  # the step really was still in progress
        release.set()
        t.join(60)
    assert done["r"].json()["usage"]["completion_tokens"] == 4
    assert "speculative" not in done["r"].json()["usage"]
    assert server.stop() == 0
