"""perf/bench_serving.py: its metric arithmetic on hand-built request records (expected
values worked out by hand), the Prometheus counter arithmetic, and one small end-to-end
run against the real daemon with MTP on."""

from __future__ import annotations

import json
import math

import pytest

from perf.bench_serving import (
    RequestOutput,
    calculate_metrics,
    parse_spec_counters,
    run,
    spec_decode_stats,
)
from tests.server_utils import Server


class WordTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * i for i in ids)


def records() -> list[RequestOutput]:
    return [
        # TPOT (0.5 - 0.1) / (5 - 1) = 0.1
        RequestOutput(True, 10, 5, ttft=0.1, itl=[0.1] * 4, latency=0.5),
        # no usage count: 3 tokens from the text; TPOT (0.6 - 0.2) / 2 = 0.2
        RequestOutput(True, 20, 0, ttft=0.2, itl=[0.2, 0.2], latency=0.6, generated_text="a b c"),
        # one output token: no TPOT
        RequestOutput(True, 30, 1, ttft=0.3, itl=[], latency=0.3),
        # failed: counted in `failed` only
        RequestOutput(False, 40, 7, ttft=9.0, itl=[9.0], latency=9.0, error="HTTP 500"),
    ]


def test_calculate_metrics_by_hand():
    m = calculate_metrics(records(), duration=2.0, tokenizer=WordTokenizer())
    approx = pytest.approx
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 60  # 10 + 20 + 30
    assert m["total_output_tokens"] == 9  # 5 + 3 + 1
    assert m["duration"] == 2.0
    assert m["request_throughput"] == approx(1.5)
    assert m["output_throughput"] == approx(4.5)
    assert m["total_token_throughput"] == approx(34.5)
    # TTFT 100, 200, 300 ms; p99 = 200 + 0.98 * 100 (linear between the 2nd and 3rd)
    assert m["mean_ttft_ms"] == approx(200)
    assert m["median_ttft_ms"] == approx(200)
    assert m["std_ttft_ms"] == approx(math.sqrt(20000 / 3))
    assert m["p99_ttft_ms"] == approx(298)
    # TPOT 100, 200 ms (the output_len 1 and failed requests excluded)
    assert m["mean_tpot_ms"] == approx(150)
    assert m["median_tpot_ms"] == approx(150)
    assert m["std_tpot_ms"] == approx(50)
    assert m["p99_tpot_ms"] == approx(199)
    # ITL 100 x4, 200 x2 ms
    assert m["mean_itl_ms"] == approx(800 / 6)
    assert m["median_itl_ms"] == approx(100)
    assert m["std_itl_ms"] == approx(math.sqrt((4 * (100 / 3) ** 2 + 2 * (200 / 3) ** 2) / 6))
    assert m["p99_itl_ms"] == approx(200)
    # E2EL 500, 600, 300 ms
    assert m["mean_e2el_ms"] == approx(1400 / 3)
    assert m["median_e2el_ms"] == approx(500)
    assert m["p99_e2el_ms"] == approx(598)


def test_calculate_metrics_all_failed():
    m = calculate_metrics(records()[3:], duration=1.0)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (0, 1, 0)
    assert m["request_throughput"] == 0 and m["mean_ttft_ms"] == 0 and m["p99_tpot_ms"] == 0


def prom(prefix: str, drafts, draft_tokens, accepted, per_pos) -> str:
    lines = [
        f"# TYPE {prefix}spec_decode_num_drafts_total counter",
        f'{prefix}spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
        f'{prefix}spec_decode_num_drafts_created{{model_name="m"}} 1.7e9',
        f'{prefix}spec_decode_num_draft_tokens_total{{model_name="m"}} {draft_tokens}',
        f'{prefix}spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}',
        'other_metric_total{position="0"} 123',
    ]
    for pos, n in enumerate(per_pos):
        lines.append(
            f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
            f'position="{pos}"}} {n}'
        )
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("prefix", ["xllm:", "vllm:"])
def test_spec_decode_stats_from_counter_growth(prefix):
    before = parse_spec_counters(prom(prefix, 10, 20, 12, [8, 4]))
    after = parse_spec_counters(prom(prefix, 30.0, 60.0, 40.0, [26.0, 14.0]))
    # over the run: 20 drafts, 40 draft tokens, 28 accepted (18 at position 0, 10 at 1)
    s = spec_decode_stats(before, after)
    assert s["spec_decode_num_drafts"] == 20
    assert s["spec_decode_draft_tokens"] == 40
    assert s["spec_decode_accepted_tokens"] == 28
    assert s["spec_decode_acceptance_rate"] == pytest.approx(70.0)  # percent, as vLLM
    assert s["spec_decode_acceptance_length"] == pytest.approx(2.4)
    assert s["spec_decode_per_position_acceptance_rates"] == pytest.approx([0.9, 0.5])


