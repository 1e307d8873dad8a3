"""The request-field policy, walked row by row from docs/api_fields.md against a live
daemon (MTP on): honoured, ignored and unknown fields answer 200, refused ones a 400 that
names the field; an unknown field is logged once per name. Also continuous usage stats,
truncate_prompt_tokens, /tokenize, /detokenize and /version in vLLM's shapes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from tests.server_utils import Server

DOC = Path(__file__).resolve().parent.parent / "docs" / "api_fields.md"
HI = [{"role": "user", "content": "Hi"}]
BASE = {
    "completions": ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    "chat": ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
}
ROW = re.compile(r"^\| (completions|chat|both) \| `([^`]+)` \| (\w+) \| `(.+)` \| .* \|$")


def table() -> list[tuple[str, str, str, dict]]:
    rows = [m.groups() for line in DOC.read_text().splitlines() if (m := ROW.match(line))]
    return [(ep, field, status, json.loads(ex)) for ep, field, status, ex in rows]


@pytest.fixture(scope="module")
def server():
    with Server("--dtype=float32", "--num_speculative_tokens=1", "--max_model_len=256") as s:
        yield s


def test_the_table_covers_every_declared_field():
    from xllm_py.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest

    documented = {(ep, f) for ep, f, _, _ in table()}
    for ep, model in (("completions", CompletionRequest), ("chat", ChatCompletionRequest)):
        for name in model.model_fields:
            assert (ep, name) in documented or ("both", name) in documented, (ep, name)
    assert len(documented) > 60


def test_every_row_of_the_field_table_is_what_the_server_does(server):
    wrong = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for ep, field, status, example in table():
            for endpoint in ("completions", "chat") if ep == "both" else (ep,):
                path, base = BASE[endpoint]
                r = client.post(path, json={**base, **example})
                param = field.split("[")[0]
                if status == "refused":
                    ok = r.status_code == 400 and r.json()["error"]["param"] == param
                else:
                    ok = r.status_code == 200
                if not ok:
                    wrong.append((endpoint, field, status, r.status_code, r.text[:200]))
    assert not wrong, wrong


def test_an_unknown_field_is_logged_once_by_name(server):
    for _ in range(3):
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 1, "frobnicate_level": 3},
            timeout=60,
        )
        assert r.status_code == 200
    lines = [ln for ln in server.output().splitlines() if "'frobnicate_level'" in ln]
    assert len(lines) == 1 and "WARNING" in lines[0]


def test_a_known_field_with_a_wrong_type_is_still_a_400(server):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Hi", "stream_options": {"include_usage": "yes"}, "stream": True},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server):
    body = {
        "prompt": "Hello",
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = [
            json.loads(ln[6:])
            for ln in r.iter_lines()
            if ln.startswith("data: ") and ln != "data: [DONE]"
        ]
    assert all("usage" in e for e in events)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 6
    prompt = httpx.post(server.url + "/tokenize", json={"prompt": "Hello"}, timeout=60).json()
    assert {e["usage"]["prompt_tokens"] for e in events} == {prompt["count"]}


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    ids = httpx.post(
        server.url + "/tokenize", json={"prompt": "one two three four five six"}, timeout=60
    ).json()["tokens"]

    def complete(prompt, **kw):
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 4, "temperature": 0, **kw},
            timeout=60,
        )
        return r.json()

    cut = complete("one two three four five six", truncate_prompt_tokens=3)
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["text"] == complete(ids[-3:])["choices"][0]["text"]


def test_tokenize_detokenize_and_version(server):
    r = httpx.post(
        server.url + "/tokenize",
        json={"prompt": "Hello world", "return_token_strs": True},
        timeout=60,
    ).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 256
    assert "".join(r["token_strs"]).endswith("world")
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=60).json()
    assert back["prompt"].endswith("Hello world")
    chat = httpx.post(
        server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=60
    ).json()
    served = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        timeout=60,
    ).json()
    assert chat["count"] == served["usage"]["prompt_tokens"]
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(
        server.url + "/tokenize",
        json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
        timeout=60,
    )
    assert both.status_code == 400
    from xllm_py import __version__

    assert httpx.get(server.url + "/version", timeout=10).json() == {"version": __version__}
