"""Process-wide set-up (xllm_py/processes.py): an engine process on CPU keeps the large
blocks it frees for reuse, so a sampled step's [rows, vocabulary] tensors do not fault
their pages in from the kernel at every step. Each case runs in a fresh interpreter,
counting the minor page faults of a 64 MiB tensor allocated and freed over and over."""

from __future__ import annotations

import subprocess
import sys

import pytest

ALLOCATIONS = """
import resource, sys, torch
from xllm_py.processes import ProcessOptions
ProcessOptions(on_cpu=sys.argv[1] == "cpu").apply()
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(1 << 24)  # 64 MiB: over glibc's largest default heap block (32 MiB)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[10:]))  # once the heap has settled
"""
PAGES = (64 << 20) // 4096  # one allocation's pages, faulted in one by one


def settled_faults(device: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", ALLOCATIONS, device], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_an_engine_on_cpu_reuses_freed_large_blocks():
    assert settled_faults("cpu") < PAGES  # ten allocations, not one of them faulted in
    # what the defaults do: every allocation maps fresh pages
    assert settled_faults("other") >= 10 * PAGES
