"""Test helpers that ship with kvbroker: the scripted fake NIXL agent."""

from __future__ import annotations

from kvbroker.testing.fake_nixl import FakeAgent, FakeFabric, XferScript

__all__ = ["FakeAgent", "FakeFabric", "XferScript"]
