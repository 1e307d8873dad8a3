"""The request-field policy, walked row by row from docs/api_fields.md against a live
daemon (MTP on): honoured, ignored and unknown fields answer 200, refused ones a 400 that
names the field; an unknown field is logged once per name. Also continuous usage stats,
truncate_prompt_tokens, echo, prompt_logprobs, max_tokens 0, /tokenize, /detokenize and
/version in vLLM's shapes, and usage.speculative against /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_utils import HTTP, Server, assert_spec_counted, spec_totals

DOC = Path(__file__).resolve().parent.parent / "docs" / "api_fields.md"
HI = [{"role": "user", "content": "Hi"}]
BASE = {
    "completions": ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    "chat": ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    "messages": ("/v1/messages", {"messages": HI, "max_tokens": 2}),
}
ROW = re.compile(
    r"^\| (completions|chat|both|responses|messages) \| `([^`]+)` \| (\w+) \| `(.+)` \| .* \|$"
)


def table() -> list[tuple[str, str, str, dict]]:
    rows = [m.groups() for line in DOC.read_text().splitlines() if (m := ROW.match(line))]
    return [(ep, field, status, json.loads(ex)) for ep, field, status, ex in rows]


@pytest.fixture(scope="module")
def server():
    with Server(
        "--dtype=float32",
        "--num_speculative_tokens=1",
        "--max_model_len=256",
        "--tool_call_parser=deepseek_v3",
        "--enable_auto_tool_choice",
    ) as s:
        yield s


def test_the_table_covers_every_declared_field():
    from xllm_py.entrypoints.messages import MessagesRequest
    from xllm_py.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
    from xllm_py.entrypoints.responses import ResponsesRequest

    documented = {(ep, f) for ep, f, _, _ in table()}
    models = (("completions", CompletionRequest), ("chat", ChatCompletionRequest),
              ("responses", ResponsesRequest), ("messages", MessagesRequest))  # fmt: skip
    for ep, model in models:
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
                if status == "refused":  # OpenAI's error names it in `param`, Anthropic's in text
                    err = r.json()["error"]
                    named = err.get("param") == param or f"{param}" in err.get("message", "")
                    ok = r.status_code == 400 and named
                else:
                    ok = r.status_code == 200
                if not ok:
                    wrong.append((endpoint, field, status, r.status_code, r.text[:200]))
    assert not wrong, wrong


def test_an_unknown_field_is_logged_once_by_name(server):
    for _ in range(3):
        r = HTTP.post(
            server.url + "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 1, "frobnicate_level": 3},
            timeout=60,
        )
        assert r.status_code == 200
    lines = [ln for ln in server.output().splitlines() if "'frobnicate_level'" in ln]
    assert len(lines) == 1 and "WARNING" in lines[0]


def test_a_known_field_with_a_wrong_type_is_still_a_400(server):
    r = HTTP.post(
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
    with HTTP.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = [
            json.loads(ln[6:])
            for ln in r.iter_lines()
            if ln.startswith("data: ") and ln != "data: [DONE]"
        ]
    assert all("usage" in e for e in events)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 6
    prompt = HTTP.post(server.url + "/tokenize", json={"prompt": "Hello"}, timeout=60).json()
    assert {e["usage"]["prompt_tokens"] for e in events} == {prompt["count"]}
    drafted = [e["usage"]["speculative"]["draft_tokens"] for e in events]  # MTP is on
    assert drafted == sorted(drafted)


def test_usage_speculative_is_what_the_metrics_counted(server):
    """With MTP on, usage.speculative of a whole answer, of a stream's usage chunk and of n
    choices (summed) holds the draft tokens the engine verified for it and how many it
    accepted, as /metrics counted them; each finished request that had drafts adds one
    entry to the per-request acceptance-rate histogram."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    msgs = [{"role": "user", "content": "Tell me about the moon."}]
    ask = {"model": model, "max_tokens": 24, "temperature": 0}

    def streamed():
        opts = {"include_usage": True}
        chunks = list(
            c.chat.completions.create(messages=msgs, stream=True, stream_options=opts, **ask)
        )
        assert chunks[-1].choices == [] and all(ch.usage is None for ch in chunks[:-1])
        return chunks[-1].usage

    answers = [
        (lambda: c.chat.completions.create(messages=msgs, **ask).usage, 1),
        (lambda: c.completions.create(prompt="Once upon a time", n=2, seed=3, **ask).usage, 2),
        (streamed, 1),
    ]
    drafted = 0
    for answer, n in answers:
        before = spec_totals(server.url)
        usage = answer()
        drafted += assert_spec_counted(usage.speculative, before, spec_totals(server.url), n)
    assert drafted > 0


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    ids = HTTP.post(
        server.url + "/tokenize", json={"prompt": "one two three four five six"}, timeout=60
    ).json()["tokens"]

    def complete(prompt, **kw):
        r = HTTP.post(
            server.url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 4, "temperature": 0, **kw},
            timeout=60,
        )
        return r.json()

    cut = complete("one two three four five six", truncate_prompt_tokens=3)
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["text"] == complete(ids[-3:])["choices"][0]["text"]


