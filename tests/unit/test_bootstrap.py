"""The bootstrap registry a prefill engine's ranks publish themselves to (kvbroker.adapters.bootstrap)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvbroker.adapters.bootstrap import BootstrapServer, EngineRecord, fetch_record, publish_rank
from kvbroker.errors import FailedPrecondition, InvalidArgument, Unavailable


def _rank(rank: int, **changes: object) -> dict[str, object]:
    record: dict[str, object] = {"group": "prefill-0", "broker": "10.0.0.5:50051", "tp_size": 2, "pp_size": 1, "page_size": 16, "rank": rank}
    record.update(changes)
    return record


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    registry = BootstrapServer("127.0.0.1", 0)
    yield registry
    registry.close()


def test_the_record_is_complete_once_every_rank_registered(server: BootstrapServer) -> None:
    """The registry has no record until a rank publishes; the record is complete once every rank of tp_size has (a
    rank publishing again is the same rank)."""
    assert fetch_record(server.address) is None  # 404 until a rank registers
    publish_rank(server.address, _rank(1))
    record = fetch_record(server.address)
    assert record == EngineRecord("prefill-0", "10.0.0.5:50051", 2, 1, 16, (1,))
    assert not record.complete
    publish_rank(server.address, _rank(0))
    publish_rank(server.address, _rank(0))  # a rank registering again (restarted) is the same rank
    record = fetch_record(server.address)
    assert record is not None and record.complete and record.ranks == (0, 1)


def test_ranks_that_disagree_or_lie_are_refused_by_name(server: BootstrapServer) -> None:
    """A rank that names another broker than earlier ranks, a rank outside tp_size or a record without a group is
    FAILED_PRECONDITION, by name, and the record keeps what it had."""
    publish_rank(server.address, _rank(0))
    with pytest.raises(FailedPrecondition, match="earlier ranks said"):
        publish_rank(server.address, _rank(1, broker="10.0.0.6:50051"))
    with pytest.raises(FailedPrecondition, match="outside tp_size"):
        publish_rank(server.address, _rank(2))
    with pytest.raises(FailedPrecondition, match="lacks group"):
        publish_rank(server.address, {"rank": 0})
    record = fetch_record(server.address)
    assert record is not None and record.ranks == (0,) and record.broker == "10.0.0.5:50051"


def test_malformed_requests_get_a_clear_answer(server: BootstrapServer) -> None:
    """The registry answers a body that is not JSON with 400 and an unknown path with 404 saying so; /health answers
    ok; a malformed record is INVALID_ARGUMENT."""
    request = urllib.request.Request(f"http://{server.address}/kvbroker/ranks", data=b"not json", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=5)
    assert raised.value.code == 400
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(f"http://{server.address}/elsewhere", timeout=5)
    assert raised.value.code == 404 and "no such path" in json.loads(raised.value.read())["error"]
    with urllib.request.urlopen(f"http://{server.address}/health", timeout=5) as response:
        assert json.loads(response.read()) == {"ok": True}
    with pytest.raises(InvalidArgument, match="malformed"):
        EngineRecord.from_json({"group": "g"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_rank_waits_for_a_registry_that_starts_after_it() -> None:
    """SGLang may start the bootstrap server after its ranks' managers: publishing retries."""
    port = _free_port()
    started: list[BootstrapServer] = []

    def start_late() -> None:
        time.sleep(0.5)
        started.append(BootstrapServer("127.0.0.1", port))

    thread = threading.Thread(target=start_late)
    thread.start()
    try:
        publish_rank(f"127.0.0.1:{port}", _rank(0), timeout_seconds=10)
        thread.join()
        record = fetch_record(f"127.0.0.1:{port}")
        assert record is not None and record.ranks == (0,)
    finally:
        thread.join()
        for registry in started:
            registry.close()


def test_an_absent_registry_is_named() -> None:
    """Publishing to or fetching from a registry nothing listens at is UNAVAILABLE, naming its address."""
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(Unavailable, match=address):
        publish_rank(address, _rank(0), timeout_seconds=0.3)
    with pytest.raises(Unavailable, match=address):
        fetch_record(address)
