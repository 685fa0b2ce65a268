"""An engine request's priority as a room's class (either adapter).

Each engine orders its own requests by an integer priority; kvbroker's
brokers order a room's work by class (``RoomPriority``: interactive, standard,
bulk) and deadline. :class:`PriorityRule` is the mapping an engine is
configured with: two thresholds in the engine's own priority values and the
engine's direction (vLLM: a lower value is more urgent; SGLang: a larger one,
unless ``--schedule-low-priority-values-first``). A request at least as urgent
as ``interactive`` is interactive, one at most as urgent as ``bulk`` is bulk,
any other standard; with neither threshold set (the default) every room stays
unspecified, as before rooms had classes. Both sides of a room map their own
request: where both name a class, the decode side's wins on both brokers.

vLLM reads its rule from ``kv_connector_extra_config``
(:func:`vllm_priority_rule`) and a request's own class and deadline from its
``kv_transfer_params`` (:func:`room_class_of`: they win over the rule);
SGLang reads its rule from the environment (:func:`sglang_priority_rule`).
A value that is not one the mapping takes raises ``InvalidArgument`` naming
the setting where the user wrote it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvbroker.client.rooms import deadline_value, priority_value
from kvbroker.errors import InvalidArgument

__all__ = [
    "DEADLINE_KEY",
    "PRIORITY_KEY",
    "SGLANG_BULK_ENV",
    "SGLANG_INTERACTIVE_ENV",
    "VLLM_BULK_KEY",
    "VLLM_INTERACTIVE_KEY",
    "PriorityRule",
    "RoomClass",
    "engine_priority",
    "room_class_of",
    "sglang_priority_rule",
    "vllm_priority_rule",
]

#: A request's own room class in its ``kv_transfer_params`` (vLLM): a class name or a RoomPriority value.
PRIORITY_KEY = "kvbroker_priority"
#: A request's own deadline in its ``kv_transfer_params`` (vLLM): milliseconds from when its room opens.
DEADLINE_KEY = "kvbroker_deadline_ms"
#: vLLM's ``kv_connector_extra_config``: a request whose vLLM priority (``Request.priority``,
#: lower is more urgent, default 0) is at most this opens its rooms interactive.
VLLM_INTERACTIVE_KEY = "kvbroker_interactive_at_most"
#: vLLM's ``kv_connector_extra_config``: one whose priority is at least this, bulk.
VLLM_BULK_KEY = "kvbroker_bulk_at_least"
#: SGLang: the least urgent request priority that is still interactive.
SGLANG_INTERACTIVE_ENV = "KVBROKER_INTERACTIVE_PRIORITY"
#: SGLang: the most urgent request priority that is still bulk.
SGLANG_BULK_ENV = "KVBROKER_BULK_PRIORITY"

#: ``common_pb2.RoomPriority`` values (kvbroker.client.rooms.priority_value's).
UNSPECIFIED, BULK, STANDARD, INTERACTIVE = 0, 1, 2, 3


@dataclass(frozen=True)
class RoomClass:
    """What a room opens with: its ``RoomPriority`` value and its deadline (seconds from now, or None)."""

    priority: int = UNSPECIFIED
    deadline_seconds: float | None = None


@dataclass(frozen=True)
class PriorityRule:
    """How an engine's request priority maps to a room class.

    ``interactive``: the least urgent engine priority that is still
    interactive; ``bulk``: the most urgent one that is still bulk (None:
    that class is never chosen by priority). ``lower_is_more_urgent``: the
    engine's direction. Neither threshold set: every room is unspecified."""

    interactive: int | None = None
    bulk: int | None = None
    lower_is_more_urgent: bool = True

    @property
    def configured(self) -> bool:
        return self.interactive is not None or self.bulk is not None

    def _as_urgent(self, a: int, b: int) -> bool:
        """``a`` is at least as urgent as ``b`` in the engine's direction."""
        return a <= b if self.lower_is_more_urgent else a >= b

    def check(self, interactive_name: str, bulk_name: str) -> PriorityRule:
        """Self, or ``InvalidArgument`` where the interactive threshold is not more urgent than the bulk one."""
        if self.interactive is not None and self.bulk is not None and self._as_urgent(self.bulk, self.interactive):
            direction = "lower" if self.lower_is_more_urgent else "larger"
            raise InvalidArgument(
                f"{interactive_name} {self.interactive} and {bulk_name} {self.bulk} overlap: the interactive "
                f"threshold must be more urgent than the bulk one (here a {direction} priority is more urgent)"
            )
        return self

    def classify(self, priority: int | None) -> int:
        """The ``RoomPriority`` value of a request of engine priority ``priority`` (None: it has none)."""
        if priority is None or not self.configured:
            return UNSPECIFIED
        if self.interactive is not None and self._as_urgent(priority, self.interactive):
            return INTERACTIVE
        if self.bulk is not None and self._as_urgent(self.bulk, priority):
            return BULK
        return STANDARD