def test_tokenize_detokenize_and_version(server):
    r = HTTP.post(
        server.url + "/tokenize",
        json={"prompt": "Hello world", "return_token_strs": True},
        timeout=60,
    ).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 256
    assert "".join(r["token_strs"]).endswith("world")
    back = HTTP.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=60).json()
    assert back["prompt"].endswith("Hello world")
    chat = HTTP.post(
        server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=60
    ).json()
    served = HTTP.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        timeout=60,
    ).json()
    assert chat["count"] == served["usage"]["prompt_tokens"]
    bad = HTTP.post(server.url + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = HTTP.post(
        server.url + "/tokenize",
        json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
        timeout=60,
    )
    assert both.status_code == 400
    from xllm_py import __version__

    assert HTTP.get(server.url + "/version", timeout=10).json() == {"version": __version__}


def post(server, path: str, **body) -> httpx.Response:
    return HTTP.post(server.url + path, json=body, timeout=60)


def test_echo_puts_the_prompt_and_its_logprobs_before_the_output(server):
    prompt = "The quick brown fox jumps"
    ids = post(server, "/tokenize", prompt=prompt).json()["tokens"]
    plain = post(server, "/v1/completions", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    echo = post(
        server, "/v1/completions", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
        echo=True, prompt_logprobs=3,
    )  # fmt: skip
    p, e = plain.json()["choices"][0], echo.json()["choices"][0]
    assert e["text"] == prompt + p["text"]
    lp = e["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == n + 4 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and lp["tokens"][n:] == p["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(p["logprobs"]["token_logprobs"], abs=1e-5)
    scored = e["prompt_logprobs"]  # vLLM's shape: token id -> {logprob, rank, decoded_token}
    assert len(scored) == n and scored[0] is None
    for pos in range(1, n):
        own = scored[pos][str(ids[pos])]
        assert own["logprob"] == lp["token_logprobs"][pos]
        assert own["decoded_token"] == lp["tokens"][pos]
        assert {d["rank"] for t, d in scored[pos].items() if t != str(ids[pos])} <= {1, 2, 3}
        assert len(lp["top_logprobs"][pos]) in (2, 3)  # the prompt's token and the top 2
    assert lp["text_offset"][n] == len("".join(lp["tokens"][:n]))
    # streamed: the prompt (and its logprobs) come in the first chunk
    r = HTTP.post(
        server.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2,
              "echo": True, "stream": True},
        timeout=60,
    )  # fmt: skip
    chunks = [
        json.loads(line[6:])["choices"][0]
        for line in r.text.splitlines()
        if line.startswith("data: {")
    ]
    assert chunks[0]["text"].startswith(prompt)
    assert "".join(c["text"] for c in chunks) == e["text"]
    streamed = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)


def test_max_tokens_zero_scores_a_prompt_of_the_whole_context(server):
    full = [(5 * i) % 300 + 2 for i in range(256)]  # --max_model_len=256
    r = post(server, "/v1/completions", prompt=full, max_tokens=0, echo=True, logprobs=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"] == {
        "prompt_tokens": 256,
        "completion_tokens": 0,
        "total_tokens": 256,
        "speculative": {"draft_tokens": 0, "accepted_tokens": 0},  # MTP on, nothing drafted
    }
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 256
    assert body["choices"][0]["finish_reason"] == "length"
    bad = {
        "prompt": post(server, "/v1/completions", prompt=full + [7], max_tokens=0, echo=True),
        "prompt_logprobs": post(server, "/v1/completions", prompt="Hi", prompt_logprobs=21),
        "max_tokens": post(server, "/v1/completions", prompt="Hi", max_tokens=0),
    }
    for param, r in bad.items():
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    stream = post(server, "/v1/completions", prompt="Hi", prompt_logprobs=1, stream=True)
    assert stream.status_code == 400 and "stream" in stream.json()["error"]["message"]


def test_chat_prompt_logprobs_cover_the_rendered_prompt(server):
    chat = post(server, "/v1/chat/completions", messages=HI, max_tokens=2, prompt_logprobs=0)
    ids = post(server, "/tokenize", messages=HI).json()["tokens"]
    scored = chat.json()["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    assert [next(iter(e)) for e in scored[1:]] == [str(t) for t in ids[1:]]
