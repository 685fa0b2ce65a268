"""The engines' room commands, typed: what an engine asks of a room machine.

Each is decoded from its proto once (``runtime``'s ``_commands``, for the
unary calls and the session stream alike) and handed to one machine method:
:class:`ExpectRoom` to ``ReceiverCore.expect``, :class:`BeginSend` to
``SenderCore.begin``, :class:`SendChunk` to ``SenderCore.chunk`` and
:class:`Abort` to either side's ``abort``, :class:`AnnounceRoom` to
``ReceiverCore.announcements.announce``.

Frozen all through: no field can be set again, and the index arrays a
command holds (``pages``, each of ``state``'s) are made read-only and
``state`` a read-only mapping when it is built. The machine validates a
command's indices once and its records keep the very arrays (a receiver
rank's pages, a sent chunk's), so nothing may write them afterwards. It
costs no copy (packed indices decode read-only already, ``np.frombuffer``
over the request's bytes; the rest get their flag turned off): about 0.25 us
a command, where a chunk costs the broker some 100 us.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvbroker.broker.memory import Engine
from kvbroker.plan import NO_STATE, IndexArray, read_only

__all__ = ["Abort", "AnnounceRoom", "BeginSend", "ExpectRoom", "SendChunk"]


def _no_state() -> Mapping[str, IndexArray]:
    return NO_STATE


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpectRoom:
    """A decode rank opens ``room`` to receive into ``pages`` from a sender group."""

    engine: Engine
    room: int
    #: The sender's broker, and the prefill engine group whose ranks send.
    sender_address: str
    sender_group: str
    #: The engine's pages the room's KV lands in, in room order.
    pages: IndexArray
    aux_row: int | None = None
    #: State components' indices, by component.
    state: Mapping[str, IndexArray] = field(default_factory=_no_state)
    #: The leading pages of the room the rank holds already (not sent).
    prefix_pages: int = 0
    #: Checksum every chunk where it landed, against the sender's.
    verify_checksum: bool = False
    #: The room's class (``common_pb2.RoomPriority``; 0: unspecified) and deadline (monotonic s).
    priority: int = 0
    deadline: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", read_only(self.pages, self.state))


@dataclass(frozen=True, slots=True, kw_only=True)
class BeginSend:
    """A prefill rank opens its side of ``room``: ``num_pages`` over all chunks (0: not said)."""

    engine: Engine
    room: int
    num_pages: int = 0
    #: The room's class until the decode side's registration says its own, and deadline (monotonic s).
    priority: int = 0
    deadline: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SendChunk:
    """A prefill rank's next computed ``pages`` of ``room``."""

    engine: Engine
    room: int
    pages: IndexArray
    is_last: bool = False
    aux_row: int | None = None
    state: Mapping[str, IndexArray] = field(default_factory=_no_state)
    #: The room page the chunk starts at (only the first chunk may move it).
    room_page: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", read_only(self.pages, self.state))


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort:
    """Give up ``engine``'s side of ``room``; ``by``: who asked (engine, operator)."""

    engine: Engine
    room: int
    reason: str = ""
    by: str = "engine"


@dataclass(frozen=True, slots=True, kw_only=True)
class AnnounceRoom:
    """A decode rank still wants ``room`` from a sender group, before it can
    open it (ExpectRoom): its broker renews the sources' leases meanwhile."""

    engine: Engine
    room: int
    #: The sender's broker, and the prefill engine group whose ranks send.
    sender_address: str
    sender_group: str
