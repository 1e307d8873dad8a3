"""The clients users already run, unmodified, against the real daemon (bundled model,
MTP on): guidellm (the vLLM project's load tester) over both request formats at
concurrency 1 and 4, and the official `openai` client with the fields chat front-ends
send (max_completion_tokens, logprobs with top_logprobs, penalties, logit_bias).

guidellm sends `stream_options: {"include_usage": true, "continuous_usage_stats": true}`
and vLLM's `ignore_eos`; before the field policy of docs/api_fields.md every one of its
requests was a 400. Its throughput is compared with perf/bench_serving.py's by
perf/client_agreement.py (a benchmark, not a test: this machine is too noisy for timed
assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_utils import Server

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "xllm_py" / "assets" / "tiny-deepseek-v3-mtp"
GUIDELLM = Path(sys.executable).parent / "guidellm"
REQUESTS = 4  # per concurrency level
TOKENS = 32


@pytest.fixture(scope="module")
def server():
    with Server("--num_speculative_tokens=1") as s:
        yield s


def run_guidellm(url: str, request_format: str, out: Path) -> list[dict]:
    """guidellm's JSON benchmarks for concurrency 1 and 4, synthetic TOKENS/TOKENS data."""
    cmd = [
        str(GUIDELLM), "run",
        "--backend", f"kind=openai_http,target={url},request_format={request_format}",
        "--profile", "kind=concurrent", "--override", "profile.streams", "1,4",
        "--data", f"kind=synthetic_text,prompt_tokens={TOKENS},output_tokens={TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={MODEL_DIR}",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--output", f"kind=json,path={out}",
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())["benchmarks"]


@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_runs_without_errors(server, tmp_path, request_format):
    benchmarks = run_guidellm(server.url, request_format, tmp_path / "guidellm.json")
    assert len(benchmarks) == 2
    for b in benchmarks:
        totals = b["metrics"]["request_totals"]
        assert totals["errored"] == 0 and totals["incomplete"] == 0, totals
        assert totals["successful"] == REQUESTS
        done = b["requests"]["successful"]
        assert all(r["output_tokens"] == TOKENS for r in done)  # ignore_eos was honoured
        assert b["metrics"]["output_tokens_per_second"]["successful"]["mean"] > 0
    assert server.metric("xllm:request_success_total") >= 2 * REQUESTS


def test_openai_client_with_the_fields_chat_front_ends_send(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Name three colours."}]
    plain = client.chat.completions.create(
        model="tiny-deepseek-v3-mtp", messages=messages, max_completion_tokens=12,
        temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    choice = plain.choices[0]
    assert plain.usage.completion_tokens == len(choice.logprobs.content) <= 12
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    first = choice.logprobs.content[0].token
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": first}, timeout=30).json()
    first_id = tokenized["tokens"][-1]  # (after the BOS the tokenizer adds)
    penalised = client.chat.completions.create(
        model="tiny-deepseek-v3-mtp", messages=messages, max_completion_tokens=12,
        temperature=0, presence_penalty=1.0, frequency_penalty=0.5,
        logit_bias={str(first_id): -100}, extra_body={"repetition_penalty": 1.1},
    )  # fmt: skip
    assert penalised.choices[0].message.content != choice.message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny-deepseek-v3-mtp", messages=messages, presence_penalty=3.0
        )
    assert e.value.body["param"] == "presence_penalty"
