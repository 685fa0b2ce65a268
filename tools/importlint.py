"""The packages' layers, checked: ``python tools/importlint.py``.

Runs import-linter (``lint-imports``) on the contracts in pyproject.toml's
``[tool.importlinter]``, in the installed layout (tools/installed.py): the
import graph tools cannot see broker/ as kvbroker.broker in an editable
install. Exit status is lint-imports'.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from installed import ROOT, installed_tree


def main() -> int:
    lint = Path(sys.executable).with_name("lint-imports")
    with installed_tree() as tmp:
        env = {**os.environ, "PYTHONPATH": str(tmp)}
        cmd = [str(lint), str(ROOT / "pyproject.toml"), "--no-cache"]
        return subprocess.run(cmd, cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
