"""Start the real daemon (`python -m xllm_py`) on a free loopback port, for tests: perf's
launcher (perf/daemon.py), under the names the tests import. Also what a test reads of
speculation from /metrics and from an answer's `usage.speculative`."""

from perf import daemon
from perf.daemon import HTTP, ROOT, Daemon, free_port, free_port_range, samples, wait_healthy

__all__ = [
    "HTTP",
    "ROOT",
    "Daemon",
    "Server",
    "assert_spec_counted",
    "free_port",
    "free_port_range",
    "spec_totals",
    "wait_healthy",
]

SPEC_TOTALS = (
    "xllm:spec_decode_num_draft_tokens_total",
    "xllm:spec_decode_num_accepted_tokens_total",
    "xllm:spec_decode_request_acceptance_rate_count",  # finished requests that had drafts
    "xllm:spec_decode_request_acceptance_rate_sum",
)


def spec_totals(url: str) -> list[float]:
    """The server's speculation totals (SPEC_TOTALS, in that order), from one /metrics page."""
    found = {name: v for name, _, v in samples(HTTP.get(url + "/metrics", timeout=10).text)}
    return [found[name] for name in SPEC_TOTALS]


def assert_spec_counted(spec: dict, before: list[float], after: list[float], n: int = 1) -> int:
    """`spec` (usage.speculative) of the only API request in flight between two spec_totals
    is what /metrics counted meanwhile: its draft and accepted tokens (summed over its n
    choices), and one histogram entry per choice that had drafts (one choice: exactly one,
    with its acceptance rate). Returns its draft tokens."""
    assert set(spec) == {"draft_tokens", "accepted_tokens"}, spec
    drafts, accepted = spec["draft_tokens"], spec["accepted_tokens"]
    assert 0 <= accepted <= drafts
    grown = [b - a for a, b in zip(before, after)]
    assert grown[:2] == [drafts, accepted], (spec, grown)
    if n == 1:
        assert grown[2] == (1 if drafts else 0), grown
        assert abs(grown[3] - (accepted / drafts if drafts else 0.0)) < 1e-9, grown
    else:
        assert (1 if drafts else 0) <= grown[2] <= n, grown
    return drafts


def eager_unless_asked(flags) -> list[str]:
    """`flags`, with graph mode off unless they set it: the daemon's default compiles its
    graphs in the background, minutes of both cores that a test of something else must
    not spend (tests/test_graph_warm_up.py tests that default)."""
    flags = list(flags)
    return flags if any("--enable_graph" in f for f in flags) else [*flags, "--enable_graph=false"]


class Server(daemon.Server):
    """The daemon for a test (perf/daemon.py's Server), eager unless the flags ask for
    graph mode."""

    def __init__(self, *flags: str, **kw) -> None:
        super().__init__(*eager_unless_asked(flags), **kw)
