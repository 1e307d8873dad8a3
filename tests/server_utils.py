"""Start the real daemon (`python -m xllm_py`) on a free loopback port, for tests: perf's
launcher (perf/daemon.py), under the names the tests import."""

from perf.daemon import ROOT, Daemon, Server, free_port, free_port_range, wait_healthy

__all__ = ["ROOT", "Daemon", "Server", "free_port", "free_port_range", "wait_healthy"]
