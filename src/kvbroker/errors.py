"""The one error hierarchy of kvbroker, shared by the broker and the client.

Every error carries the gRPC status code it maps to. The broker raises these
and its servicers turn them into statuses in one place
(``kvbroker.broker.api``); the client turns a failed call back into the
same class with :func:`from_rpc_error`, so an engine can catch
``errors.InvalidArgument`` whichever side detected the problem.
"""

from __future__ import annotations

from typing import ClassVar

import grpc

from kvbroker.v1 import common_pb2

__all__ = [
    "Aborted",
    "AlreadyExists",
    "Cancelled",
    "CudaError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "GroupNotFound",
    "Internal",
    "InvalidArgument",
    "KvBrokerError",
    "NixlError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "RoomFailed",
    "TransferTimeout",
    "Unavailable",
    "Unimplemented",
    "from_rpc_error",
    "from_status",
]


class KvBrokerError(Exception):
    """Root of every kvbroker error. ``code`` is the gRPC status it maps to."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    @property
    def status_number(self) -> int:
        """The numeric gRPC status (what a batched call's per-item result carries)."""
        return int(self.code.value[0])


class InvalidArgument(KvBrokerError):
    """The request is malformed: bad indices, inconsistent layout, bad encoding."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KvBrokerError):
    """An engine, room or session the caller named does not exist here."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KvBrokerError):
    """A duplicate engine registration or room."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(KvBrokerError):
    """The call is valid but not in this state (wrong role, room not open, ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(KvBrokerError):
    """The caller may not touch this engine's regions or rooms."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KvBrokerError):
    """A configured limit was reached (message size, table size)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvBrokerError):
    """The broker or a peer cannot be reached, or is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(KvBrokerError):
    """A layout or feature this build does not support (the message says which)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class DeadlineExceeded(KvBrokerError):
    """A call did not finish in time."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(KvBrokerError):
    """The call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class Aborted(KvBrokerError):
    """A conflict the caller can resolve and retry (e.g. a peer's stale view of our engines)."""

    code = grpc.StatusCode.ABORTED


class Internal(KvBrokerError):
    """A bug or an unexpected failure inside the broker."""

    code = grpc.StatusCode.INTERNAL


class NixlError(Unavailable):
    """A NIXL call failed (post rejected, remote unreachable, bad descriptors)."""


class TransferTimeout(NixlError):
    """A posted transfer did not finish in time and was cancelled."""


class CudaError(Internal):
    """A CUDA driver call failed."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.cuda_code = code


class GroupNotFound(FailedPrecondition):
    """A sender's broker (or the fleet) does not hold the group or ranks a room
    needs, yet: bootstrapping retries it (``PeerClient.until_found``)."""


class RoomFailed(KvBrokerError):
    """A room ended FAILED. ``cause`` is the first cause the broker recorded."""

    code = grpc.StatusCode.ABORTED

    def __init__(self, room: int, cause: common_pb2.FailureCause) -> None:
        kind = common_pb2.FailureKind.Name(cause.kind)
        super().__init__(f"room {room} failed ({kind}): {cause.message}")
        self.room = room
        self.cause = cause


_BY_CODE: dict[grpc.StatusCode, type[KvBrokerError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        PermissionDenied,
        ResourceExhausted,
        Unavailable,
        Unimplemented,
        DeadlineExceeded,
        Cancelled,
        Aborted,
        Internal,
    )
}


def code_name(code: grpc.StatusCode) -> str:
    return str(code.name)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def from_status(code: int, message: str) -> KvBrokerError:
    """The typed error for a status code carried in a message (a batched call's
    per-item result; ``Internal`` for unmapped codes)."""
    return _BY_CODE.get(_CODES.get(code, grpc.StatusCode.UNKNOWN), Internal)(message)


def from_rpc_error(error: grpc.RpcError) -> KvBrokerError:
    """The typed error for a failed gRPC call (``Internal`` for unmapped codes)."""
    if isinstance(error, (grpc.Call, grpc.aio.AioRpcError)):
        code, details = error.code(), error.details() or code_name(error.code())
    else:
        code, details = grpc.StatusCode.UNKNOWN, str(error)
    cls = _BY_CODE.get(code, Internal)
    exc = cls(details)
    exc.__cause__ = error
    return exc
