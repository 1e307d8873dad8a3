"""Benchmarks and measurement tools of xllm-py; each module runs as `python -m perf.<name>`
from the repository root (perf/README.md). Shared pieces: perf.common (flags, result JSON,
tables, prompts), perf.daemon (the one server launcher, also the tests'), perf.step_cost
(decode timing, step splits and the MTP ceiling) and perf.oracle (an always-accepted draft)."""
