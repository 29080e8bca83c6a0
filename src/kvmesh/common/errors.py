"""Exception types every service core raises, and the status code each maps to.

Core code raises these; it never imports grpc. The chassis' error-mapping
interceptor turns them into a gRPC status with the exception's message and a
``google.rpc.ErrorInfo`` detail carrying ``reason`` and ``metadata``, so a
machine can branch on the reason without parsing the message.
"""

from __future__ import annotations

from collections.abc import Mapping

ERROR_DOMAIN = "kvmesh.dev"


class KvmeshError(Exception):
    """Base class of every expected failure.

    ``code`` is the name of a ``grpc.StatusCode`` member; ``reason`` is a
    stable UPPER_SNAKE identifier for ``google.rpc.ErrorInfo``.
    """

    code = "UNKNOWN"
    default_reason = "UNKNOWN"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata: dict[str, str] = dict(metadata or {})


class InvalidArgument(KvmeshError):
    """The request itself is malformed; retrying it unchanged cannot succeed."""

    code = "INVALID_ARGUMENT"
    default_reason = "INVALID_ARGUMENT"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        meta = dict(metadata or {})
        if field is not None:
            meta.setdefault("field", field)
        super().__init__(message, reason=reason, metadata=meta)
        self.field = field


class NotFound(KvmeshError):
    """A named entity (instance, request id, key) does not exist."""

    code = "NOT_FOUND"
    default_reason = "NOT_FOUND"


class AlreadyExists(KvmeshError):
    """The entity to create exists already and the call is not idempotent."""

    code = "ALREADY_EXISTS"
    default_reason = "ALREADY_EXISTS"


class FailedPrecondition(KvmeshError):
    """The system is not in the state the call needs (e.g. store before register)."""

    code = "FAILED_PRECONDITION"
    default_reason = "FAILED_PRECONDITION"


class ResourceExhausted(KvmeshError):
    """Out of a bounded resource: L1 memory, a quota, a message size limit."""

    code = "RESOURCE_EXHAUSTED"
    default_reason = "RESOURCE_EXHAUSTED"


class Unavailable(KvmeshError):
    """A dependency is down; the call may succeed when retried later."""

    code = "UNAVAILABLE"
    default_reason = "UNAVAILABLE"


class DeadlineExceeded(KvmeshError):
    """The operation did not finish within the time the caller allowed."""

    code = "DEADLINE_EXCEEDED"
    default_reason = "DEADLINE_EXCEEDED"


class Aborted(KvmeshError):
    """A concurrent change made the operation fail; the caller may retry."""

    code = "ABORTED"
    default_reason = "ABORTED"
