"""The installed layout of kvbroker, built out of symlinks, for tools that read packages by path.

setuptools' package-dir mapping (broker/ -> kvbroker.broker, client/ ->
kvbroker.client, ...) is invisible to tools that find a package's modules by
walking its folder (mypy, import-linter): in an editable install they see
src/kvbroker alone. :func:`installed_tree` makes a temporary folder holding
``kvbroker/`` as a wheel would install it, every entry a symlink into the
checkout, so edits need no rebuild.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Import name under kvbroker -> folder in the checkout (pyproject's package-dir).
MAPPED = {"broker": "broker", "client": "client", "demo": "demo", "adapters": "adapters"}


@contextmanager
def installed_tree() -> Iterator[Path]:
    """A temporary folder whose ``kvbroker/`` is the installed package (symlinks)."""
    with tempfile.TemporaryDirectory(prefix="kvbroker-installed-") as tmp:
        package = Path(tmp) / "kvbroker"
        package.mkdir()
        for entry in (ROOT / "src" / "kvbroker").iterdir():
            if entry.name != "__pycache__":
                (package / entry.name).symlink_to(entry)
        for name, folder in MAPPED.items():
            (package / name).symlink_to(ROOT / folder)
        yield Path(tmp)
