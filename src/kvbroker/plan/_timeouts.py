"""An engine rank's own timeouts for the rooms it opens (``kvbroker.v1.RoomTimeouts``).

An engine may set how long a sending room waits for its receivers (the
prefill's lease on its pages), how long a receiving room looks for its
sender, and how long it then waits for its data; what it leaves unset is
the broker's flag. The client builds a :class:`RoomTimeouts` and sends it
with RegisterEngine; the broker reads it back (:meth:`RoomTimeouts.from_proto`,
the same check) and asks :meth:`RoomTimeouts.limit` for each wait's bound and
how a failure cause names where it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from kvbroker.errors import InvalidArgument
from kvbroker.v1 import common_pb2

__all__ = ["MAX_TIMEOUT_SECONDS", "Limit", "RoomTimeouts", "Wait"]

#: The longest timeout an engine may set (a day): a longer one is a mistake.
MAX_TIMEOUT_SECONDS = 86400.0

#: The waits an engine may bound (the fields of ``RoomTimeouts``).
Wait = Literal["sender_info_seconds", "bootstrap_seconds", "receiver_data_seconds"]

#: Each wait -> the broker flag that bounds it when the engine does not.
_FLAGS: dict[str, str] = {
    "sender_info_seconds": "--sender-info-timeout",
    "bootstrap_seconds": "--bootstrap-timeout",
    "receiver_data_seconds": "--receiver-data-timeout",
}


@dataclass(frozen=True, slots=True)
class Limit:
    """One wait's bound, and where it came from (for a failure's cause)."""

    seconds: float
    source: str

    def __str__(self) -> str:
        return f"{self.seconds:g} s ({self.source})"


@dataclass(frozen=True, slots=True)
class RoomTimeouts:
    """An engine rank's timeouts for its rooms, in seconds (None: the broker's flag).

    - ``sender_info_seconds``: a sending room waits this long for its
      receivers to open the room (ExpectRoom), then fails TIMEOUT: the
      prefill's lease on the pages it sends (``--sender-info-timeout``).
    - ``bootstrap_seconds``: a receiving room retries this long to reach the
      sender's broker and find its group there (``--bootstrap-timeout``).
    - ``receiver_data_seconds``: a receiving room, once registered with the
      sender's broker, waits this long for all its data
      (``--receiver-data-timeout``).

    ``InvalidArgument`` for a value that is not a number of seconds above 0
    and at most :data:`MAX_TIMEOUT_SECONDS`.
    """

    sender_info_seconds: float | None = None
    bootstrap_seconds: float | None = None
    receiver_data_seconds: float | None = None

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if value is None:
                continue
            sensible = (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
                and 0 < value <= MAX_TIMEOUT_SECONDS
            )
            if not sensible:
                raise InvalidArgument(
                    f"RoomTimeouts.{item.name} {value!r} must be a number of seconds above 0 and at most "
                    f"{MAX_TIMEOUT_SECONDS:g} (or unset: the broker's {_FLAGS[item.name]})"
                )
            object.__setattr__(self, item.name, float(value))

    @classmethod
    def from_proto(cls, message: common_pb2.RoomTimeouts) -> RoomTimeouts:
        """The timeouts an engine sent (0: unset), checked as the constructor checks them."""
        return cls(
            sender_info_seconds=message.sender_info_seconds or None,
            bootstrap_seconds=message.bootstrap_seconds or None,
            receiver_data_seconds=message.receiver_data_seconds or None,
        )

    def to_proto(self) -> common_pb2.RoomTimeouts:
        return common_pb2.RoomTimeouts(
            sender_info_seconds=self.sender_info_seconds or 0.0,
            bootstrap_seconds=self.bootstrap_seconds or 0.0,
            receiver_data_seconds=self.receiver_data_seconds or 0.0,
        )

    def limit(self, name: Wait, flag_seconds: float) -> Limit:
        """The bound of wait ``name``: the engine's, else the flag's."""
        own: float | None = getattr(self, name)
        if own is None:
            return Limit(flag_seconds, f"the broker's {_FLAGS[name]}")
        return Limit(own, f"the engine's RoomTimeouts.{name}")

    def effective(self, *, sender_info: float, bootstrap: float, receiver_data: float) -> common_pb2.RoomTimeouts:
        """What applies to this engine's rooms, given the broker's flags."""
        return common_pb2.RoomTimeouts(
            sender_info_seconds=self.limit("sender_info_seconds", sender_info).seconds,
            bootstrap_seconds=self.limit("bootstrap_seconds", bootstrap).seconds,
            receiver_data_seconds=self.limit("receiver_data_seconds", receiver_data).seconds,
        )
