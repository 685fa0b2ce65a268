"""The table of peer calls: every ``PeerBroker`` method, read from the proto.

The proto is the one place a peer call is defined. Each method of the
``PeerBroker`` service but ``Stream`` is a row of :data:`PEER_METHODS`: its
name, its request and answer types, and the field of ``PeerCall.call`` and
``PeerAnswer.answer`` that carries it on the peer stream (None for the calls
that stay unary: ``Handshake`` opens the stream, the transport self-test's
probe calls measure a fresh call). Both sides dispatch through the table:

- the callee answers a call with the handler that names its method
  (:func:`answers`; ``runtime.PeerRequests`` holds them), through one chain
  (``api._peer_calls``) whether it came unary or on the stream;
- the caller makes it with :class:`~kvbroker.broker.peers.PeerCaller`, typed
  by the method's handle below, on the stream when the method rides it.

Adding a peer call: its request and answer messages and its ``rpc`` in
``peer.proto`` (and, to ride the stream, a field of each oneof), one
handler marked ``@answers("Name")``, and, for this broker to make the call,
a typed handle here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

from kvbroker.v1 import peer_pb2

__all__ = [
    "ABORT_ROOMS",
    "BY_FIELD",
    "GRANT_CREDITS",
    "HANDSHAKE",
    "PEER_METHODS",
    "PING",
    "REGISTER_ROOMS",
    "RELEASE_PROBE",
    "RENEW_LEASES",
    "REPORT_COMPLETION",
    "RESERVE_PROBE",
    "RESERVE_STAGING",
    "RETURN_CREDITS",
    "PeerMethod",
    "answers",
    "handlers_of",
]

Req = TypeVar("Req", bound=Message)
Ans = TypeVar("Ans", bound=Message)

#: The service the table is read from.
SERVICE = peer_pb2.DESCRIPTOR.services_by_name["PeerBroker"]


@dataclass(frozen=True)
class PeerMethod(Generic[Req, Ans]):
    """One peer call: what its request and answer are, and how it travels."""

    #: The ``PeerBroker`` method ("RegisterRooms").
    name: str
    request: type[Req]
    answer: type[Ans]
    #: The field of ``PeerCall.call`` and ``PeerAnswer.answer`` that carries it
    #: on the peer stream (None: unary only).
    field: str | None
    #: Whether its request names the caller's protocol version (the answering
    #: chain refuses another one).
    versioned: bool

    @property
    def path(self) -> str:
        """Its full gRPC method name (the unary call's)."""
        return f"/{SERVICE.full_name}/{self.name}"


def _read_table() -> dict[str, PeerMethod[Any, Any]]:
    """Every method of the service, checked against the stream's oneofs: a
    request carried by ``PeerCall`` must have its answer in ``PeerAnswer``
    under the same field name."""
    oneof_calls = peer_pb2.PeerCall.DESCRIPTOR.oneofs_by_name["call"].fields
    oneof_answers = peer_pb2.PeerAnswer.DESCRIPTOR.oneofs_by_name["answer"].fields
    calls = {f.message_type.full_name: f.name for f in oneof_calls if f.message_type is not None}
    answers = {f.name: f.message_type.full_name for f in oneof_answers if f.message_type is not None}
    table: dict[str, PeerMethod[Any, Any]] = {}
    for method in SERVICE.methods:
        if method.client_streaming or method.server_streaming:
            continue  # the stream itself
        field = calls.get(method.input_type.full_name)
        if field is not None and answers.get(field) != method.output_type.full_name:
            raise TypeError(
                f"PeerCall.{field} carries {method.name}'s request, but PeerAnswer.{field} does not carry "
                f"its answer {method.output_type.full_name} (peer.proto)"
            )
        table[method.name] = PeerMethod(
            name=method.name,
            request=getattr(peer_pb2, method.input_type.name),
            answer=getattr(peer_pb2, method.output_type.name),
            field=field,
            versioned="protocol_version" in method.input_type.fields_by_name,
        )
    return table


#: Every peer call, by method name.
PEER_METHODS: Mapping[str, PeerMethod[Any, Any]] = MappingProxyType(_read_table())
#: The calls the stream carries, by their ``PeerCall.call`` field.
BY_FIELD: Mapping[str, PeerMethod[Any, Any]] = MappingProxyType(
    {m.field: m for m in PEER_METHODS.values() if m.field is not None}
)


def _handle(name: str, request: type[Req], answer: type[Ans]) -> PeerMethod[Req, Ans]:
    """The typed handle of method ``name`` (its types checked against the table)."""
    method = PEER_METHODS[name]
    if method.request is not request or method.answer is not answer:
        raise TypeError(f"{name} takes {method.request.__name__} and answers {method.answer.__name__} (peer.proto)")
    return method


HANDSHAKE = _handle("Handshake", peer_pb2.HandshakeRequest, peer_pb2.HandshakeResponse)
REGISTER_ROOMS = _handle("RegisterRooms", peer_pb2.RegisterRoomsRequest, peer_pb2.RegisterRoomsResponse)
RESERVE_STAGING = _handle("ReserveStaging", peer_pb2.ReserveStagingRequest, peer_pb2.ReserveStagingResponse)
REPORT_COMPLETION = _handle("ReportCompletion", peer_pb2.CompletionReport, peer_pb2.CompletionAck)
ABORT_ROOMS = _handle("AbortRooms", peer_pb2.PeerAbortRoomsRequest, peer_pb2.PeerAbortRoomsResponse)
PING = _handle("Ping", peer_pb2.PingRequest, peer_pb2.PingResponse)
RESERVE_PROBE = _handle("ReserveProbe", peer_pb2.ReserveProbeRequest, peer_pb2.ReserveProbeResponse)
RELEASE_PROBE = _handle("ReleaseProbe", peer_pb2.ReleaseProbeRequest, peer_pb2.ReleaseProbeResponse)
GRANT_CREDITS = _handle("GrantCredits", peer_pb2.GrantCreditsRequest, peer_pb2.GrantCreditsResponse)
RETURN_CREDITS = _handle("ReturnCredits", peer_pb2.ReturnCreditsRequest, peer_pb2.ReturnCreditsResponse)
RENEW_LEASES = _handle("RenewLeases", peer_pb2.RenewLeasesRequest, peer_pb2.RenewLeasesResponse)

#: The attribute :func:`answers` marks a handler with.
_MARK = "__peer_method__"

F = TypeVar("F", bound=Callable[..., Any])


def answers(name: str) -> Callable[[F], F]:
    """Mark a method as the handler of peer call ``name``: it takes the
    request and returns the answer, or an awaitable of it (a call that may
    wait), and raises ``KvBrokerError`` for a status."""
    if name not in PEER_METHODS:
        raise KeyError(f"PeerBroker has no method {name!r} (peer.proto)")

    def mark(fn: F) -> F:
        setattr(fn, _MARK, name)
        return fn

    return mark


def handlers_of(*owners: object) -> dict[str, Callable[[Any], Any]]:
    """The handlers marked with :func:`answers` on ``owners``, by method name:
    exactly one for every method of the table (``TypeError`` naming what is
    missing or answered twice, when the broker is built)."""
    found: dict[str, Callable[[Any], Any]] = {}
    for owner in owners:
        for attr in dir(type(owner)):
            name = getattr(getattr(type(owner), attr, None), _MARK, None)
            if name is None:
                continue
            if name in found:
                raise TypeError(f"two handlers answer PeerBroker.{name}")
            found[name] = getattr(owner, attr)
    if missing := sorted(set(PEER_METHODS) - set(found)):
        raise TypeError(f"no handler answers PeerBroker.{', '.join(missing)} (mark one with @answers)")
    return found
