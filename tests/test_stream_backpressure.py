"""A streaming client that stops reading, against a real daemon (MTP on): the daemon's
memory stays flat while it is stalled, other clients are served meanwhile, and after
--stream_stall_timeout its request is aborted (its blocks freed, one log line).

The stalled client is a raw socket with a small receive buffer that never reads after
sending its request: a chat completion of eight choices of 900 tokens each, every token
with its top-20 logprobs (about 1.6 KB a token, 11-12 MB in all). That is more than the
kernel's socket buffers (the sender's grows to about 2.5 MB on loopback, as measured
here) and uvicorn's write buffer hold, so the server's sends really block; eight choices
fill them in a fraction of the engine steps two would. The test
checks that they did: the requests are aborted by the engine (`finished_reason="abort"`,
counted only for a request still running) and what the client finally reads ends with
the stall error.
"""

from __future__ import annotations

import json
import socket
import time

import openai
import pytest

from tests.server_utils import Server

STALL_S = 3
CHOICES = 8
MAX_TOKENS = 900  # + the prompt: within --max_model_len=1024
PROMPT = "<|bos|><|user|>\nTell me a long story about the sea.\n<|assistant|>\n"
RSS_SLACK_MB = 50


@pytest.fixture(scope="module")
def server():
    with Server(
        "--dtype=float32",
        "--num_speculative_tokens=2",
        "--max_model_len=1024",
        f"--max_cache_size={64 << 20}",  # 151 blocks: room for the whole answer and another
        f"--stream_stall_timeout={STALL_S}",
    ) as s:
        yield s


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def stalled_stream(server: Server, path: str, body: dict) -> socket.socket:
    """Send a streaming request on a raw socket with a small receive buffer, and read
    nothing: the caller reads (or closes) it later."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    while b"data: [DONE]" not in b"".join(chunks[-2:]):
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_stalled_stream_holds_no_memory_and_is_aborted(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    pid = server.proc.pid

    def other_answer() -> int:
        r = c.completions.create(
            model="tiny-deepseek-v3-mtp",
            prompt=PROMPT,
            max_tokens=200,
            logprobs=20,
            extra_body={"ignore_eos": True},
        )
        return r.usage.completion_tokens

    assert other_answer() == 200  # warm-up: what any request allocates once
    idle = rss_mb(pid)
    aborted = server.metric("xllm:request_success_total", finished_reason="abort")
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
        "max_tokens": MAX_TOKENS,
        "n": CHOICES,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 20,
    }
    sock = stalled_stream(server, "/v1/chat/completions", body)
    try:
        peak = idle
        # while that client reads nothing, another one is served in full
        assert other_answer() == 200
        peak = max(peak, rss_mb(pid))
        deadline = time.monotonic() + 240  # guards against a hang only
        while (
            server.metric("xllm:request_success_total", finished_reason="abort") < aborted + CHOICES
        ):
            assert time.monotonic() < deadline, "the stalled stream was never aborted"
            peak = max(peak, rss_mb(pid))
            time.sleep(0.2)
        generated = server.metric("xllm:generation_tokens_total")
        while server.metric("xllm:num_requests_running") != 0:
            assert time.monotonic() < deadline, "the aborted request still runs"
            time.sleep(0.2)
        assert server.settle(30.0)["kv_cache_usage"] == 0
        # what the stalled client gets when it reads at last: part of the answer, then the
        # reason it ended
        raw = read_all(sock, 30).decode(errors="replace")
    finally:
        sock.close()
    events = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "stream_stalled"
    chunks = [json.loads(e)["choices"][0] for e in events[:-2]]
    received = sum(len(ch["logprobs"]["content"]) for ch in chunks if ch["logprobs"])
    assert 0 < received < CHOICES * MAX_TOKENS
    logged = [ln for ln in server.output().splitlines() if "--stream_stall_timeout" in ln]
    assert len(logged) == 1, logged
    print(
        f"idle RSS {idle:.1f} MB, peak while stalled {peak:.1f} MB (+{peak - idle:.1f}); "
        f"stalled client received {received} tokens ({len(raw)} bytes); generation tokens "
        f"so far {generated:.0f}"
    )
    assert peak - idle < RSS_SLACK_MB
