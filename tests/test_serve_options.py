"""``kvbroker serve`` (and ``kvbroker fleet``) refuse at start what they could not do: an option
whose package is missing, or TLS files that are incomplete or unreadable. Exit status 2 and a
message naming what to install or fix, before anything listens (a real process each)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# Runs the CLI with one module made unimportable, as on a host where its package is not installed.
_WITHOUT = "import sys; sys.modules[{module!r}] = None; from kvbroker.cli import main; sys.exit(main({argv!r}))"


def _run(argv: list[str], *, without: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    code = _WITHOUT.format(module=without or "kvbroker_nothing_missing", argv=argv)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


@pytest.mark.parametrize(
    ("argv", "without", "env", "message"),
    [
        (["serve", "--etcd", "http://127.0.0.1:1"], "aetcd", {}, "--etcd needs the aetcd package.*pip install 'kvbroker\\[etcd\\]'"),
        (["fleet", "--etcd", "http://127.0.0.1:1"], "aetcd", {}, "--etcd needs the aetcd package.*pip install 'kvbroker\\[etcd\\]'"),
        (
            ["serve", "--metrics-port", "0"],
            "opentelemetry.exporter.prometheus",
            {},
            "--metrics-port needs the opentelemetry package.*pip install opentelemetry-exporter-prometheus",
        ),
        (
            ["serve"],
            "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
            {"OTEL_TRACES_EXPORTER": "otlp"},
            "OTEL_TRACES_EXPORTER=otlp needs.*pip install opentelemetry-exporter-otlp-proto-grpc",
        ),
    ],
    ids=["etcd", "fleet-etcd", "prometheus", "otlp"],
)
def test_an_option_whose_package_is_missing_fails_at_start(argv: list[str], without: str, env: dict[str, str], message: str) -> None:
    """An option whose package is not installed (etcd, Prometheus, OTLP) fails the command at start, exit 2, naming
    the pip install."""
    result = _run([*argv, "--listen", "127.0.0.1:0"] if argv[0] == "serve" else argv, without=without, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"kvbroker {argv[0]}: error: ")
    assert re.search(message, result.stderr), result.stderr
    assert "broker_started" not in result.stdout + result.stderr


def test_tls_files_must_come_together_and_be_readable(tmp_path: Path) -> None:
    """serve refuses, exit 2, a TLS certificate without its key and CA, and a TLS file it cannot read, naming it."""
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    partial = _run(["serve", "--listen", "127.0.0.1:0", "--tls-cert", str(cert)])
    assert partial.returncode == 2 and "--tls-cert without --tls-key, --tls-ca: mutual TLS needs all three" in partial.stderr
    missing = _run(["serve", "--listen", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(cert), "--tls-ca", str(tmp_path / "ca.pem")])
    assert missing.returncode == 2 and f"--tls-ca {tmp_path / 'ca.pem'}: no such readable file" in missing.stderr
