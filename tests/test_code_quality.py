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


#: Tests that may import a private module (a name starting with "_" in its
#: dotted path), and why; besides these, a unit test may import the private
#: module it is named after (tests/unit/test_smallmap.py: ``..._smallmap``).
#: Everything else comes from a package's face, so internals move freely.
PRIVATE_IMPORTS_ALLOWED: dict[str, tuple[set[str], str]] = {
    "tests/test_checksum.py": ({"kvbroker.broker.execution._staging_copies"}, "wraps chunk_checksum to see which thread hashes"),
    "tests/test_dataplane.py": ({"kvbroker.broker.dataplane._thread"}, "reads the poll backoff's constants"),
    "tests/test_device_setup.py": ({"kvbroker.broker.device._lanes"}, "replaces the GPU lane class with a recording one"),
    "tests/test_service.py": ({"kvbroker.broker.runtime._broker"}, "patches the protocol version the broker speaks"),
    "tests/test_session.py": ({"kvbroker.broker.runtime._room_sides"}, "lists the sides of a room on a broker"),
    "tests/unit/test_batched_copies.py": ({"kvbroker.broker.device._block_copies"}, "switches the GPU-gather-on-host flag"),
    "tests/unit/test_devcrc.py": ({"kvbroker.broker.device._devcrc_triton"}, "loads the Triton kernel's module, or a stand-in, by name"),
    "tests/unit/test_room_timeouts.py": (
        {"kvbroker.adapters._timeouts", "kvbroker.adapters._vllm_config"},
        "the engines' timeout translations (the adapters' faces import their engines)",
    ),
}


def _private_imports(path: Path) -> set[str]:
    """The private modules ``path`` imports: ``from a._b import x``, ``from a import _b``, ``import a._b``."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvbroker"):
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names if a.name.startswith("kvbroker")]
        else:
            continue
        found.update(m for m in modules if any(part.startswith("_") for part in m.split(".")))
    return found


def test_tests_import_from_package_faces() -> None:
    """No test imports a private module, but a unit test its own subject and the listed exceptions."""
    wrong: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        allowed = PRIVATE_IMPORTS_ALLOWED.get(name, (set(), ""))[0]
        subject = "_" + path.stem.removeprefix("test_")
        bad = {m for m in _private_imports(path) if m not in allowed and not (name.startswith("tests/unit/") and m.endswith("." + subject))}
        if bad:
            wrong[name] = bad
    assert not wrong, f"private imports outside PRIVATE_IMPORTS_ALLOWED: {wrong}"
