"""FleetView's choice of broker for a group (no etcd: records put in by hand)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from kvbroker.broker.peers import FleetView, Member
from kvbroker.protocol import PROTOCOL_VERSION


def _record(broker_id: str, started_at: float, ranks: list[str], *, protocol: int = PROTOCOL_VERSION, draining: bool = False) -> bytes:
    return json.dumps(
        {
            "broker_id": broker_id,
            "address": f"{broker_id}:50051",
            "protocol": protocol,
            "version": "0",
            "started_at": started_at,
            "draining": draining,
            "groups": {"prefill-0": {"role": "prefill", "tp_size": 2, "pp_size": 1, "ranks": ranks}},
        }
    ).encode()


def _event(kind: str, broker_id: str, value: bytes = b"") -> SimpleNamespace:
    return SimpleNamespace(kind=kind, kv=SimpleNamespace(key=f"/kvbroker/brokers/{broker_id}".encode(), value=value, lease=7))


def _view(left: list[str]) -> FleetView:
    return FleetView("http://127.0.0.1:2379", "/kvbroker", self_id="me", on_left=lambda m: left.append(m.broker_id))


def test_the_newest_usable_broker_holding_a_rank_is_chosen() -> None:
    """Of the brokers in etcd serving a group, the newest that holds the rank, speaks our protocol and is not draining
    owns it."""
    view = _view([])
    view._event(_event("PUT", "old", _record("old", 1.0, ["tp0/pp0", "tp1/pp0"])))
    view._event(_event("PUT", "new", _record("new", 2.0, ["tp1/pp0"])))
    view._event(_event("PUT", "alien", _record("alien", 3.0, ["tp0/pp0", "tp1/pp0"], protocol=PROTOCOL_VERSION + 1)))
    view._event(_event("PUT", "drain", _record("drain", 4.0, ["tp0/pp0"], draining=True)))
    assert [m.broker_id for m in view.serving("prefill-0")] == ["new", "old"]
    assert view.owner("prefill-0", 1, 0).broker_id == "new"  # type: ignore[union-attr]
    assert view.owner("prefill-0", 0, 0).broker_id == "old"  # type: ignore[union-attr]
    assert view.owner("prefill-0", 2, 0) is None and view.serving("decode-0") == []


def test_why_none_names_the_brokers_it_will_not_use() -> None:
    """When no broker serves a group, why_none says so, or names the draining brokers and those of another protocol
    version."""
    view = _view([])
    assert "no broker in etcd under /kvbroker/brokers/ serves engine group 'prefill-0'" in view.why_none("prefill-0")
    view._event(_event("PUT", "drain", _record("drain", 1.0, ["tp0/pp0"], draining=True)))
    assert "only by draining brokers (drain:50051)" in view.why_none("prefill-0")
    view._event(_event("PUT", "alien", _record("alien", 1.0, ["tp0/pp0"], protocol=PROTOCOL_VERSION + 1)))
    assert f"another protocol version: alien:50051 (protocol {PROTOCOL_VERSION + 1})" in view.why_none("prefill-0")


def test_a_deleted_key_is_a_broker_that_left_but_never_this_one() -> None:
    """A deleted etcd key is a broker that left (once it was seen), never this broker itself."""
    left: list[str] = []
    view = _view(left)
    for broker_id in ("a", "me"):
        view._event(_event("PUT", broker_id, _record(broker_id, 1.0, ["tp0/pp0"])))
    view._event(_event("DELETE", "a"))
    view._event(_event("DELETE", "me"))
    view._event(_event("DELETE", "never-seen"))
    assert left == ["a"] and view.members == {}


def test_a_bad_record_is_skipped() -> None:
    """A record that is not JSON is skipped, and a rank that does not parse is left out of a broker's ranks."""
    view = _view([])
    view._event(_event("PUT", "bad", b"{not json"))
    assert view.members == {}
    assert Member.parse(_record("x", 1.0, ["tp1/pp0", "junk"])).ranks("prefill-0") == {(1, 0)}


def test_a_failure_handling_a_departed_broker_is_logged_and_the_watch_goes_on() -> None:
    """A bug in what the runtime does with a departed broker must not pass for an etcd outage (the
    watch's catch-all would log ``etcd_watch_lost`` and list again): it is logged as what it is, and
    the view keeps taking events."""
    import structlog.testing

    def broken(member: Member) -> None:
        raise TypeError("peer_lost() got an unexpected keyword argument")

    view = FleetView("http://127.0.0.1:2379", "/kvbroker", self_id="me", on_left=broken)
    view._event(_event("PUT", "a", _record("a", 1.0, ["tp0/pp0"])))
    with structlog.testing.capture_logs() as logs:
        view._event(_event("DELETE", "a"))
    assert [e["event"] for e in logs] == ["etcd_broker_left", "fleet_member_left_failed"]
    view._event(_event("PUT", "b", _record("b", 1.0, ["tp0/pp0"])))
    assert "b" in view.members and "a" not in view.members
