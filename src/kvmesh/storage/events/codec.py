"""The event pipeline's wire codec: batches, acks, commands and results as protos.

Batches convert with :mod:`kvmesh.common.convert` (shared with the
coordinator's ingest, so both ends agree on every field); this module adds
what only the node's side of the stream needs, for every transport:

* :class:`BatchEncoder` — a session's batches as ``kvmesh.events.v1``
  messages or bytes, dropping token ids from a batch that cannot travel with
  them (logged once per session) rather than wedging the stream;
* :func:`ingest_result_from_proto` — an ack's verdict;
* :func:`command_from_proto` / :func:`result_to_proto` — coordinator
  commands (``kvmesh.coordinator.v1.NodeCommand``) into the core's
  :data:`~kvmesh.storage.core.ports.NodeCommand`, and the node's
  :class:`~kvmesh.storage.events.transport.CommandResult` back.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.convert import batch_to_proto, key_from_proto, tier_from_proto
from kvmesh.common.errors import KvmeshError
from kvmesh.common.events import CacheEventBatch, IngestResult
from kvmesh.common.keys import validate_cache_salt, validate_object_key
from kvmesh.storage.core.ports import (
    DeleteKeysCommand,
    NodeCommand,
    QuotaChangedCommand,
    ResyncCommand,
)
from kvmesh.storage.events.transport import CommandResult, TransportError

logger = logging.getLogger(__name__)

__all__ = [
    "BatchEncoder",
    "UnsupportedCommand",
    "command_from_proto",
    "ingest_result_from_proto",
    "result_to_proto",
]

_UINT32_MAX = 0xFFFFFFFF
_INGEST_RESULTS: dict[int, IngestResult] = {int(r): r for r in IngestResult}
#: What ``batch_to_proto`` raises for a value that does not fit its wire type.
_UNENCODABLE = (ValueError, TypeError, OverflowError)


# --------------------------------------------------------------------------------------
# Batches and acks
# --------------------------------------------------------------------------------------


class BatchEncoder:
    """Encodes one session's batches; a batch that cannot travel whole goes without token ids.

    The emitter would resend an unencodable (or oversized) batch forever.
    Token ids are the one optional payload, so they are dropped rather than
    wedge the stream; the first such batch of a session is logged. ``wire``
    names the transport in that log line.
    """

    def __init__(self, wire: str) -> None:
        self._wire = wire
        self._warned = False

    def to_proto(self, batch: CacheEventBatch) -> events_pb2.CacheEventBatch:
        """The wire message of ``batch``; TransportError when even the stripped one fails."""
        try:
            return batch_to_proto(batch)
        except _UNENCODABLE as exc:
            problem = str(exc)
        return self._without_tokens(batch, problem)

    def to_bytes(self, batch: CacheEventBatch, max_bytes: int) -> bytes:
        """The serialized batch, stripped of token ids when it would exceed ``max_bytes``.

        The result may still exceed ``max_bytes`` (the caller decides what
        that means); TransportError when even the stripped batch fails.
        """
        try:
            payload = batch_to_proto(batch).SerializeToString()
            if len(payload) <= max_bytes:
                return payload
            problem = f"{len(payload)} bytes exceed the limit of {max_bytes}"
        except _UNENCODABLE as exc:
            problem = str(exc)
        return self._without_tokens(batch, problem).SerializeToString()

    def _without_tokens(self, batch: CacheEventBatch, problem: str) -> events_pb2.CacheEventBatch:
        if not self._warned:
            self._warned = True
            logger.error(
                "cache event batch %s does not fit %s (%s); sending it without token ids",
                batch.ident(),
                self._wire,
                problem,
            )
        stripped = replace(batch, entries=tuple(e._replace(token_ids=()) for e in batch.entries))
        try:
            return batch_to_proto(stripped)
        except _UNENCODABLE as exc:
            raise TransportError(
                f"cache event batch {batch.ident()} cannot be encoded: {exc}"
            ) from exc


def ingest_result_from_proto(value: int) -> IngestResult | None:
    """The core verdict of a wire ``IngestResult``; None for a value the node does not know."""
    return _INGEST_RESULTS.get(value)


# --------------------------------------------------------------------------------------
# Commands and results
# --------------------------------------------------------------------------------------


class UnsupportedCommand(KvmeshError):
    """A command kind this node does not know (a newer coordinator); answered UNIMPLEMENTED."""

    code = "UNIMPLEMENTED"
    default_reason = "UNSUPPORTED_NODE_COMMAND"


def command_from_proto(msg: ingest_pb2.NodeCommand) -> NodeCommand:
    """The core's form of a wire command, validated.

    Raises :class:`~kvmesh.common.errors.InvalidArgument` (naming the field)
    for a tier other than L1/L2 or an invalid key or salt;
    :class:`UnsupportedCommand` when no known kind is set. An absent
    ``limit_bytes`` removes the quota (None).
    """
    command_id = msg.command_id
    kind = msg.WhichOneof("kind")
    if kind == "delete_keys":
        delete = msg.delete_keys
        keys = tuple(key_from_proto(k) for k in delete.keys)
        for i, key in enumerate(keys):
            validate_object_key(key, field=f"command.delete_keys.keys[{i}]")
        return DeleteKeysCommand(
            command_id=command_id,
            tier=tier_from_proto(delete.tier, "command.delete_keys.tier"),
            backend=delete.backend,
            keys=keys,
            force=delete.force,
        )
    if kind == "resync":
        return ResyncCommand(
            command_id=command_id, tier=tier_from_proto(msg.resync.tier, "command.resync.tier")
        )
    if kind == "set_quota":
        quota = msg.set_quota
        validate_cache_salt(quota.cache_salt, field="command.set_quota.cache_salt")
        tier = tier_from_proto(quota.tier, "command.set_quota.tier")
        limit = quota.limit_bytes if quota.HasField("limit_bytes") else None
        return QuotaChangedCommand(
            command_id=command_id, cache_salt=quota.cache_salt, tier=tier, quota_bytes=limit
        )
    raise UnsupportedCommand(f"command {command_id!r} has no kind this node understands")


def result_to_proto(result: CommandResult) -> ingest_pb2.CommandResult:
    """The wire form of a command's result (``affected`` saturates at uint32)."""
    return ingest_pb2.CommandResult(
        command_id=result.command_id,
        code=result.code,
        message=result.message,
        affected=min(max(result.affected, 0), _UINT32_MAX),
        effects_through_seq=result.effects_through_seq,
    )
