"""What ``soak.py`` keeps of the rooms it ran: each room's record, the tally of outcomes, the result and its report."""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The failure causes a room carrying a fault's tag may end with.
EXPECTED_CAUSE = {
    "abort-decode": {"ABORTED"},
    "abort-prefill": {"ABORTED"},
    "engine-kill": {"ENGINE_LOST"},
    "broker-restart": {"PEER"},
    "sender-error": {"ABORTED"},
    "stuck": {"ABORTED"},
}


def mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f} MiB"


def tag_list(room: Room) -> str:
    return ",".join(sorted(room.tags)) or "no fault"


@dataclass
class Room:
    id: int
    child: Any  # soak.Child: the prefill engine that sends it
    slot: int
    src: list[int]
    dst: list[int]
    started: float
    fault: str | None
    tags: set[str] = field(default_factory=set)
    #: When each fault hit this room (monotonic).
    tagged_at: dict[str, float] = field(default_factory=dict)
    abort_at: float | None = None
    decode_state: str | None = None
    decode_cause: str = ""
    decode_message: str = ""
    decode_final_at: float | None = None
    settled: bool = False
    sender_state: str | None = None

    def tag(self, what: str) -> None:
        self.tags.add(what)
        self.tagged_at.setdefault(what, time.monotonic())

    def timing(self) -> str:
        now = time.monotonic()
        parts = [f"{now - self.started:.1f} s after it opened"]
        parts += [f"{now - at:.1f} s after {what}" for what, at in self.tagged_at.items() if what in ("engine-kill", "broker-restart", "broker-died")]
        return ", ".join(parts)


