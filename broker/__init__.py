"""The kvbroker service: one broker per GPU host (``kvbroker serve``).

``BrokerServer`` runs one broker; ``BrokerConfig`` configures it. The modules
behind them, one concept each: ``layout`` (engine layouts), ``descriptors``,
``segments``, ``slicing`` and ``mapping`` (pure transfer math), ``memory``
and ``fdsocket`` (buffers by file descriptor), ``staging`` (staging
buffers), ``nixl_agent`` (the NIXL seam), ``engines``, ``peers``, ``rooms``,
``sender``, ``transfers`` (posting one chunk), ``receiver``, ``progress``,
``runtime`` (state and operations), ``service`` (gRPC servicers) and
``server`` (wiring).
"""

from __future__ import annotations

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.server import BrokerServer

__all__ = ["BrokerConfig", "BrokerServer"]
