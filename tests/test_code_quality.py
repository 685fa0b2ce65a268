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


@pytest.mark.timeout(180)
def test_packages_import_only_the_layers_below_them() -> None:
    """import-linter keeps pyproject.toml's layer contracts (tools/importlint.py)."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "importlint.py")], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout, out.stdout


#: The longest a module of the project may be, in lines.
MAX_MODULE_LINES = 600


def test_no_module_is_longer_than_the_limit() -> None:
    """Every module of kvbroker's packages stays under MAX_MODULE_LINES lines (generated code aside)."""
    folders = ("adapters", "broker", "client", "demo", "src/kvbroker")
    long = {
        str(path.relative_to(ROOT)): n
        for folder in folders
        for path in (ROOT / folder).rglob("*.py")
        if "/v1/" not in path.as_posix() and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
