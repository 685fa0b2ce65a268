"""How a benchmark script ends: its report, its failures, its exit status.

Shared by the benchmark scripts (they import it as a sibling module).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["finish"]


def finish(
    script: str,
    result: dict[str, Any] | None,
    problems: list[str],
    *,
    interrupted: bool,
    as_json: bool,
    print_report: Callable[[dict[str, Any]], None],
    report_lists_failures: bool = False,
) -> int:
    """Print ``result`` (one JSON line, or ``print_report``) with ``problems``
    as its ``failures``, then each problem on stderr (unless the printed
    report already lists them); the exit status: 130 when interrupted, 1 on
    any problem, else 0."""
    if interrupted:
        print(f"{script}: interrupted", file=sys.stderr)
        return 130
    if result is not None:
        result["failures"] = problems
        if as_json:
            print(json.dumps(result))
        else:
            print_report(result)
    if result is None or as_json or not report_lists_failures:
        for problem in problems:
            print(f"{script}: FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0
