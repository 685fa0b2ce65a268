"""A TCP gate in front of a broker: its clients lose it, and find it again, at the test's word.

:class:`TcpGate` listens on a free loopback port and forwards every
connection to ``target``. ``shut()`` cuts every forwarded connection and
refuses new ones (to a client it looks like a broker that stopped
answering, while the broker itself goes on with its rooms: a starved or
partitioned broker); ``open()`` forwards again. Engines reach the broker
through it with ``BrokerClient(gate.address, prefer_unix_socket=False)``
(their fd connection, a unix socket, is not gated).
"""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["TcpGate"]


class TcpGate:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (``host:port``) while open."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._lock = threading.Lock()
        self._open = True
        self._closed = False
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, name="kvb-test-gate", daemon=True)
        self._thread.start()

    def shut(self) -> None:
        """Cut every forwarded connection; refuse new ones until :meth:`open`."""
        with self._lock:
            self._open = False
            cut, self._sockets = self._sockets, set()
        for sock in cut:
            _close(sock)

    def open(self) -> None:
        """Forward new connections again."""
        with self._lock:
            self._open = True

    def close(self) -> None:
        self.shut()
        self._closed = True
        _close(self._listener)
        self._thread.join(5)

    def __enter__(self) -> TcpGate:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refuse = not self._open
            if refuse:
                _close(client)
                continue
            try:
                server = socket.create_connection(self._target, timeout=5)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            with self._lock:
                if not self._open:
                    _close(client)
                    _close(server)
                    continue
                self._sockets |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), name="kvb-test-gate-pump", daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._sockets -= {source, sink}
            _close(source)
            _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
