"""Strict type checking of the kvbroker packages: ``python tools/typecheck.py``.

mypy cannot follow setuptools' package-dir mapping (broker/ -> kvbroker.broker,
...) in an editable install, so this builds the installed layout out of
symlinks in a temporary directory and runs ``mypy -p kvbroker`` there with
the project's configuration. Exit status is mypy's.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"broker": "broker", "client": "client", "demo": "demo", "adapters": "adapters"}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvbroker-typecheck-") as tmp:
        package = Path(tmp) / "kvbroker"
        package.mkdir()
        for entry in (ROOT / "src" / "kvbroker").iterdir():
            if entry.name != "__pycache__":
                (package / entry.name).symlink_to(entry)
        for name, folder in MAPPED.items():
            (package / name).symlink_to(ROOT / folder)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "kvbroker"]
        return subprocess.run(cmd, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
