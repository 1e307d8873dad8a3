"""Per-request fault isolation in the real daemon (MTP on): a fault in one request's own
work fails that request with a 500 in OpenAI's shape and frees its blocks, while the
requests beside it finish with the output they have on their own; a fault in the shared
step still fails everything and the daemon exits 1. Faults come from the documented hook
XLLM_FAULT_INJECT (xllm_py/engine/faults.py), armed only with --enable_test_hooks=true:
without it the variable does nothing and the marker is an ordinary prompt."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from tests.server_utils import HTTP, Server

MARKER = "FAULT-HERE"
HOOKS = "--enable_test_hooks=true"
PROMPTS = [
    f"<|bos|><|user|>\nTell me about topic {i} in a few words.\n<|assistant|>\n" for i in range(8)
]
FAULTY = f"<|bos|><|user|>\n{MARKER} please.\n<|assistant|>\n"


async def _stream(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, list[dict]]:
    body = {
        "prompt": prompt,
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    text, events = "", []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            if "choices" in event:
                text += "".join(c["text"] for c in event["choices"])
    return text, events


async def _run_all(url: str, prompts: list[str]) -> list[tuple[str, list[dict]]]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(_stream(client, url, p) for p in prompts))


@pytest.fixture(scope="module")
def server():
    with Server(
        "--dtype=float32",
        "--num_speculative_tokens=1",
        HOOKS,
        env={"XLLM_FAULT_INJECT": f"output:{MARKER}"},
    ) as s:
        yield s


def test_the_armed_hook_is_announced_at_start_up(server):
    assert "WARNING" in server.output() and "test hook armed: XLLM_FAULT_INJECT" in server.output()


def test_without_enable_test_hooks_the_variable_does_nothing():
    with Server(
        "--dtype=float32", "--num_speculative_tokens=1", env={"XLLM_FAULT_INJECT": f"step:{MARKER}"}
    ) as s:
        [(text, events)] = asyncio.run(_run_all(s.url, [FAULTY]))
        assert events[-1]["choices"][0]["finish_reason"] == "length" and text
        assert HTTP.get(s.url + "/health", timeout=10).status_code == 200
        assert s.proc.poll() is None
        assert "test hook armed" not in s.output() and "InjectedFault" not in s.output()


def test_one_faulty_request_fails_alone_and_the_others_keep_their_output(server):
    alone = [t for t, _ in asyncio.run(_run_all(server.url, PROMPTS))]
    results = asyncio.run(_run_all(server.url, [*PROMPTS[:4], FAULTY, *PROMPTS[4:]]))
    together = [t for t, _ in results[:4] + results[5:]]
    assert together == alone
    for _, events in results[:4] + results[5:]:
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    # the faulty stream ends with an error event in OpenAI's shape
    err = results[4][1][-1]["error"]
    assert err["type"] == "server_error" and "request" in err["message"]
    assert "InjectedFault" in err["message"]
    # the same fault without streaming: a 500 in OpenAI's shape
    r = HTTP.post(
        server.url + "/v1/completions", json={"prompt": FAULTY, "max_tokens": 8}, timeout=60
    )
    assert r.status_code == 500
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # its blocks were freed and nothing is left running; the engine still serves
    gauges = server.settle(30.0)
    assert gauges["kv_cache_usage"] == 0
    assert gauges["running"] == 0
    assert server.metric("xllm:request_success_total", finished_reason="error") == 2
    again = asyncio.run(_run_all(server.url, PROMPTS[:1]))[0][0]
    assert again == alone[0]
    assert HTTP.get(server.url + "/health", timeout=10).status_code == 200


def test_a_fault_in_the_shared_step_fails_every_request_and_exits_1():
    s = Server(
        "--dtype=float32",
        "--num_speculative_tokens=1",
        HOOKS,
        env={"XLLM_FAULT_INJECT": f"step:{MARKER}"},
    )
    try:
        results = asyncio.run(_run_all(s.url, [PROMPTS[0], FAULTY]))
        for _, events in results:
            assert events[-1]["error"]["type"] == "server_error"
        s.proc.wait(60)
        assert s.proc.returncode == 1
    finally:
        s.stop()


def test_a_client_gone_before_its_body_arrived_is_not_a_server_error(server):
    """Found by perf/soak.py: a disconnect while the body was still being read was logged
    as a failed request (two tracebacks); it is a normal disconnect."""
    body = b'{"prompt": "Hello", "max_tokens": 4}'
    before = server.output().count("Traceback")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as c:
            c.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (len(body) + 10) + body  # 10 bytes short
            )
            c.shutdown(socket.SHUT_WR)  # the client is gone before its body arrived
            # The server saw it go: it closes the connection without an answer (recv waits
            # for that, up to the timeout). The handler reading the body wakes on the same
            # event, in the server's next loop iteration.
            assert c.recv(1024) == b""
    # A request on a new connection is served by that same event loop after those wake-ups.
    assert HTTP.get(server.url + "/health", timeout=10).status_code == 200
    assert server.output().count("Traceback") == before
