"""The generated protobuf/gRPC code in src/kvbroker/v1 is current with proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_matches_the_proto() -> None:
    """Regenerating from proto/ (tools/gen_proto.py --check) gives exactly the committed code."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--check"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr + out.stdout
