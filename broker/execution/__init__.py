"""Carrying out what the room state machines decide: NIXL writes, staging and
device copies, peer calls and notices; the turn every entry into the state
machines is made in, and the bundles the broker's parts are handed.
"""

from kvbroker.broker.execution._bundles import Copying, Machines, Telemetry, Transport
from kvbroker.broker.execution._calls_to_peers import CallsToPeers
from kvbroker.broker.execution._credits import Credits
from kvbroker.broker.execution._device_copies import DeviceCopies
from kvbroker.broker.execution._executor import Executor, Handlers, transport_text
from kvbroker.broker.execution._parts import PartsInFlight
from kvbroker.broker.execution._probes import TransportProbes
from kvbroker.broker.execution._receiving_parts import ReceivingParts
from kvbroker.broker.execution._registration import Registrations
from kvbroker.broker.execution._room_end import receive_wait_owner
from kvbroker.broker.execution._tasks import TaskSet
from kvbroker.broker.execution._tickets import part_ticket, side_ticket
from kvbroker.broker.execution._turn import Turn, in_turn

__all__ = [
    "CallsToPeers",
    "Copying",
    "Credits",
    "DeviceCopies",
    "Executor",
    "Handlers",
    "Machines",
    "PartsInFlight",
    "ReceivingParts",
    "Registrations",
    "TaskSet",
    "Telemetry",
    "Transport",
    "TransportProbes",
    "transport_text",
    "Turn",
    "in_turn",
    "part_ticket",
    "receive_wait_owner",
    "side_ticket",
]
