"""deploy/: the Kubernetes manifests parse into the official Kubernetes Python client's models with
no unknown field anywhere (a misspelt field fails), the DaemonSet's broker arguments are ones
`kvbroker serve` accepts, and the Dockerfile keeps its promises (multi-stage, non-root, a
healthcheck, no build tools in the final stage). Offline: nothing here builds an image or talks
to a cluster."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes = pytest.importorskip("kubernetes")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
_MODELS = {("v1", "ConfigMap"): "V1ConfigMap", ("apps/v1", "DaemonSet"): "V1DaemonSet"}
_SCALARS = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object, "datetime": str}


def _check_model(data: Any, model: str, path: str) -> None:
    cls = getattr(kubernetes.client, model)
    assert isinstance(data, dict), f"{path}: a {model} is a mapping"
    by_json = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    for key, value in data.items():
        assert key in by_json, f"{path}.{key}: not a field of {model}"
        _check_value(value, cls.openapi_types[by_json[key]], f"{path}.{key}")


def _check_value(value: Any, kind: str, path: str) -> None:
    # The client writes container types as list[X] / dict(str, X) or List[X] / Dict[str, X].
    if kind.lower().startswith("list["):
        assert isinstance(value, list), f"{path}: a list"
        for i, item in enumerate(value):
            _check_value(item, kind[5:-1], f"{path}[{i}]")
    elif kind.lower().startswith(("dict(", "dict[")):
        assert isinstance(value, dict), f"{path}: a mapping"
        inner = kind[kind.index(",") + 1 : -1].strip()
        for key, item in value.items():
            _check_value(item, inner, f"{path}.{key}")
    elif kind in _SCALARS:
        assert isinstance(value, _SCALARS[kind]), f"{path}: {value!r} is not {kind}"
    else:
        _check_model(value, kind, path)


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def test_every_manifest_is_a_valid_kubernetes_object() -> None:
    """deploy/'s manifests are a ConfigMap and a DaemonSet, each valid against its Kubernetes API model."""
    docs = _manifests()
    assert {doc["kind"] for _, doc in docs} == {"ConfigMap", "DaemonSet"}
    for name, doc in docs:
        _check_model(doc, _MODELS[(doc["apiVersion"], doc["kind"])], name)


def test_the_daemonset_runs_kvbroker_serve_with_flags_it_has() -> None:
    """Every argument parses as `kvbroker serve` parses it ($(VAR) filled from the ConfigMap), the
    probes use grpc.health.v1, the engine socket is on the shared hostPath."""
    from kvbroker.cli import main

    docs = dict((doc["kind"], doc) for _, doc in _manifests())
    config = docs["ConfigMap"]["data"]
    spec = docs["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {**config, "NODE_IP": "10.0.0.5"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    with pytest.raises(SystemExit) as done:
        main(["serve", *args, "--help"])  # parses every flag first; --help then exits 0
    assert done.value.code == 0
    assert container["readinessProbe"]["grpc"]["port"] == container["livenessProbe"]["grpc"]["port"] == 50051
    socket_dir = next(v["hostPath"]["path"] for v in spec["volumes"] if v["name"] == "engine-socket")
    assert args[args.index("--uds") + 1].startswith(socket_dir + "/")
    assert container["securityContext"]["runAsNonRoot"] and spec["hostNetwork"]
    annotations = docs["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == args[args.index("--metrics-port") + 1]


def test_the_dockerfile_is_multi_stage_non_root_with_a_healthcheck() -> None:
    """The Dockerfile builds in stages; its final stage runs as a non-root user, checks grpc_health and installs no
    build tools."""
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) >= 2, "multi-stage"
    final = stages[-1]
    assert re.search(r"^USER (?!root|0\b)\S+", final, re.M), "the final stage runs as a non-root user"
    assert "HEALTHCHECK" in final and "grpc_health" in final
    installs = " ".join(line for line in final.splitlines() if "apt-get install" in line or "pip install" in line)
    assert not re.search(r"\b(gcc|g\+\+|build-essential|make|cmake|clang)\b", installs), "no build tools in the final stage"
