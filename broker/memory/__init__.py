"""Memory and its owners: importing engines' buffers, the engine table, staging
and transfer buffers, receive credits in them, and the fd socket memory arrives on.
"""

from kvbroker.broker.memory._credits import Credit, CreditLedger, CreditRange, CreditWindow, Grant
from kvbroker.broker.memory._engines import Engine, EngineTable
from kvbroker.broker.memory._fdsocket import FdConnection, FdSocketServer
from kvbroker.broker.memory._importers import (
    VramImporter,
    array_at,
    importer_for,
    map_anonymous,
    map_memory,
    populate,
    unmap,
)
from kvbroker.broker.memory._staging import (
    DEVICE_SHARE,
    BufferRange,
    FreeList,
    StagingBuffer,
    StagingPool,
    StagingPools,
    StagingReservation,
    TransferSlot,
    kept_for_classes,
)

__all__ = [
    "DEVICE_SHARE",
    "BufferRange",
    "Credit",
    "CreditLedger",
    "CreditRange",
    "CreditWindow",
    "Engine",
    "EngineTable",
    "FdConnection",
    "FdSocketServer",
    "FreeList",
    "Grant",
    "StagingBuffer",
    "StagingPool",
    "StagingPools",
    "StagingReservation",
    "TransferSlot",
    "kept_for_classes",
    "VramImporter",
    "array_at",
    "importer_for",
    "map_anonymous",
    "map_memory",
    "populate",
    "unmap",
]
