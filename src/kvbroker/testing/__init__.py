"""Test helpers that ship with kvbroker.

- :class:`FakeAgent` — the scripted fake NIXL agent (one fake, in one place);
- :class:`LoopThread` — an event loop on a thread, for in-process brokers;
- :class:`~kvbroker.brokerproc.BrokerProcess` — ``kvbroker serve`` as a child;
- :func:`scratch_dir` — a short working directory, removed afterwards.
"""

from __future__ import annotations

from kvbroker.brokerproc import BrokerProcess
from kvbroker.testing.fake_nixl import FakeAgent, FakeFabric, XferScript
from kvbroker.testing.loop import LoopThread
from kvbroker.testing.scratch import scratch_dir

__all__ = ["BrokerProcess", "FakeAgent", "FakeFabric", "LoopThread", "XferScript", "scratch_dir"]
