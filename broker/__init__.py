"""The kvbroker service: one broker per GPU host (``kvbroker serve``).

``BrokerServer`` runs one broker; ``BrokerConfig`` configures it. The module
map, the threads and one room's path through both brokers are in
docs/architecture.md.
"""

from __future__ import annotations

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.server import BrokerServer

__all__ = ["BrokerConfig", "BrokerServer"]
