"""Test helpers that ship with kvbroker.

- :class:`FakeAgent` — the scripted fake NIXL agent (one fake, in one place);
- :class:`LoopThread` — an event loop on a thread, for in-process brokers;
- :func:`start_fake_broker` / :class:`FakeBroker` — an in-process broker with
  a fake agent, on a :class:`LoopThread`;
- :class:`~kvbroker.brokerproc.BrokerProcess` — ``kvbroker serve`` as a child;
- :func:`eventually` — wait until a condition holds (the one polling helper);
- :func:`wait_until_idle` — brokers back to idle: no rooms, no buffer reserved;
- :func:`wait_until_warm` — no engine's memory still being faulted in;
- :class:`Cleanup` — teardown steps that all run and whose errors all surface;
- :func:`scratch_dir` — a short working directory, removed afterwards;
- :class:`TcpGate` — a TCP forwarder that cuts a client off its broker and lets it back.

The reference workload, imported by module (``kvbroker demo`` and the soak
benchmark use it too): ``pattern``, the reference bytes of every element
from the model's coordinates alone; ``room_plan``, which pages each room uses
on each side. ``rawpeer``, the benchmarks' baseline (a bare NIXL agent
pair), is imported by module too.

Each name above loads on first use, so importing one module of the package
(the demo's engine processes import ``pattern``) does not load the broker.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbroker.brokerproc import BrokerProcess
    from kvbroker.testing.cleanup import Cleanup
    from kvbroker.testing.fake_nixl import FakeAgent, FakeFabric, XferScript
    from kvbroker.testing.gate import TcpGate
    from kvbroker.testing.idle import wait_until_idle, wait_until_warm
    from kvbroker.testing.inprocess import FakeBroker, start_fake_broker
    from kvbroker.testing.loop import LoopThread
    from kvbroker.testing.scratch import scratch_dir
    from kvbroker.testing.waiting import eventually

__all__ = [
    "BrokerProcess",
    "Cleanup",
    "FakeAgent",
    "FakeBroker",
    "FakeFabric",
    "LoopThread",
    "TcpGate",
    "XferScript",
    "eventually",
    "scratch_dir",
    "start_fake_broker",
    "wait_until_idle",
    "wait_until_warm",
]

#: The module each name of ``__all__`` lives in.
_HOMES = {
    "BrokerProcess": "kvbroker.brokerproc",
    "Cleanup": "kvbroker.testing.cleanup",
    "FakeAgent": "kvbroker.testing.fake_nixl",
    "FakeBroker": "kvbroker.testing.inprocess",
    "FakeFabric": "kvbroker.testing.fake_nixl",
    "LoopThread": "kvbroker.testing.loop",
    "TcpGate": "kvbroker.testing.gate",
    "XferScript": "kvbroker.testing.fake_nixl",
    "eventually": "kvbroker.testing.waiting",
    "scratch_dir": "kvbroker.testing.scratch",
    "start_fake_broker": "kvbroker.testing.inprocess",
    "wait_until_idle": "kvbroker.testing.idle",
    "wait_until_warm": "kvbroker.testing.idle",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
