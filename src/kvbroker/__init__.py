"""kvbroker: a per-host KV-cache transfer broker for disaggregated LLM serving.

Import namespaces:

- ``kvbroker.client`` — what an inference engine uses (sender/receiver per room,
  memory helpers).
- ``kvbroker.broker`` — the broker service (``kvbroker serve``).
- ``kvbroker.errors`` — the one error hierarchy, shared by both.
- ``kvbroker.v1`` — generated protobuf/gRPC code for ``proto/kvbroker/v1``.
- ``kvbroker.testing`` — the scripted fake NIXL agent and test helpers.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
