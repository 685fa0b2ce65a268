"""A peer's life (``peers.PeerState``, ``peers.transition``): the table of moves, what each
logs, and the architecture document's table of them."""

from __future__ import annotations

import itertools
import pathlib

import pytest
from structlog.testing import capture_logs

from kvbroker.broker.peers import TRANSITIONS, Peer, PeerState, transition
from kvbroker.errors import Internal

ALLOWED = sorted(((a, b) for a, tos in TRANSITIONS.items() for b in tos), key=lambda p: (p[0].value, p[1].value))
REFUSED = sorted(
    (p for p in itertools.product(PeerState, PeerState) if p not in set(ALLOWED)), key=lambda p: (p[0].value, p[1].value)
)
ARCHITECTURE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_a_new_peer_record_is_handshaking() -> None:
    """A peer known by address only is HANDSHAKING: not handshaken, and not pinged for doubt."""
    peer = Peer(address="10.0.0.2:50051")
    assert peer.state is PeerState.HANDSHAKING
    assert not peer.state.handshaken and not peer.state.in_doubt


def test_the_predicates_name_the_states_they_cover() -> None:
    """``handshaken`` is LIVE, SILENT and LEASE_LAPSED (the states with a broker id and an agent);
    ``in_doubt`` (pinged whatever its rooms) is SILENT and LEASE_LAPSED."""
    assert {s for s in PeerState if s.handshaken} == {PeerState.LIVE, PeerState.SILENT, PeerState.LEASE_LAPSED}
    assert {s for s in PeerState if s.in_doubt} == {PeerState.SILENT, PeerState.LEASE_LAPSED}


@pytest.mark.parametrize(("was", "to"), ALLOWED, ids=[f"{a.value}->{b.value}" for a, b in ALLOWED])
def test_every_allowed_move_is_made_and_logged(was: PeerState, to: PeerState) -> None:
    """Each move of the table changes the state and logs ``peer_state`` with the peer's address,
    its broker id, where from, where to and why."""
    peer = Peer(address="10.0.0.2:50051", broker_id="b-2", state=was)
    with capture_logs() as logs:
        transition(peer, to, "a test says so")
    assert peer.state is to
    assert logs == [
        {
            "event": "peer_state",
            "log_level": "info",
            "peer": "10.0.0.2:50051",
            "broker": "b-2",
            "from": was.value,
            "to": to.value,
            "why": "a test says so",
        }
    ]


@pytest.mark.parametrize(("was", "to"), REFUSED, ids=[f"{a.value}->{b.value}" for a, b in REFUSED])
def test_every_move_outside_the_table_is_refused_and_changes_nothing(was: PeerState, to: PeerState) -> None:
    """A move the table lacks (a state to itself, a gone peer silent, a handshaking one lost) is
    ``Internal``, naming the peer and both states; the state stays and nothing is logged."""
    peer = Peer(address="10.0.0.2:50051", broker_id="b-2", state=was)
    with capture_logs() as logs, pytest.raises(Internal) as raised:
        transition(peer, to, "a test says so")
    assert peer.state is was and logs == []
    assert f"cannot go from {was.value} to {to.value}" in raised.value.message
    assert "10.0.0.2:50051" in raised.value.message


def test_a_gone_peer_is_not_found_silent() -> None:
    """The refusal, spelled out once: a peer dropped as gone cannot be taken for silent (only a
    new handshake brings it back, LIVE)."""
    peer = Peer(address="10.0.0.2:50051", state=PeerState.GONE)
    with pytest.raises(Internal, match="cannot go from gone to silent"):
        transition(peer, PeerState.SILENT, "has not answered for 9.9 s")
    transition(peer, PeerState.LIVE, "handshaken as broker b-3")
    assert peer.state is PeerState.LIVE


def test_the_architecture_documents_every_move_and_no_other() -> None:
    """docs/architecture.md's "Peer states" table (from, event, to, who) lists exactly the moves
    of ``TRANSITIONS``."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Peer states\n", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("From", "---"):
            continue
        for was in cells[0].split(", "):
            documented.add((PeerState[was], PeerState[cells[2]]))
    assert documented == set(ALLOWED)
