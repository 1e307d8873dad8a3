"""perf/bench_serving.py: its metric arithmetic on hand-built request records (expected
values worked out by hand), the Prometheus counter arithmetic, the random dataset's
lengths, `vllm bench serve` command lines (refused routes included), and small end-to-end
runs against one real daemon with MTP on (completions and chat routes)."""

from __future__ import annotations

import json
import math
import shlex

import pytest

from perf.bench_serving import (
    RequestOutput,
    calculate_metrics,
    load_tokenizer,
    parse_args,
    parse_spec_counters,
    run,
    sample_random,
    sample_sharegpt,
    spec_decode_stats,
)
from tests.server_utils import Server


@pytest.fixture(scope="module")
def server():
    with Server("--dtype", "float32", "--num_speculative_tokens=1") as s:
        yield s


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


def test_end_to_end_against_the_daemon(server, tmp_path):
    drafts = -server.metric("xllm:spec_decode_num_drafts_total")
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
    drafts += server.metric("xllm:spec_decode_num_drafts_total")
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
    # counted are the server's during this run.
    assert 1.0 <= saved["spec_decode_acceptance_length"] <= 2.0
    assert saved["spec_decode_num_drafts"] == drafts > 0
    assert saved["spec_decode_draft_tokens"] == saved["spec_decode_num_drafts"]
    assert len(saved["spec_decode_per_position_acceptance_rates"]) == 1


def test_vllm_command_line_against_the_daemon(server):
    """A `vllm bench serve` command line as vLLM's users write it (the issue's, with fewer
    prompts and tokens to stay cheap) runs unchanged."""
    line = "--dataset-name sharegpt --sharegpt-output-len 12 --num-prompts 6 --max-concurrency 4"
    result = run([*shlex.split(line), "--ignore-eos", "--base-url", server.url])
    assert result["failed"] == 0 and result["completed"] == 6
    assert result["total_output_tokens"] == 6 * 12
    assert result["dataset_name"] == "sharegpt" and result["output_len"] == 12
    assert (result["backend"], result["endpoint"]) == ("openai", "/v1/completions")


def test_sharegpt_output_lengths_drawn_around_the_fixed_one(server):
    """--sharegpt-output-range-ratio: the same prompts as without it, each reply's
    max_tokens drawn within the ratio's bounds (so ignore_eos replies end at different
    steps), the same draws for the same seed, and the server ran each to its length."""
    tokenizer = load_tokenizer(None)
    fixed = sample_sharegpt(tokenizer, 8, seed=1, input_len=32, output_len=12)
    drawn = sample_sharegpt(
        tokenizer, 8, seed=1, input_len=32, output_len=12, output_range_ratio=0.5
    )
    assert [r.prompt for r in drawn] == [r.prompt for r in fixed]
    outs = [r.output_len for r in drawn]
    assert all(6 <= n <= 18 for n in outs) and len(set(outs)) > 2
    line = "--sharegpt-output-len 12 --sharegpt-output-range-ratio 0.5 --input-len 32"
    argv = [*shlex.split(line), "--num-prompts", "8", "--seed", "1", "--max-concurrency", "4"]
    result = run([*argv, "--ignore-eos", "--save-detailed", "--base-url", server.url])
    assert result["failed"] == 0 and result["output_lens"] == outs
    assert result["output_range_ratio"] == 0.5
    with pytest.raises(ValueError, match="needs --sharegpt-output-len"):
        sample_sharegpt(tokenizer, 1, output_range_ratio=0.5)


def test_random_dataset_lengths_within_ratio_bounds():
    tokenizer = load_tokenizer(None)
    reqs = sample_random(tokenizer, 60, seed=3, input_len=64, output_len=20, range_ratio=0.25)
    ins, outs = [r.prompt_len for r in reqs], [r.output_len for r in reqs]
    assert all(48 <= n <= 80 for n in ins) and all(15 <= n <= 25 for n in outs)
    assert max(ins) - min(ins) >= 16 and max(outs) - min(outs) >= 5  # drawn, not fixed
    for r in reqs:  # each prompt is exactly as long as recorded
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
    fixed = sample_random(tokenizer, 4, input_len=40, output_len=7)  # ratio 0: exact lengths
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(40, 7)] * 4
    assert len({r.prompt for r in fixed}) == 4
    a = parse_args(["--dataset-name", "random"])  # vLLM's defaults
    assert (a.random_input_len, a.random_output_len, a.random_range_ratio) == (1024, 128, 0.0)
    with pytest.raises(ValueError, match="range-ratio"):
        sample_random(tokenizer, 1, range_ratio=1.0)


def test_random_dataset_on_the_chat_route(server):
    """vLLM's openai-chat backend: the random prompts as user messages, each reply as long
    as its drawn output length (ignore_eos)."""
    argv = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--dataset-name", "random", "--random-input-len", "24", "--random-output-len",
            "8", "--random-range-ratio", "0.5", "--num-prompts", "3", "--seed", "2",
            "--ignore-eos", "--save-detailed", "--base-url", server.url]  # fmt: skip
    result = run(argv)
    drawn = sample_random(load_tokenizer(None), 3, 2, 24, 8, 0.5)
    assert result["failed"] == 0 and result["completed"] == 3, result["errors"]
    assert result["output_lens"] == [r.output_len for r in drawn]
    # the server's prompt counts: the drawn prompt in the chat template
    assert all(n > r.prompt_len for n, r in zip(result["input_lens"], drawn))
    assert all(t for t in result["generated_texts"])
    assert result["endpoint"] == "/v1/chat/completions" and result["random_range_ratio"] == 0.5


@pytest.mark.parametrize(
    "argv, bad",
    [
        (["--backend", "tgi"], "'tgi'"),
        (["--endpoint", "/v1/responses"], "/v1/responses"),
        (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "openai-chat"),
        (["--backend", "vllm", "--endpoint", "/v1/chat/completions"], "--backend vllm"),
        (["--dataset-name", "random", "--sharegpt-output-len", "96"], "--sharegpt-output-len"),
        (["--dataset-name", "random", "--sharegpt-output-range-ratio", "0.5"], "range-ratio"),
    ],
)
def test_refused_backend_endpoint_and_dataset_flags(argv, bad, capsys):
    """Refused before any request (no server here), with the bad value named."""
    with pytest.raises(SystemExit) as exc:
        run([*argv, "--base-url", "http://127.0.0.1:9"])
    assert exc.value.code == 2
    assert bad in capsys.readouterr().err
