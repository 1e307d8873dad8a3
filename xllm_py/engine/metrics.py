"""Prometheus metrics for `GET /metrics`, named as vLLM names them with an `xllm:`
prefix and a `model_name` label.

Counters and histograms are fed by the engine thread through EngineEvents;
gauges and the scheduler/speculation totals are read, at scrape time, from the
stats snapshot the engine thread publishes after every step. Each server has
its own registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

import itertools

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from xllm_py.engine.async_engine import AsyncEngine, EngineEvents, RequestRecord
from xllm_py.pd.compat import TRANSFER_BUCKETS_S, PDStats
from xllm_py.speculative.metrics import ACCEPTANCE_BUCKETS, SpecDecodeStats
from xllm_py.structured import GrammarCacheCollector

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
disable_created_metrics()  # no *_created series (vLLM does the same)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StatsCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.model = engine, model_name

    def collect(self):
        st, labels = self.engine.stats, [self.model]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge(
            "xllm:num_requests_running", "Requests in the running batch (prefill or decode).",
            st.num_running,
        )  # fmt: skip
        yield gauge(
            "xllm:num_requests_waiting", "Requests queued, not yet scheduled (or preempted).",
            st.num_waiting,
        )  # fmt: skip
        yield gauge(
            "xllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
            st.kv_cache_usage,
        )  # fmt: skip
        yield counter(
            "xllm:num_preemptions", "Requests preempted (blocks freed, recomputed later).",
            st.num_preemptions,
        )  # fmt: skip
        yield counter(
            "xllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            st.prefix_cache_queries,
        )  # fmt: skip
        yield counter(
            "xllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (in full blocks).",
            st.prefix_cache_hits,
        )  # fmt: skip
        yield from _pd_metrics(st.pd, counter, labels) if st.pd is not None else ()
        spec = st.spec
        yield counter(
            "xllm:spec_decode_num_drafts",
            "Verification passes that carried MTP draft tokens (one per request per step).",
            spec.drafts,
        )
        yield counter(
            "xllm:spec_decode_num_draft_tokens", "MTP draft tokens proposed.", spec.draft_tokens
        )
        yield counter(
            "xllm:spec_decode_num_accepted_tokens",
            "Draft tokens the target accepted (acceptance rate = accepted / draft tokens; "
            "mean acceptance length = 1 + accepted / drafts).",
            spec.accepted_tokens,
        )
        per = CounterMetricFamily(
            "xllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position (0 = first draft token).",
            labels=["model_name", "position"],
        )
        for pos, n in enumerate(spec.accepted_per_position):
            per.add_metric([self.model, str(pos)], n)
        yield per
        yield from self._confidence_counters(spec)
        yield self._acceptance_histogram(spec)
        if spec.adaptive_k:  # --speculative_adaptive
            k = GaugeMetricFamily(
                "xllm:spec_decode_adaptive_k",
                "Draft tokens per request that adaptive speculation chose for the latest step.",
                labels=["model_name", "replica"],
            )
            for replica, value in enumerate(spec.adaptive_k):
                k.add_metric([self.model, str(replica)], value)
            yield k
            steps = CounterMetricFamily(
                "xllm:spec_decode_adaptive_steps",
                "Steps adaptive speculation ran with k draft tokens per request.",
                labels=["model_name", "k"],
            )
            for n_drafts, n in enumerate(spec.steps_by_k):
                steps.add_metric([self.model, str(n_drafts)], n)
            yield steps

    def _confidence_counters(self, spec: SpecDecodeStats):
        """What --speculative_confidence left out: drafts, and whole steps' MTP passes."""
        for name, doc, value in [
            ("xllm:spec_decode_num_cut_draft_tokens", "MTP draft tokens the confidence "
             "policy left unverified (--speculative_confidence).", spec.cut_draft_tokens),
            ("xllm:spec_decode_num_undrafted_steps", "Steps --speculative_confidence=auto ran "
             "without the MTP passes (drafting did not pay at that batch size, or the gate "
             "was measuring plain decoding).", spec.undrafted_steps),
        ]:  # fmt: skip
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model], value)
            yield family

    def _acceptance_histogram(self, spec: SpecDecodeStats) -> HistogramMetricFamily:
        h = HistogramMetricFamily(
            "xllm:spec_decode_request_acceptance_rate",
            "Acceptance rate (accepted / draft tokens) of each finished request that had MTP "
            "draft tokens verified.",
            labels=["model_name"],
        )
        h.add_metric(
            [self.model], _buckets(ACCEPTANCE_BUCKETS, spec.acceptance_buckets), spec.acceptance_sum
        )
        return h


