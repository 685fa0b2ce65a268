"""The bootstrap registry of an engine whose ranks send KV through kvbroker.

A decode engine learns, from the address its router hands it with each
request (SGLang's ``bootstrap_host:bootstrap_port``), which kvbroker serves
the prefill engine and under which group its ranks registered. The prefill
engine runs this small HTTP server at that address; each of its ranks
publishes itself (``PUT /kvbroker/ranks``), and decode ranks read the
engine's record (``GET /kvbroker/info``). Nothing else crosses it: rooms,
memory and transfers go through the brokers.

Records are JSON::

    {"group": "prefill-0", "broker": "10.0.0.5:50051", "tp_size": 2,
     "pp_size": 1, "page_size": 16, "ranks": [0, 1]}

``info`` answers 404 until a rank has registered, and lists the ranks that
did: a reader waits until ``ranks`` holds ``tp_size * pp_size`` of them.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvbroker.errors import FailedPrecondition, InvalidArgument, Unavailable

__all__ = ["BootstrapServer", "EngineRecord", "fetch_record", "publish_rank"]

RANKS_PATH = "/kvbroker/ranks"
INFO_PATH = "/kvbroker/info"
#: Fields every rank must publish, and that all ranks of one engine must agree on.
_SHARED = ("group", "broker", "tp_size", "pp_size", "page_size")


@dataclass(frozen=True)
class EngineRecord:
    """What a decode rank needs to know of a prefill engine."""

    group: str
    broker: str
    tp_size: int
    pp_size: int
    page_size: int
    ranks: tuple[int, ...]

    @property
    def complete(self) -> bool:
        """Every rank of the engine has registered."""
        return len(self.ranks) == self.tp_size * self.pp_size

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineRecord:
        try:
            return cls(
                group=str(data["group"]),
                broker=str(data["broker"]),
                tp_size=int(data["tp_size"]),
                pp_size=int(data["pp_size"]),
                page_size=int(data["page_size"]),
                ranks=tuple(int(r) for r in data.get("ranks", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed kvbroker bootstrap record {data!r}: {exc}") from exc


class BootstrapServer:
    """The registry, served on ``host:port`` from a daemon thread."""

    def __init__(self, host: str, port: int) -> None:
        self._lock = threading.Lock()
        self._shared: dict[str, Any] | None = None
        self._ranks: set[int] = set()
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path == "/health":
                    self._reply(HTTPStatus.OK, {"ok": True})
                elif self.path == INFO_PATH:
                    record = registry.record()
                    if record is None:
                        self._reply(HTTPStatus.NOT_FOUND, {"error": "no rank has registered yet"})
                    else:
                        self._reply(HTTPStatus.OK, record)
                else:
                    self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})

            def do_PUT(self) -> None:  # noqa: N802
                if self.path != RANKS_PATH:
                    self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})
                    return
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                    body = json.loads(self.rfile.read(length) or b"{}")
                    registry.register(body)
                except (ValueError, InvalidArgument, FailedPrecondition) as exc:
                    self._reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
                    return
                self._reply(HTTPStatus.OK, {"ok": True})

            def _reply(self, status: HTTPStatus, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                return  # requests are not worth a log line each

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvbroker-bootstrap", daemon=True)
        self._thread.start()

    def register(self, body: dict[str, Any]) -> None:
        """One rank publishes itself; every rank must agree on the shared fields."""
        if not isinstance(body, dict):
            raise InvalidArgument("a rank record must be a JSON object")
        missing = [key for key in (*_SHARED, "rank") if key not in body]
        if missing:
            raise InvalidArgument(f"rank record lacks {', '.join(missing)}")
        shared = {key: body[key] for key in _SHARED}
        record = EngineRecord.from_json({**shared, "ranks": [body["rank"]]})
        if not 0 <= record.ranks[0] < record.tp_size * record.pp_size:
            raise InvalidArgument(f"rank {record.ranks[0]} is outside tp_size * pp_size = {record.tp_size * record.pp_size}")
        with self._lock:
            if self._shared is not None and self._shared != shared:
                raise FailedPrecondition(f"rank {body['rank']} says {shared}, earlier ranks said {self._shared}")
            self._shared = shared
            self._ranks.add(record.ranks[0])

    def record(self) -> dict[str, Any] | None:
        with self._lock:
            if self._shared is None:
                return None
            return {**self._shared, "ranks": sorted(self._ranks)}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def publish_rank(address: str, record: dict[str, Any], *, timeout_seconds: float = 60.0) -> None:
    """PUT one rank's record to the registry at ``address`` (host:port),
    retrying while it does not answer (the engine may start it after its
    ranks) for up to ``timeout_seconds``."""
    request = urllib.request.Request(
        f"http://{address}{RANKS_PATH}",
        data=json.dumps(record).encode(),
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5.0):
                return
        except urllib.error.HTTPError as exc:
            raise FailedPrecondition(f"the kvbroker bootstrap registry at {address} refused rank {record.get('rank')}: {exc.read().decode(errors='replace')}") from exc
        except OSError as exc:
            if time.monotonic() > deadline:
                raise Unavailable(f"the kvbroker bootstrap registry at {address} did not answer in {timeout_seconds:g} s: {exc}") from exc
            time.sleep(0.2)


def fetch_record(address: str, *, timeout_seconds: float = 2.0) -> EngineRecord | None:
    """The engine record at ``address``; None while no rank has registered."""
    try:
        with urllib.request.urlopen(f"http://{address}{INFO_PATH}", timeout=timeout_seconds) as response:
            return EngineRecord.from_json(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        if exc.code == HTTPStatus.NOT_FOUND:
            return None
        raise Unavailable(f"the kvbroker bootstrap registry at {address} answered {exc.code}") from exc
    except OSError as exc:
        raise Unavailable(f"the kvbroker bootstrap registry at {address} is not reachable: {exc}") from exc
