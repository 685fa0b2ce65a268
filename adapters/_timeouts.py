"""An engine's own room timeouts, read from its configuration (either adapter).

vLLM engines set them in ``kv_connector_extra_config``
(``_vllm_config.room_timeouts_of``), SGLang engines in their environment
(:func:`sglang_timeouts`: kvbroker's variables, else SGLang's own
disaggregation timeouts where they mean the same wait); :func:`timeouts_from`
turns the settings found (seconds, as numbers or strings) into the
:class:`~kvbroker.client.RoomTimeouts` the rank registers with, or refuses a
value by the name the user wrote.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvbroker.client import RoomTimeouts
from kvbroker.errors import InvalidArgument

__all__ = ["SGLANG_TIMEOUT_ENV", "sglang_timeouts", "timeouts_from"]

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


def sglang_timeouts(environ: Mapping[str, str]) -> RoomTimeouts:
    """An SGLang engine's room timeouts from ``environ`` (:data:`SGLANG_TIMEOUT_ENV`)."""
    found: dict[str, tuple[str, object]] = {}
    for field, names in SGLANG_TIMEOUT_ENV.items():
        name = next((n for n in names if environ.get(n, "").strip()), None)
        if name is not None:
            found[field] = (name, environ[name])
    return timeouts_from(found, "the environment variable")