def _buckets(bounds, counts: list[int]) -> list[tuple[str, int]]:
    """A histogram's cumulative buckets from counts per bucket (the +Inf bucket's last, or
    left out: the +Inf bucket counts everything)."""
    cumulative = list(itertools.accumulate(counts))
    return [(floatToGoString(b), n) for b, n in zip(bounds, cumulative)] + [("+Inf", sum(counts))]


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            "xllm:prompt_tokens", "Prompt tokens of scheduled requests.", lab, registry=r
        )
        self.generation_tokens = Counter(
            "xllm:generation_tokens", "Generated (verified) tokens.", lab, registry=r
        )
        self.request_success = Counter(
            "xllm:request_success",
            "Finished requests by finish reason (stop, length, abort).",
            lab + ["finished_reason"],
            registry=r,
        )

        def hist(name, doc):
            return Histogram(name, doc, lab, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = hist(
            "xllm:time_to_first_token_seconds", "Arrival to first generated token, seconds."
        )
        self.itl = hist(
            "xllm:inter_token_latency_seconds",
            "Time between successive output tokens, seconds (a step that emits n tokens "
            "counts n intervals of gap / n).",
        )
        self.e2e = hist(
            "xllm:e2e_request_latency_seconds", "Arrival to finish (any reason), seconds."
        )
        self.queue = hist(
            "xllm:request_queue_time_seconds", "Arrival to first scheduled, seconds (on a PD "
            "decode instance this includes the wait for the prompt's blocks: "
            "xllm:pd_transfer_seconds)."
        )  # fmt: skip
        self.prefill = hist(
            "xllm:request_prefill_time_seconds", "First scheduled to first generated token, "
            "seconds: queue + prefill = time to first token."
        )  # fmt: skip

    def attach(self, engine: AsyncEngine) -> None:
        self.registry.register(_StatsCollector(engine, self.model))
        self.registry.register(GrammarCacheCollector(self.model))  # xllm:grammar_cache_*
        engine.events = EngineEvents(self._scheduled, self._tokens, self._finished)

    def _scheduled(self, rec: RequestRecord, now: float) -> None:
        self.queue.labels(self.model).observe(now - rec.arrival)
        self.prompt_tokens.labels(self.model).inc(rec.num_prompt_tokens)

    def _tokens(self, rec: RequestRecord, n: int, now: float) -> None:
        if rec.first_token is None:
            rec.first_token = now
            self.ttft.labels(self.model).observe(now - rec.arrival)
            if rec.scheduled is not None:
                self.prefill.labels(self.model).observe(now - rec.scheduled)
            n_gaps, gap = 0, 0.0  # tokens arriving with the first one have no gap of their own
        else:
            n_gaps, gap = n, (now - rec.last_token) / n
        for _ in range(n_gaps):
            self.itl.labels(self.model).observe(gap)
        rec.last_token = now
        self.generation_tokens.labels(self.model).inc(n)

    def _finished(self, rec: RequestRecord, reason: str, now: float) -> None:
        self.request_success.labels(self.model, reason).inc()
        self.e2e.labels(self.model).observe(now - rec.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _pd_metrics(pd: PDStats, counter, labels: list[str]):
    """A PD instance's transfers (pd/compat.py's PDStats)."""
    yield counter(
        "xllm:pd_kv_blocks", "KV cache blocks moved: written to decode instances (prefill) or "
        "received from prefill instances (decode).", pd.blocks,
    )  # fmt: skip
    yield counter("xllm:pd_kv_bytes", "KV cache bytes moved (as xllm:pd_kv_blocks).", pd.bytes)
    yield counter("xllm:pd_transfers", "Prompts whose blocks arrived (decode).", pd.transfers)
    yield counter(
        "xllm:pd_transfer_failures", "Prompts whose blocks did not arrive (failed, refused or "
        "late transfers; recomputed here or failed, as --pd_on_transfer_failure says).",
        pd.failures,
    )  # fmt: skip
    hist = HistogramMetricFamily(
        "xllm:pd_transfer_seconds", "Seconds from asking a prefill instance to the arrival of "
        "the prompt's blocks: its prefill and the transfer (decode).", labels=["model_name"],
    )  # fmt: skip
    hist.add_metric(labels, _buckets(TRANSFER_BUCKETS_S, pd.seconds), pd.seconds_sum)
    yield hist