def test_spec_decode_stats_absent():
    assert parse_spec_counters("# nothing\nprocess_cpu_seconds_total 1.0\n") is None
    counters = parse_spec_counters(prom("xllm:", 5, 5, 3, [3]))
    assert spec_decode_stats(None, counters) is None
    assert spec_decode_stats(counters, counters) is None  # nothing drafted during the run


VLLM_KEYS = [
    "date",
    "backend",
    "model_id",
    "num_prompts",
    "request_rate",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(
        f"{s}_{m}_ms"
        for m in ("ttft", "tpot", "itl", "e2el")
        for s in ("mean", "median", "std", "p99")
    ),
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
    "spec_decode_acceptance_rate",
    "spec_decode_acceptance_length",
    "spec_decode_num_drafts",
    "spec_decode_draft_tokens",
    "spec_decode_accepted_tokens",
    "spec_decode_per_position_acceptance_rates",
]


def test_end_to_end_against_the_daemon(tmp_path):
    with Server("--dtype", "float32", "--num_speculative_tokens=1") as server:
        result = run(
            [
                f"--base-url={server.url}",
                "--num-prompts=6",
                "--input-len=32",
                "--output-len=9",
                '--extra-body={"max_tokens": 8}',  # merged into each body: 8 tokens, not 9
                "--ignore-eos",
                "--max-concurrency=2",
                "--seed=1",
                "--disable-tqdm",
                "--save-result",
                "--save-detailed",
                f"--result-dir={tmp_path}",
                "--result-filename=out.json",
            ]
        )
        drafts = server.metric("xllm:spec_decode_num_drafts_total")
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved == json.loads(json.dumps(result))
    missing = [k for k in VLLM_KEYS if k not in saved]
    assert not missing
    assert saved["backend"] == "openai" and saved["model_id"] == "tiny-deepseek-v3-mtp"
    assert saved["max_concurrency"] == 2 and saved["request_rate"] == "inf"
    assert saved["failed"] == 0 and saved["completed"] == 6, saved["errors"]
    assert saved["input_lens"] == [32] * 6
    assert saved["output_lens"] == [8] * 6
    assert saved["total_input_tokens"] == 192 and saved["total_output_tokens"] == 48
    assert all(t for t in saved["generated_texts"])
    assert all(len(itl) <= 7 for itl in saved["itls"])  # 8 tokens: at most 7 gaps

    # Metrics follow from the per-request arrays.
    tpots = [
        (e2el - ttft) / (n - 1)
        for e2el, ttft, n in zip(saved["latencies"], saved["ttfts"], saved["output_lens"])
    ]
    assert saved["mean_tpot_ms"] == pytest.approx(1000 * sum(tpots) / len(tpots))
    assert saved["mean_ttft_ms"] == pytest.approx(1000 * sum(saved["ttfts"]) / 6)
    assert saved["output_throughput"] == pytest.approx(48 / saved["duration"])

    # One draft token per verification pass: 1 <= acceptance length <= 2; the drafts
    # counted are all this fresh server's.
    assert 1.0 <= saved["spec_decode_acceptance_length"] <= 2.0
    assert saved["spec_decode_num_drafts"] == drafts > 0
    assert saved["spec_decode_draft_tokens"] == saved["spec_decode_num_drafts"]
    assert len(saved["spec_decode_per_position_acceptance_rates"]) == 1