def engine_priority(value: object, name: str) -> int | None:
    """A threshold setting as an integer (None or a blank string: not set);
    ``InvalidArgument`` naming the setting otherwise."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        value = repr(value)  # refused below: True is not a priority
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InvalidArgument(f"{name} {value!r} is not an integer request priority (leave it out to map none)")


def room_class_of(params: Mapping[str, object] | None, priority: int | None, rule: PriorityRule, request: str = "") -> RoomClass:
    """A request's room class: its own ``kvbroker_priority`` and
    ``kvbroker_deadline_ms`` in ``params`` (its ``kv_transfer_params``) where
    present, else ``rule`` applied to its engine ``priority`` (no deadline).
    ``InvalidArgument`` naming the key, the value and ``request`` for a value
    that is not a class or a deadline."""
    params = params or {}
    where = f"request {request}'s " if request else ""
    own = params.get(PRIORITY_KEY)
    if own is None:
        value = rule.classify(priority)
    else:
        try:
            if isinstance(own, bool) or not isinstance(own, (str, int)):
                raise ValueError(f"{own!r} is neither a class name nor a RoomPriority value")
            value = priority_value(own)
        except ValueError as exc:
            raise InvalidArgument(
                f"{where}kv_transfer_params {PRIORITY_KEY} {own!r} is not a room class: it takes \"interactive\", "
                f"\"standard\", \"bulk\" or a RoomPriority value (0 unspecified, 1 bulk, 2 standard, 3 interactive) ({exc})"
            ) from None
    deadline = params.get(DEADLINE_KEY)
    seconds: float | None = None
    if deadline is not None:
        try:
            if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
                raise ValueError(f"{deadline!r} is not a number")
            seconds = float(deadline) / 1000
            deadline_value(seconds)
        except (ValueError, OverflowError):
            raise InvalidArgument(
                f"{where}kv_transfer_params {DEADLINE_KEY} {deadline!r} is not a deadline: it takes milliseconds "
                "above 0 (leave it out for none)"
            ) from None
    return RoomClass(value, seconds)


def vllm_priority_rule(extra: Mapping[str, object]) -> PriorityRule:
    """A vLLM engine's rule from its ``kv_connector_extra_config`` (:data:`VLLM_INTERACTIVE_KEY`,
    :data:`VLLM_BULK_KEY`; a lower vLLM priority is more urgent)."""
    return _rule(extra, (VLLM_INTERACTIVE_KEY, VLLM_BULK_KEY), "kv_connector_extra_config {}", lower_is_more_urgent=True)


def sglang_priority_rule(environ: Mapping[str, str], low_values_first: bool) -> PriorityRule:
    """An SGLang engine's rule from ``environ`` (:data:`SGLANG_INTERACTIVE_ENV`,
    :data:`SGLANG_BULK_ENV`), in SGLang's direction: a larger priority is more
    urgent unless ``low_values_first`` (``--schedule-low-priority-values-first``)."""
    return _rule(environ, (SGLANG_INTERACTIVE_ENV, SGLANG_BULK_ENV), "the environment variable {}", low_values_first)


def _rule(settings: Mapping[str, object], keys: tuple[str, str], where: str, lower_is_more_urgent: bool) -> PriorityRule:
    """The rule from the interactive and bulk thresholds under ``keys`` of ``settings``
    (``where``: how an error names a key), checked."""
    names = where.format(keys[0]), where.format(keys[1])
    rule = PriorityRule(
        interactive=engine_priority(settings.get(keys[0]), names[0]),
        bulk=engine_priority(settings.get(keys[1]), names[1]),
        lower_is_more_urgent=lower_is_more_urgent,
    )
    return rule.check(*names)
