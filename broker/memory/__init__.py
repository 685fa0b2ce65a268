"""Memory and its owners: importing engines' buffers, the engine table, staging
and transfer buffers, and the fd socket memory arrives on.
"""

from kvbroker.broker.memory._engines import Engine, EngineTable
from kvbroker.broker.memory._fdsocket import FdConnection, FdSocketServer
from kvbroker.broker.memory._importers import array_at, map_memory, unmap
from kvbroker.broker.memory._staging import (
    DEVICE_SHARE,
    Reservation,
    StagingBuffer,
    StagingPool,
    StagingPools,
)

__all__ = [
    "DEVICE_SHARE",
    "Engine",
    "EngineTable",
    "FdConnection",
    "FdSocketServer",
    "Reservation",
    "StagingBuffer",
    "StagingPool",
    "StagingPools",
    "array_at",
    "map_memory",
    "unmap",
]
