"""Strict type checking of the kvbroker packages: ``python tools/typecheck.py``.

mypy cannot follow setuptools' package-dir mapping in an editable install, so
this runs ``mypy -p kvbroker`` in the installed layout (tools/installed.py)
with the project's configuration. Exit status is mypy's.
"""

from __future__ import annotations

import subprocess
import sys

from installed import ROOT, installed_tree


def main() -> int:
    with installed_tree() as tmp:
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "kvbroker"]
        return subprocess.run(cmd, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
