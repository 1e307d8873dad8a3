"""python -m perf.soak: a 64-request soak against the real daemon (MTP on, a KV cache
small enough to preempt) must pass every check; the checks themselves catch a wrong answer,
a changed probe and a missing preemption (exit status 1)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from perf import soak
from perf.daemon import ROOT

# the daemon eager: its default compiles graphs in the background (tests/server_utils.py)
EAGER = ["--server-args", "--num_speculative_tokens=1 --enable_graph=false"]
# Requests in the soak below: a tenth abandoned (about 6), the probe rounds (sent once
# 1/5 .. 4/5 of them have finished) meet requests in flight, and the cache preempts from the
# start: all 64 are sent at once. The 2,000-request run is perf/results/soak.json.
REQUESTS = 64
# The short soak's cache: 72 blocks of 16 tokens hold the longest request (1,024 + 48 tokens)
# and little else. With the default 128-token blocks (12 of them) a running request rarely
# crossed into a new block in 64 requests: 1-2 preemptions here, none on a CI run; with
# 16-token blocks every request needs a new block every 16 tokens (33 and 45 here).
SHORT_CACHE = ["--max-cache-size", "72"]
SHORT_EAGER = ["--server-args", EAGER[1] + " --block_size=16"]

# ---- the checks, on answers made up here ---------------------------------------------------------


def _spec(**body) -> soak.Spec:
    base = {"prompt": "Hi", "max_tokens": 4, "n": 2, "logprobs": 1, "stop": ["."]}
    return soak.Spec(0, False, base | body, prompt_tokens=3)


def _answer(spec: soak.Spec) -> soak.Outcome:
    """A right answer to `_spec()`: choice 0 ran to max_tokens, choice 1 stopped after 2."""
    out = soak.Outcome(http_status=200, complete=True)
    out.choices = {
        0: soak.Choice("a b c d", "length", None, ["a", " b", " c", " d"]),
        1: soak.Choice("x", "stop", ".", ["x", "."]),
    }
    out.usage = {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    return out


def _broken(change) -> list[str]:
    spec = _spec()
    out = copy.deepcopy(_answer(spec))
    change(out)
    return soak.check_answer(spec, out)


def test_a_right_answer_passes():
    assert soak.check_answer(_spec(), _answer(_spec())) == []


@pytest.mark.parametrize(
    "change, complaint",
    [
        (lambda o: o.usage.update(completion_tokens=5, total_tokens=8), "5 != 6 tokens received"),
        (lambda o: o.usage.update(prompt_tokens=4, total_tokens=10), "prompt_tokens 4 != 3"),
        (lambda o: o.usage.update(total_tokens=10), "total_tokens 10"),
        (lambda o: setattr(o, "usage", None), "no usage"),
        (lambda o: setattr(o.choices[1], "finish_reason", None), "finish_reason None"),
        (lambda o: setattr(o.choices[1], "finish_reason", "abort"), "finish_reason 'abort'"),
        (lambda o: setattr(o.choices[1], "text", "x. y"), "stop string '.' left"),
        (lambda o: o.choices[0].tokens.pop(), "'length' after 3 of 4"),
        (lambda o: o.choices.pop(1), "choice indexes [0]"),
        (lambda o: setattr(o, "complete", False), "without data: [DONE]"),
        (lambda o: setattr(o.choices[0], "after_finish", 1), "after its finish"),
        (lambda o: setattr(o, "http_status", 500), "HTTP 500"),
    ],
)
def test_a_wrong_answer_is_caught(change, complaint):
    problems = _broken(change)
    assert any(complaint in p for p in problems), problems


def test_without_logprobs_usage_must_fit_the_finish_reasons():
    spec = _spec(logprobs=None)
    out = _answer(spec)
    for c in out.choices.values():
        c.tokens = None
    assert soak.check_answer(spec, out) == []  # 4 (length) + 1..4 (stop): 5..8
    out.usage.update(completion_tokens=4, total_tokens=7)
    assert any("outside [5, 8]" in p for p in soak.check_answer(spec, out))


def test_a_changed_probe_answer_is_reported():
    idle = [{"choices": [[t, [t], "length"]], "usage": {"completion_tokens": 1}} for t in "ab"]
    changed = copy.deepcopy(idle)
    changed[1]["choices"][0][0] = "other"
    rounds = [{"answers": idle}, {"answers": changed}]
    res = soak.compare_probes(idle, rounds)
    assert (res["compared"], res["equal"]) == (4, 3)
    assert [(d["round"], d["probe"]) for d in res["diffs"]] == [(1, 1)]


def test_rss_growth_is_measured_from_the_end_of_the_warm_up():
    # (seconds, KiB, requests finished): 100 MiB once 10 requests are done, 120 at the end
    mib = [(0, 90, 0), (1, 100, 10), (2, 130, 50), (3, 96, 55), (4, 120, 100)]
    rss = soak.rss_summary([(t, m << 10, done) for t, m, done in mib], warm_requests=10)
    assert rss["warm_mib"] == 100 and rss["end_mib"] == 120
    assert rss["growth_after_warmup"] == pytest.approx(0.2)
    assert rss["peak_growth_after_warmup"] == pytest.approx(0.3)
    assert rss["growth_second_half"] == pytest.approx(120 / 96 - 1)  # from 55 done on


# ---- the soak itself -----------------------------------------------------------------------------


def test_soak_of_64_requests_passes_every_check(tmp_path):
    """64 (REQUESTS) mixed requests at concurrency 64 (streamed or not, n 1-3, stop strings,
    logprobs, seeds, both endpoints, 10% abandoned) against a KV cache of 72 16-token blocks."""
    result_file = tmp_path / "soak.json"
    # After a short warm-up (a fifth of the requests) the allocator is still growing its
    # pools for the larger batches that come later (+9% to +31% seen here): the short run
    # allows 50% after warm-up and 5% over its second half (+0.01% seen); the full run holds
    # the 10% line from its warm-up on (perf/results/soak.json).
    argv = ["--requests", str(REQUESTS), "--max-rss-growth", "0.5", "--no-progress"]
    argv += SHORT_CACHE + SHORT_EAGER
    r = soak.main([*argv, "--result", str(result_file)])
    checks = {c["check"]: c for c in r["checks"]}
    failed = [c for c in r["checks"] if not c["ok"]]
    assert not failed, (failed, r["failures"][:5], r["probes"]["diffs"][:2])
    c = r["counts"]
    assert c["failed"] == 0 and c["ok"] + c["aborted"] == REQUESTS, c
    assert c["aborted"] > 0 and c["streamed"] and c["chat"] and c["with_logprobs"], c
    probes = r["probes"]
    assert probes["compared"] == probes["equal"] == (4 + 1) * 8  # 4 rounds in the load, 1 after
    assert any(rnd["in_flight_at_start"] > 0 for rnd in probes["rounds"])
    assert r["preemptions"] > 0 and r["kv_blocks"] == 72
    assert r["gauges"]["running"] == r["gauges"]["waiting"] == r["gauges"]["kv_cache_usage"] == 0
    assert r["rss"]["growth_after_warmup"] < 0.5, checks["RSS growth"]
    assert r["rss"]["growth_second_half"] < 0.05, r["rss"]
    assert r["passed"] and json.loads(result_file.read_text())["passed"]


def test_a_cache_that_never_preempts_fails_the_soak(tmp_path):
    """The exit status says so when a check fails: here 200 blocks hold all 8 requests."""
    result_file = tmp_path / "soak.json"
    args = [
        "--requests", "8", "--concurrency", "4", "--max-cache-size", "200", "--probes", "2",
        "--probe-rounds", "1", "--abort-fraction", "0", "--max-rss-growth", "10",
        "--no-progress", "--result", str(result_file), *EAGER,
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "perf.soak", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    r = json.loads(result_file.read_text())
    assert [c["check"] for c in r["checks"] if not c["ok"]] == ["preemption"], r["checks"]
    assert "FAIL  preemption" in proc.stdout
