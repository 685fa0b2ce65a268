"""The broker's own bundles (beside ``execution``'s ``Machines``,
``Transport``, ``Copying`` and ``Telemetry``):

- :class:`Routes`: the call routes the servicers and the server hand calls to;
- :class:`Services`: what runs beside the routes (the NIXL agent, the engine
  table, background tasks, the executor and the receive credits, the peer
  monitor, the fd socket, the fleet in etcd), which
  :class:`~kvbroker.broker.runtime.Broker` starts and stops, and the late
  callbacks it checks are set before it starts;
- :class:`Internals`: every part, for tests that inject faults (the one
  deliberate seam: ``Broker.internals``; broker code never reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbroker.broker.dataplane import Agent
from kvbroker.broker.execution import (
    Copying,
    Credits,
    Executor,
    Machines,
    TaskSet,
    Telemetry,
    Transport,
    TransportProbes,
)
from kvbroker.broker.memory import EngineTable, FdSocketServer
from kvbroker.broker.peers import FleetRecord, FleetView, PeerMonitor
from kvbroker.broker.runtime._engine_calls import EngineCalls
from kvbroker.broker.runtime._housekeeping import Housekeeping
from kvbroker.broker.runtime._late import LateCalls
from kvbroker.broker.runtime._operators import Operators
from kvbroker.broker.runtime._peer_loss import PeerLoss
from kvbroker.broker.runtime._peer_requests import PeerRequests
from kvbroker.broker.runtime._sessions import Sessions

__all__ = ["Internals", "Routes", "Services"]


@dataclass(frozen=True, eq=False)
class Routes:
    """The call routes: each decodes its calls and enters the state machines in a turn."""

    #: Engines on this host: register, open rooms, send chunks, abort, poll, watch.
    engine_calls: EngineCalls
    #: The engines' session streams.
    sessions: Sessions
    #: Other brokers: handshake, room registrations, staging, completion, aborts.
    peer_requests: PeerRequests
    #: A peer broker lost (silent, restarted, or gone from etcd).
    peer_loss: PeerLoss
    #: Drain, abort a room, the fleet's status.
    operators: Operators
    #: Timeouts, eviction and the metric gauges, while nobody calls.
    housekeeping: Housekeeping
    #: The transport self-test (``Admin.ProbeTransport``).
    probes: TransportProbes


@dataclass(frozen=True, eq=False)
class Services:
    """What runs beside the routes, started and stopped with the broker."""

    agent: Agent
    engines: EngineTable
    tasks: TaskSet
    executor: Executor
    #: Receive credits, both sides (Admin and metrics read them).
    credits: Credits
    monitor: PeerMonitor
    fd_server: FdSocketServer
    #: The fleet in etcd (``serve --etcd``; None without): this broker's
    #: record, and its view of every broker's.
    fleet_record: FleetRecord | None
    fleet_view: FleetView | None
    #: The callbacks into parts made after the parts that call them (``_late``).
    late: LateCalls


@dataclass(frozen=True, eq=False)
class Internals:
    """Every part of one broker, for tests that inject faults or drive a part
    directly (``Broker.internals``). Broker code never reads it (checked by
    tests/test_code_quality.py); tests that only read use ``Broker.queries``."""

    machines: Machines
    transport: Transport
    copying: Copying
    telemetry: Telemetry
    routes: Routes
    services: Services
