"""Every shell script we ship passes shellcheck (the Debian package): the launch script,
CI's entry point, and whatever deploy/ holds."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.server_utils import ROOT


def shell_scripts() -> list[str]:
    found = [p for d in ("scripts", "deploy") for p in (ROOT / d).rglob("*.sh")]
    found.append(ROOT / ".ci" / "run")
    return sorted(str(p.relative_to(ROOT)) for p in found)


def test_the_launch_script_is_among_them():
    assert "scripts/launch_cluster.sh" in shell_scripts()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("script", shell_scripts())
def test_shellcheck_passes(script):
    out = subprocess.run(["shellcheck", script], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
