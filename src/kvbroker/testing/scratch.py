"""Short-lived working directories for broker processes (logs, sockets)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["scratch_dir"]


@contextmanager
def scratch_dir(prefix: str, keep_on_error: bool = False) -> Iterator[Path]:
    """A fresh directory under the system temp dir, removed on exit.

    Short on purpose: unix socket paths inside it must stay under 108 bytes,
    which pytest's ``tmp_path`` does not promise. With ``keep_on_error`` it
    stays when the block raises, so the broker logs in it can be read.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        if not keep_on_error:
            shutil.rmtree(path, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
