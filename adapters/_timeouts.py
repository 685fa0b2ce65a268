"""An engine's own room timeouts, read from its configuration (either adapter).

vLLM engines set them in ``kv_connector_extra_config``
(``_vllm_config.room_timeouts_of``: kvbroker's keys, else NixlConnector's
``kv_lease_duration`` for the prefill's lease), SGLang engines in their
environment (:func:`sglang_timeouts`: kvbroker's variables, else SGLang's own
disaggregation timeouts where they mean the same wait). :func:`first_set`
picks, per ``RoomTimeouts`` field, the first of its names that is set;
:func:`timeouts_from` turns the settings found (seconds, as numbers or
strings) into the :class:`~kvbroker.client.RoomTimeouts` the rank registers
with, or refuses a value by the name the user wrote.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvbroker.client import RoomTimeouts
from kvbroker.errors import InvalidArgument

__all__ = ["SGLANG_TIMEOUT_ENV", "first_set", "sglang_timeouts", "timeouts_from"]

#: ``RoomTimeouts`` field -> the environment variables an SGLang engine sets
#: it with, first found wins: kvbroker's, then SGLang's own where it bounds
#: the same wait (SGLang's prefill fails a request still Bootstrapping after
#: SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT; its decode one still waiting for
#: its KV after SGLANG_DISAGGREGATION_WAITING_TIMEOUT). Unset: the broker's flag.
SGLANG_TIMEOUT_ENV = {
    "sender_info_seconds": ("KVBROKER_SENDER_INFO_TIMEOUT", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"),
    "bootstrap_seconds": ("KVBROKER_BOOTSTRAP_TIMEOUT",),
    "receiver_data_seconds": ("KVBROKER_RECEIVER_DATA_TIMEOUT", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"),
}


def timeouts_from(settings: Mapping[str, tuple[str, object]], where: str) -> RoomTimeouts:
    """``settings``: ``RoomTimeouts`` field -> (the setting's name, its value).
    A value that is not a number of seconds above 0 (and at most a day)
    raises ``InvalidArgument`` naming the setting and ``where`` it is."""
    values: dict[str, float] = {}
    for field, (name, value) in settings.items():
        try:
            seconds = float(value)  # type: ignore[arg-type]
            RoomTimeouts(**{field: seconds})
        except (TypeError, ValueError, InvalidArgument):
            raise InvalidArgument(
                f"{where} {name} {value!r} is not a timeout kvbroker takes: a number of seconds above 0, at most a "
                "day (leave it out for the broker's own flag)"
            ) from None
        values[field] = seconds
    return RoomTimeouts(**values)


def first_set(source: Mapping[str, object], names: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, object]]:
    """``names``: ``RoomTimeouts`` field -> the settings that set it, first
    set wins (None or a blank string is not set). Returns field -> (the
    setting's name, its value), for :func:`timeouts_from`."""
    found: dict[str, tuple[str, object]] = {}
    for field, candidates in names.items():
        for name in candidates:
            value = source.get(name)
            if value is not None and not (isinstance(value, str) and not value.strip()):
                found[field] = (name, value)
                break
    return found


def sglang_timeouts(environ: Mapping[str, str]) -> RoomTimeouts:
    """An SGLang engine's room timeouts from ``environ`` (:data:`SGLANG_TIMEOUT_ENV`)."""
    return timeouts_from(first_set(environ, SGLANG_TIMEOUT_ENV), "the environment variable")
