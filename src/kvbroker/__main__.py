"""``python -m kvbroker`` is the ``kvbroker`` command."""

from __future__ import annotations

from kvbroker.cli import main

raise SystemExit(main())