class Tally:
    """The outcomes of the rooms: counts, failures by cause and by fault, the
    sender side's outcomes, where the two sides disagree, and examples of each."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.failed_by_cause: collections.Counter[str] = collections.Counter()
        self.cause_examples: dict[str, list[str]] = collections.defaultdict(list)
        self.by_fault: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.unexpected: list[str] = []
        self.sender_outcomes: collections.Counter[str] = collections.Counter()
        self.sender_examples: dict[str, list[str]] = collections.defaultdict(list)
        self.mismatch_examples: list[str] = []
        self.disagree: collections.Counter[str] = collections.Counter()
        self.fault_latency: dict[str, list[float]] = collections.defaultdict(list)
        self.reregister: dict[str, list[float]] = collections.defaultdict(list)

    def failure(self, room: Room, cause: str, message: str) -> None:
        """The decode side of ``room`` failed with ``cause``."""
        self.counts["rooms_failed"] += 1
        self.failed_by_cause[cause] += 1
        if len(self.cause_examples[cause]) < 3:
            self.cause_examples[cause].append(f"room {room.id} [{tag_list(room)}] ({room.timing()}): {message[:300]}")
        expected = set().union(*(EXPECTED_CAUSE.get(t, set()) for t in room.tags)) if room.tags else set()
        bare = cause.removeprefix("FAILED ")
        for tag in ("engine-kill", "broker-restart"):
            if tag in room.tagged_at:
                self.fault_latency[tag].append(time.monotonic() - room.tagged_at[tag])
        if bare not in expected:
            self.counts["rooms_failed_unexpectedly"] += 1
            if len(self.unexpected) < 10:
                self.unexpected.append(f"room {room.id} [{tag_list(room)}] {cause} ({room.timing()}): {message[:300]}")
        for tag in room.tags or {"none"}:
            self.by_fault[tag][bare] += 1

    def checked(self, room: Room, problems: list[str]) -> None:
        """The decode side of ``room`` succeeded; ``problems``: how its bytes differ (none: verified)."""
        if problems:
            self.counts["byte_mismatches"] += 1
            if len(self.mismatch_examples) < 10:
                self.mismatch_examples.append(f"room {room.id} [{tag_list(room)}]: {'; '.join(problems[:3])}")
        else:
            self.counts["rooms_verified"] += 1
            if room.fault:
                self.counts["aborted_rooms_that_succeeded"] += 1
            for tag in room.tags or {"none"}:
                self.by_fault[tag]["SUCCESS"] += 1

    def sender(self, room: Room | None, outcome: str, message: str) -> None:
        """The sender side of ``room`` ended with ``outcome`` (only its first counts)."""
        if room is None or room.sender_state is not None:
            return
        room.sender_state = outcome
        self.sender_outcomes[outcome] += 1
        if outcome != "SUCCESS" and len(self.sender_examples[outcome]) < 3 and message:
            self.sender_examples[outcome].append(f"room {room.id}: {message}")

    def released(self, room: Room) -> None:
        """``room`` is done with: note it if its two sides ended differently."""
        if room.sender_state == "SUCCESS" and room.decode_state == "FAILED":
            # The sender's broker moved every chunk, yet the receiver failed (an abort racing the
            # end is fine; with no abort tag it is worth a look).
            key = "aborted" if room.fault else tag_list(room)
            self.disagree[f"sender SUCCESS, decode FAILED {room.decode_cause} [{key}]"] += 1
        elif room.decode_state == "SUCCESS" and room.sender_state not in (None, "SUCCESS"):
            self.disagree[f"decode SUCCESS, sender {room.sender_state} [{tag_list(room)}]"] += 1
        elif room.sender_state == "FAILED TIMEOUT":
            # The sender waited out its transfer-info timeout: say what the decode side did.
            self.disagree[f"sender FAILED TIMEOUT, decode {room.decode_state} {room.decode_cause or ''} [{tag_list(room)}]"] += 1


def log_summary(workdir: Path) -> dict[str, dict[str, int]]:
    """Warning-and-worse events of each log in ``workdir`` (brokers' JSON, engines' text): event -> count."""
    out: dict[str, dict[str, int]] = {}
    for path in sorted(workdir.glob("*.log")):
        counter: collections.Counter[str] = collections.Counter()
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                if line.strip():
                    counter["<not json> " + line.strip()[:80]] += 1
                continue
            if isinstance(record, dict) and record.get("level") in ("warning", "error", "critical", "exception"):
                counter[f"{record.get('level')} {record.get('event')}"] += 1
        if counter:
            out[path.name] = dict(counter.most_common(12))
    return out


def spread(values: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {k: {"n": len(v), "max": round(max(v), 2), "mean": round(sum(v) / len(v), 2)} for k, v in values.items()}


def result(
    t: Tally,
    *,
    duration_s: float,
    workdir: Path,
    config: dict[str, Any],
    guard_problems: list[str],
    unfinished: list[str],
    engine_crashes: list[str],
    broker_deaths: list[str],
    tables: dict[str, dict[str, int]],
    leaked: dict[str, int],
    late_drain: float | None,
    wait: float,
    rss: dict[str, Any],
    exit_codes: dict[str, Any],
    events: list[str],
) -> dict[str, Any]:
    """The soak's result (its JSON line): "ok" unless a byte differs, a record
    leaked, a broker died or exited badly, or no room was verified."""
    c = t.counts
    reasons = []
    if c["byte_mismatches"] or guard_problems:
        reasons.append(f"{c['byte_mismatches']} byte mismatches, {len(guard_problems)} overwritten guards")
    if leaked:
        reasons.append(f"leaked records: {leaked}")
    if broker_deaths:
        reasons.append(f"{len(broker_deaths)} unexpected broker deaths")
    bad_exit = {k: v for k, v in exit_codes.items() if v != 0}
    if bad_exit:
        reasons.append(f"brokers exited badly on SIGTERM: {bad_exit}")
    if not c["rooms_verified"]:
        reasons.append("no room was verified")
    return {
        "ok": not reasons,
        "reasons": reasons,
        "duration_s": round(duration_s, 1),
        "workdir": str(workdir),
        "config": config,
        "rooms_started": c["rooms_started"],
        "rooms_verified": c["rooms_verified"],
        "rooms_failed": c["rooms_failed"],
        "rooms_failed_unexpectedly": c["rooms_failed_unexpectedly"],
        "failed_by_cause": dict(t.failed_by_cause.most_common()),
        "failure_examples": dict(t.cause_examples),
        "unexpected_examples": t.unexpected,
        "outcomes_by_fault": {k: dict(v) for k, v in sorted(t.by_fault.items())},
        "aborts_decode": c["aborts_decode"],
        "aborts_prefill": c["aborts_prefill"],
        "aborted_rooms_that_succeeded": c["aborted_rooms_that_succeeded"],
        "sender_outcomes": dict(t.sender_outcomes.most_common()),
        "sender_examples": dict(t.sender_examples),
        "sides_disagree": dict(t.disagree.most_common()),
        "byte_mismatches": c["byte_mismatches"],
        "mismatch_examples": t.mismatch_examples,
        "guard_problems": guard_problems,
        "decode_init_errors": c["decode_init_errors"],
        "stuck_rooms": c["stuck_rooms"],
        "rooms_never_settled": c["rooms_never_settled"],
        "sender_never_finished": c["sender_never_finished"],
        "unfinished_at_end": unfinished,
        "engine_kills": c["engine_kills"],
        "broker_restarts": c["broker_restarts"],
        "reregister_seconds": spread(t.reregister),
        "fault_to_failure_seconds": spread(t.fault_latency),
        "engine_crashes": engine_crashes,
        "broker_deaths": broker_deaths,
        "per_room_state": tables,
        "leaked": leaked,
        "leak_drained_after_s": late_drain,
        "eviction_wait_s": wait,
        "rss_kib": rss,
        "broker_exit": exit_codes,
        "broker_log_warnings": log_summary(workdir),
        "events": events[-40:],
    }


def print_report(r: dict[str, Any]) -> None:
    p = print
    p("")
    p("=" * 78)
    p(f"soak result: {'PASS' if r['ok'] else 'FAIL'}" + ("" if r["ok"] else f" ({'; '.join(r['reasons'])})"))
    p(f"duration: {r['duration_s']:.1f} s ({r['duration_s'] / 60:.1f} min); logs: {r['workdir']}")
    p(f"rooms: {r['rooms_started']} started, {r['rooms_verified']} SUCCESS and verified byte-exact, {r['rooms_failed']} failed "
      f"({r['rooms_failed_unexpectedly']} not explained by an injected fault)")
    p(f"faults injected: {r['engine_kills']} prefill engine kills, {r['broker_restarts']} prefill broker restarts, "
      f"aborts on {r['aborts_decode'] + r['aborts_prefill']} rooms ({r['aborts_decode']} decode side, {r['aborts_prefill']} prefill side; "
      f"{r['aborted_rooms_that_succeeded']} of them still succeeded)")
    p("rooms failed by cause (decode side):")
    if not r["failed_by_cause"]:
        p("  (none)")
    for cause, n in r["failed_by_cause"].items():
        p(f"  {cause:<16} {n:6d}")
        for example in r["failure_examples"].get(cause, []):
            p(f"      e.g. {example}")
    p("outcomes by injected fault (a room in flight during a fault carries its tag):")
    for tag, outcomes in r["outcomes_by_fault"].items():
        p(f"  {tag:<16} " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])))
    if r["unexpected_examples"]:
        p("unexpected failures (examples):")
        for example in r["unexpected_examples"]:
            p(f"  {example}")
    p("sender side (prefill engines): " + ", ".join(f"{k} {v}" for k, v in r["sender_outcomes"].items()))
    for outcome, examples in r["sender_examples"].items():
        for example in examples[:2]:
            p(f"      {outcome}: {example}")
    if r["sides_disagree"]:
        p("rooms whose two sides ended differently: " + ", ".join(f"{k}: {v}" for k, v in r["sides_disagree"].items()))
    p(f"byte mismatches: {r['byte_mismatches']}" + (f"; overwritten guards: {r['guard_problems']}" if r["guard_problems"] else ""))
    for example in r["mismatch_examples"]:
        p(f"  {example}")
    p(f"decode ExpectRoom errors: {r['decode_init_errors']}; stuck rooms aborted by the soak: {r['stuck_rooms']}; "
      f"pages never settled: {r['rooms_never_settled']}; no sender outcome: {r['sender_never_finished']}; unfinished at the end: {len(r['unfinished_at_end'])}")
    for line in r["unfinished_at_end"][:5]:
        p(f"  {line}")
    for key, v in r["reregister_seconds"].items():
        p(f"engine registration {key}: {v['n']} times, mean {v['mean']} s, max {v['max']} s (from the fault to registered)")
    for key, v in r["fault_to_failure_seconds"].items():
        p(f"from {key} to the decode side's FAILED: {v['n']} rooms, mean {v['mean']} s, max {v['max']} s")
    if r["engine_crashes"]:
        p("engine child crashes:")
        for c in r["engine_crashes"]:
            p(f"  {c}")
    if r["broker_deaths"]:
        p("unexpected broker deaths:")
        for d in r["broker_deaths"]:
            p(f"  {d}")
    p(f"per_room_state after the engines unregistered and {r['eviction_wait_s']:.0f} s (finished TTL + tombstone TTL + 5 s):")
    for name, table in r["per_room_state"].items():
        p(f"  {name:8} " + ", ".join(f"{k}={v}" for k, v in sorted(table.items())))
    p(f"leaked records: {len(r['leaked'])}" + (f" {r['leaked']}; drained after {r['leak_drained_after_s']} s" if r["leaked"] else ""))
    rss = r["rss_kib"]
    p(f"RSS decode broker: {mib(rss['decode'].get('start'))} after warm-up -> {mib(rss['decode'].get('end'))} at the end of the load "
      f"({mib(rss['decode'].get('idle'))} idle, after the engines unregistered)")
    incs = rss["prefill_incarnations"]
    first, last = incs[0], incs[-1]
    when = f"when {first['ended']}" if len(incs) > 1 else f"at the end of the load ({mib(rss['prefill_idle'])} idle)"
    p(f"RSS prefill broker, first incarnation (pid {first['pid']}): {mib(first['warm'])} after warm-up -> {mib(first['last'])} {when}")
    if len(incs) > 1:
        p(f"RSS prefill broker, last incarnation #{last['n']} (pid {last['pid']}): {mib(last['warm'])} after warm-up -> {mib(last['last'])} "
          f"at the end of the load ({mib(rss['prefill_idle'])} idle)")
        p("  every incarnation: " + ", ".join(f"#{i['n']} {mib(i['warm'])}->{mib(i['last'])}" for i in incs))
    p(f"broker exit status on SIGTERM: {r['broker_exit']}")
    if r["broker_log_warnings"]:
        p("warnings and errors in the broker logs (event: count):")
        for name, counter in r["broker_log_warnings"].items():
            p(f"  {name}: " + ", ".join(f"{k} x{v}" for k, v in counter.items()))
    p("=" * 78)
