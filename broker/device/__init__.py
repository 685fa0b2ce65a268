"""The device path: gathering and scattering packed parts, the per-GPU copy
lanes, and CRC-32 on the device.
"""

from kvbroker.broker.device._block_copies import ArrayViews, Extent, checksum, gather, scatter
from kvbroker.broker.device._lanes import CudaStreams, Lanes, Streams, Work

__all__ = [
    "ArrayViews",
    "CudaStreams",
    "Extent",
    "Lanes",
    "Streams",
    "Work",
    "checksum",
    "gather",
    "scatter",
]
