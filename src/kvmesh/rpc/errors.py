"""kvmesh's RPC error: what a failed call raises, whichever transport carried it.

Every typed client (src/kvmesh/rpc/client.py) raises :class:`RpcError` for a
call that failed — over gRPC and over the local lane alike. It carries the
``grpc.StatusCode``, the status message and, when the server attached them,
the ``google.rpc.Status`` details (an ``ErrorInfo`` with reason, domain and
metadata), so callers branch on the code and read the reason the same way
for both transports.

Compatibility, decided on purpose: :class:`RpcError` subclasses
``grpc.RpcError`` and implements ``grpc.Call`` (``code()``, ``details()``,
``trailing_metadata()``), so ``except grpc.RpcError`` and helpers written
against gRPC's errors (:func:`error_info`, the server's relay of a failed
downstream call) keep working unchanged. It is *not* a
``grpc.aio.AioRpcError``: kvmesh builds no gRPC exception classes, so code
that catches ``grpc.aio.AioRpcError`` around a typed asyncio client must
catch ``grpc.RpcError`` (or this class) instead.

Client-side module: it loads neither a server nor Prometheus.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

#: The trailing-metadata key gRPC uses for a serialized ``google.rpc.Status``.
STATUS_DETAILS_KEY = "grpc-status-details-bin"
_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` of a numeric code (UNKNOWN for a number gRPC does not define)."""
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


class RpcError(grpc.RpcError, grpc.Call):
    """A failed kvmesh call: status code, message and the server's status details.

    ``status`` is the serialized ``google.rpc.Status`` the server sent with
    the error (empty when it sent none); :func:`error_info` reads its
    ``ErrorInfo``.
    """

    def __init__(self, code: grpc.StatusCode, details: str, status: bytes = b"") -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._status = status

    @classmethod
    def from_grpc(cls, exc: grpc.RpcError) -> RpcError:
        """The kvmesh error of a failed gRPC call (its code, details and status details)."""
        failed: Any = exc
        code = failed.code() if callable(getattr(failed, "code", None)) else None
        details = failed.details() if callable(getattr(failed, "details", None)) else None
        trailing = getattr(failed, "trailing_metadata", None)
        status = _status_from(trailing() if callable(trailing) else None)
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(exc), status)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def status(self) -> bytes:
        """The serialized ``google.rpc.Status`` the server sent (b"" when none)."""
        return self._status

    # Any: the grpc stubs type RpcError's and Call's trailing_metadata differently.
    def trailing_metadata(self) -> Any:
        """Like gRPC's: the status details under ``grpc-status-details-bin``, if any."""
        return ((STATUS_DETAILS_KEY, self._status),) if self._status else ()

    def initial_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return ()

    def debug_error_string(self) -> str:
        return str(self)

    # grpc.RpcContext: a failed call is over.
    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    def __str__(self) -> str:
        return f"<RpcError {self._code.name}: {self._details}>"

    def __repr__(self) -> str:
        return f"RpcError({self._code!r}, {self._details!r})"


def _status_from(metadata: Iterable[tuple[str, Any]] | None) -> bytes:
    for key, value in metadata or ():
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            return value
    return b""


def status_bytes(
    code: grpc.StatusCode, message: str, info: error_details_pb2.ErrorInfo | None = None
) -> bytes:
    """A serialized ``google.rpc.Status`` (with ``info`` packed into its details, if given)."""
    status = status_pb2.Status(code=code.value[0], message=message)
    if info is not None:
        status.details.add().Pack(info)
    data: bytes = status.SerializeToString()
    return data


def error_info(rpc_error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo detail of a failed call (kvmesh's or gRPC's), if the server attached one."""
    trailing = getattr(rpc_error, "trailing_metadata", None)
    if not callable(trailing):
        return None
    body = _status_from(trailing())
    if not body:
        return None
    status = status_pb2.Status.FromString(body)
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info
    return None
