"""Static checks that run with the tests: strict typing and lint of our packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_packages_type_check_strictly() -> None:
    """mypy --strict finds nothing in kvbroker (tools/typecheck.py)."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "typecheck.py")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_lint_is_clean() -> None:
    """ruff finds nothing in the project's code and tests."""
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "adapters", "broker", "client", "demo", "src/kvbroker", "tests", "tools", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
