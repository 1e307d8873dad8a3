"""The structured-output grammar cache and compile timeout hold on a real daemon
(xllm_py/structured/): the cache stays within
--grammar_cache_bytes however many schemas come; a schema that compiles longer than
--grammar_compile_timeout is a 400 whose compile is stopped, so the next schema compiles at
once and a SIGTERM drain does not wait for it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.grammar_utils import bundled, bundled_matcher, encode
from tests.server_utils import HTTP, Server
from xllm_py import structured
from xllm_py.entrypoints.serve import SHUTDOWN_FLUSH_S
from xllm_py.sampling_params import StructuredOutput

MODEL = "tiny-deepseek-v3-mtp"
CACHE_BYTES = 64 << 10  # about 16 of the small schemas below (each about 4 KB compiled)


def small_schema(i: int) -> dict:
    return {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}


def slow_schema(n: int = 1000, shift: int = 0) -> dict:
    """n pattern-constrained string properties: 1000 take about 18 s to compile here with
    xgrammar 0.2.8 (200 take about 1.6 s)."""
    return {
        "type": "object",
        "properties": {
            f"p{i}": {
                "type": "string",
                "pattern": f"^[a-z]{{{(i + shift) % 7 + 1},{i % 11 + 8}}}[0-9]{{2,5}}$",
            }
            for i in range(n)
        },
    }


def post(server, **body) -> httpx.Response:
    return HTTP.post(server.url + "/v1/completions", json=body, timeout=120)


def test_a_matcher_keeps_working_after_its_grammar_is_evicted():
    so = StructuredOutput("json", json.dumps(small_schema(1)))
    m = bundled_matcher(so)
    try:
        structured.set_cache_limit(0)
        assert structured.cache_stats()["entries"] == 0
        assert all(m.accept(t) for t in encode('{"k1": 42}'))
        assert m.accept(bundled()[1].eos_token_ids[0]) and m.terminated
        assert not bundled_matcher(so).accept(encode("x")[0])  # compiled again, same grammar
    finally:
        structured.set_cache_limit(structured.DEFAULT_CACHE_BYTES)


TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def server():
    """A daemon with a small grammar cache and a short compile timeout."""
    flags = (f"--grammar_cache_bytes={CACHE_BYTES}", f"--grammar_compile_timeout={TIMEOUT_S:g}")
    with Server("--dtype=float32", *flags) as s:
        yield s


def test_100_schemas_leave_the_grammar_cache_within_its_bytes(server):
    """Six times what the cache holds, one after another: it evicts to stay within its
    bytes, and a schema it evicted compiles again."""
    s = server
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    assert s.metric("xllm:grammar_cache_limit_bytes") == CACHE_BYTES
    for i in range(100):
        r = client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=1, temperature=0,
            extra_body={"guided_json": small_schema(i)},
        )  # fmt: skip
        assert r.choices[0].finish_reason in ("length", "stop")
        if i % 25 == 24:
            assert 0 < s.metric("xllm:grammar_cache_bytes") <= CACHE_BYTES
    cached = s.metric("xllm:grammar_cache_bytes")
    entries = s.metric("xllm:grammar_cache_entries")
    evicted = s.metric("xllm:grammar_cache_evictions_total")
    assert 0 < cached <= CACHE_BYTES and 1 < entries < 100 and evicted >= 100 - entries
    # the daemon still serves, an evicted schema (the first) included: compiled again
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=24,
        temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "first", "schema": small_schema(0), "strict": True}},
    )  # fmt: skip
    if chat.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(chat.choices[0].message.content), small_schema(0))
    assert s.metric("xllm:grammar_cache_bytes") <= CACHE_BYTES


def children(pid: int) -> set[int]:
    """The processes `pid` started (Linux)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def test_a_runaway_compile_is_stopped_at_its_timeout_and_holds_up_no_one(server):
    """A schema that compiles for about 18 s, under --grammar_compile_timeout=4: a 400 after
    about 4 s, refused at once when it comes again; then another schema compiles (in a
    fresh compile process) and is served."""
    s, timeout = server, TIMEOUT_S
    base = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    assert post(s, **base, guided_regex="[a-z]{2}").status_code == 200  # compiler started
    t0 = time.monotonic()
    r = post(s, **base, guided_json=slow_schema())
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_json"
    assert "--grammar_compile_timeout" in r.json()["error"]["message"]
    # the product's promise: answered at the timeout, not after the ~18 s compile
    assert timeout <= took < timeout + 8, took
    assert s.metric("xllm:grammar_compile_timeouts_total") == 1
    # the same schema again: refused without compiling it again (no second timeout)
    assert post(s, **base, guided_json=slow_schema()).status_code == 400
    assert s.metric("xllm:grammar_compile_timeouts_total") == 1
    # a different schema compiles within its own timeout (else it would be a 400 too)
    ok = post(s, **{**base, "max_tokens": 12}, guided_json=small_schema(100_007))
    assert ok.status_code == 200, ok.text
    assert s.metric("xllm:grammar_compile_timeouts_total") == 1


def test_a_sigterm_drain_does_not_wait_for_a_compile():
    """With --grammar_compile_timeout=60, SIGTERM while a schema compiles (for about 18 s):
    the daemon exits 0 within --shutdown_timeout and the last responses' flush, and its
    compile process does not outlive it."""
    shutdown = 1.0
    s = Server(
        "--dtype=float32", "--grammar_compile_timeout=60", f"--shutdown_timeout={shutdown:g}"
    )
    try:
        base = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
        assert post(s, **base, guided_regex="[a-z]{2}").status_code == 200  # compiler started
        kids = children(s.proc.pid)
        assert kids
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, s, **base, guided_json=slow_schema())
            wait_until(
                lambda: s.metric("xllm:grammar_compiles_running") == 1, 30, "a compile running"
            )
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            bound = shutdown + SHUTDOWN_FLUSH_S + 8  # (the compile alone takes about 18 s)
            try:
                s.proc.wait(bound)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"SIGTERM: still running after {bound} s") from None
            assert s.proc.returncode == 0, s.output()
            print(f"drained in {time.monotonic() - t0:.1f} s")
            with contextlib.suppress(httpx.HTTPError):  # an error answer or a closed socket
                assert pending.result().status_code >= 400
        wait_until(lambda: not any(alive(k) for k in kids), 5, "the compile process exited")
    finally:
        s.stop()
