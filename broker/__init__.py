"""The kvbroker service: one broker per GPU host (``kvbroker serve``).

``BrokerServer`` runs one broker; ``BrokerConfig`` configures it. The module
map, the threads and one room's path through both brokers are in
docs/architecture.md; its packages are layered (api, runtime, execution,
rooms, peers, device, memory, dataplane, telemetry, tls, config: each imports
only those after it). Both names load on first use: importing a subpackage
does not load the service.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbroker.broker.api import BrokerServer
    from kvbroker.broker.config import BrokerConfig

__all__ = ["BrokerConfig", "BrokerServer"]


def __getattr__(name: str) -> Any:
    if name == "BrokerConfig":
        from kvbroker.broker.config import BrokerConfig

        return BrokerConfig
    if name == "BrokerServer":
        from kvbroker.broker.api import BrokerServer

        return BrokerServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
