"""Picking a free port that stays free until its server binds it.

A port the kernel picks (bind to 0) lies in its ephemeral range, which every process on the
host draws from, for its own bind(0)s and for the local end of every connection it opens.
Between closing the probe socket and the server binding the port, any of those may take it
("address already in use"). So ports come from below that range, where the kernel hands out
nothing. The floor stays above Ray's worker ports (10002-19999 by default), which a Ray
node binds as its workers start. The Ray launcher picks its nodes' ports here; the
benchmark's and the tests' launcher (perf/daemon.py) picks from a slice of the same range.
"""

from __future__ import annotations

import socket
from collections.abc import Container
from pathlib import Path

PORT_FLOOR = 20000


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 if unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def unpicked_ports() -> range:
    """The ports no process of the host gets from the kernel: PORT_FLOOR up to its range."""
    return range(PORT_FLOOR, max(ephemeral_low(), PORT_FLOOR))


def bindable(port: int, host: str = "") -> bool:
    """Whether a TCP socket can bind (host, port) now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port_run(
    n: int, ports: range, start: int, host: str = "", taken: Container[int] = ()
) -> int:
    """A port p such that p .. p + n - 1 all lie in `ports`, none is in `taken`, and all
    bind on `host` now; the search goes round `ports` from index `start` (callers spread
    their starts so that two processes rarely probe the same ports). Where `ports` is too
    short to search (a host whose ephemeral range starts low), the kernel picks p."""
    if len(ports) < 4 * n:
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                base = s.getsockname()[1]
            if all(bindable(base + i, host) for i in range(1, n)):
                return base
    for i in range(len(ports)):
        base = ports[(start + i) % len(ports)]
        run = range(base, base + n)
        if run[-1] in ports and not any(p in taken for p in run):
            if all(bindable(p, host) for p in run):
                return base
    raise RuntimeError(f"no {n} consecutive free ports left in {ports}")
