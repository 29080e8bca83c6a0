"""Protobuf ↔ core conversion for the coordinator's services and sources.

Everything that turns a request field into a core value (validating it and
naming the request's field when it is wrong) or a core value into a
response message lives here, as do the node commands every transport
carries (:func:`delete_command`, :func:`resync_commands`) and how they and
the nodes' answers are described to operators. The servicers
and the NATS source import this module; it imports only the core and the
generated API, so the arrows run core ← wire ← servicers / sources.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf import timestamp_pb2

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import (
    admin_pb2,
    directory_pb2,
    ingest_pb2,
    membership_pb2,
    policy_pb2,
)
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.convert import key_from_proto, key_to_proto
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import IngestResult, Tier
from kvmesh.common.keys import (
    ObjectKey,
    validate_cache_salt,
    validate_model_name,
    validate_object_key,
)
from kvmesh.coordinator.core.commands import CommandOutcome
from kvmesh.coordinator.core.types import (
    CursorInfo,
    DeleteRequest,
    Endpoints,
    InstanceInfo,
    KeyInfo,
    ModuleMemoryStatus,
    QuotaStatus,
)

MAX_LOOKUP_KEYS = 100_000
MAX_TOKENS = 1_000_000
MAX_PAGE_SIZE = 10_000
DEFAULT_PAGE_SIZE = 1000

_TIER_TO_PROTO = {Tier.L1: common_pb2.TIER_L1, Tier.L2: common_pb2.TIER_L2}

#: The gate's verdict as the proto enum of acks and IngestBatches results.
INGEST_RESULT = {
    IngestResult.ADMITTED: events_pb2.INGEST_RESULT_ADMITTED,
    IngestResult.DUPLICATE: events_pb2.INGEST_RESULT_DUPLICATE,
    IngestResult.STALE_INCARNATION: events_pb2.INGEST_RESULT_STALE_INCARNATION,
}

# -------------------------------------------------------------------------- requests


def tier_to_proto(tier: Tier) -> common_pb2.Tier.ValueType:
    """Core tier → proto enum."""
    return _TIER_TO_PROTO[tier]


def tier_filter(value: int, field: str = "tier") -> Tier | None:
    """A tier filter: L1, L2, or None for TIER_ALL / unspecified."""
    if value == common_pb2.TIER_L1:
        return Tier.L1
    if value == common_pb2.TIER_L2:
        return Tier.L2
    if value in (common_pb2.TIER_ALL, common_pb2.TIER_UNSPECIFIED):
        return None
    raise InvalidArgument(f"unknown tier {value}", field=field)


def concrete_tier(value: int, field: str = "tier", *, default: Tier | None = None) -> Tier:
    """L1 or L2 (unspecified → ``default`` when given); anything else is INVALID_ARGUMENT."""
    if value == common_pb2.TIER_UNSPECIFIED and default is not None:
        return default
    tier = tier_filter(value, field)
    if tier is None:
        raise InvalidArgument(f"{field} must be TIER_L1 or TIER_L2", field=field)
    return tier


def page_size(value: int, field: str = "page_size") -> int:
    """A requested page size (0 → the default), at most :data:`MAX_PAGE_SIZE`."""
    size = value or DEFAULT_PAGE_SIZE
    if size > MAX_PAGE_SIZE:
        raise InvalidArgument(f"page_size must be <= {MAX_PAGE_SIZE}", field=field)
    return size


def keys_from_proto(keys: directory_pb2.KeyList, field: str = "keys") -> list[ObjectKey]:
    """The validated keys of a KeyList (at most :data:`MAX_LOOKUP_KEYS`)."""
    if len(keys.keys) > MAX_LOOKUP_KEYS:
        raise InvalidArgument(
            f"at most {MAX_LOOKUP_KEYS} keys per call, got {len(keys.keys)}", field=field
        )
    out = [key_from_proto(k) for k in keys.keys]
    for i, key in enumerate(out):
        validate_object_key(key, field=f"{field}.keys[{i}]")
    return out


@dataclass(frozen=True, slots=True)
class TokenArgs:
    """A validated TokenQuery."""

    model_name: str
    world_size: int
    cache_salt: str
    token_ids: np.ndarray


def token_query(query: directory_pb2.TokenQuery, field: str = "tokens") -> TokenArgs:
    """Validate a TokenQuery (model required, at most 1 000 000 tokens)."""
    if not query.model_name:
        raise InvalidArgument("a token query needs model_name", field=f"{field}.model_name")
    # Checked here too (the core checks again) so the error names the request's field.
    validate_model_name(query.model_name, field=f"{field}.model_name")
    validate_cache_salt(query.cache_salt, field=f"{field}.cache_salt")
    if len(query.token_ids) > MAX_TOKENS:
        raise InvalidArgument(
            f"at most {MAX_TOKENS} tokens per query, got {len(query.token_ids)}",
            field=f"{field}.token_ids",
        )
    world_size = query.world_size or 1
    if world_size > 255:
        raise InvalidArgument("world_size must be <= 255", field=f"{field}.world_size")
    return TokenArgs(
        query.model_name,
        world_size,
        query.cache_salt,
        np.array(query.token_ids, dtype=np.uint32),
    )


def endpoints_from_proto(e: membership_pb2.InstanceEndpoints) -> Endpoints:
    """A node's advertised endpoints."""
    return Endpoints(e.gateway_address, e.storage_address, e.metrics_address)


# ------------------------------------------------------------------------- responses


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    """Wall-clock seconds as a Timestamp (0 and below: the zero Timestamp)."""
    ts = timestamp_pb2.Timestamp()
    if seconds > 0:
        ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def key_placements(info: KeyInfo, include_tokens: bool) -> directory_pb2.KeyPlacements:
    """What the directory knows of one key."""
    out = directory_pb2.KeyPlacements(
        key=key_to_proto(info.key),
        access_count=info.access_count,
        num_tokens=info.num_tokens or len(info.token_ids),
        placements=[
            common_pb2.Placement(
                instance_id=p.instance_id,
                incarnation=p.incarnation,
                tier=tier_to_proto(p.tier),
                backend=p.backend,
                size_bytes=p.size_bytes,
                shared=p.shared,
            )
            for p in info.placements
        ],
    )
    if info.last_access > 0:
        out.last_access.CopyFrom(timestamp(info.last_access))
    if include_tokens and info.token_ids:
        out.token_ids.extend(info.token_ids)
    return out


def ingest_cursor(c: CursorInfo) -> directory_pb2.IngestCursor:
    """The gate's cursor of one emitter."""
    return directory_pb2.IngestCursor(
        instance_id=c.instance_id,
        incarnation=c.incarnation,
        last_seq=c.last_seq,
        gap_detected=c.gap_detected,
        batches_admitted=c.batches_admitted,
        batches_duplicate=c.batches_duplicate,
        batches_stale=c.batches_stale,
        last_admitted=timestamp(c.last_admit_time),
    )


def instance(i: InstanceInfo, stream_connected: bool) -> membership_pb2.Instance:
    """A registered node (``stream_connected``: it has an event stream open now)."""
    return membership_pb2.Instance(
        instance_id=i.instance_id,
        incarnation=i.incarnation,
        endpoints=membership_pb2.InstanceEndpoints(
            gateway_address=i.endpoints.gateway_address,
            storage_address=i.endpoints.storage_address,
            metrics_address=i.endpoints.metrics_address,
        ),
        metadata=dict(i.metadata),
        registered_at=timestamp(i.registration_time),
        heartbeat_age_seconds=i.heartbeat_age_seconds,
        stream_connected=stream_connected,
    )


def module_usage(m: ModuleMemoryStatus) -> policy_pb2.ModuleUsage:
    """Used and declared bytes of one compartment."""
    out = policy_pb2.ModuleUsage(
        tier=tier_to_proto(m.tier),
        backend=m.backend,
        shared=m.shared,
        used_bytes=m.used_bytes,
        capacity_bytes=m.capacity_bytes,
    )
    if m.usage_ratio is not None:
        out.usage_ratio = m.usage_ratio
    return out


def salt_quota(q: QuotaStatus) -> policy_pb2.SaltQuota:
    """Quota and usage of one salt (the limit only when a quota exists)."""
    out = policy_pb2.SaltQuota(
        cache_salt=q.cache_salt, tier=tier_to_proto(q.tier), used_bytes=q.used_bytes
    )
    if q.limit_bytes is not None and q.quota_exists:
        out.limit_bytes = q.limit_bytes
    return out


# -------------------------------------------------------------------------- commands


def delete_command(
    tier: Tier, backend: str, keys: Sequence[ObjectKey], force: bool
) -> ingest_pb2.NodeCommand:
    """The NodeCommand that asks a node to delete ``keys`` (any transport carries it)."""
    return ingest_pb2.NodeCommand(
        delete_keys=ingest_pb2.DeleteKeysCommand(
            tier=tier_to_proto(tier),
            backend=backend,
            keys=[key_to_proto(k) for k in keys],
            force=force,
        )
    )


def resync_commands() -> list[ingest_pb2.NodeCommand]:
    """The NodeCommands that ask a node to announce everything it holds again, per tier."""
    return [
        ingest_pb2.NodeCommand(resync=ingest_pb2.ResyncCommand(tier=tier))
        for tier in (common_pb2.TIER_L1, common_pb2.TIER_L2)
    ]


_TIER_NAMES = {common_pb2.TIER_L1: "L1", common_pb2.TIER_L2: "L2", common_pb2.TIER_ALL: "ALL"}


def command_kind(command: ingest_pb2.NodeCommand) -> str:
    """The kind of a NodeCommand: "delete_keys", "resync", "set_quota" ("unknown" when unset)."""
    return command.WhichOneof("kind") or "unknown"


def command_summary(command: ingest_pb2.NodeCommand) -> str:
    """What a NodeCommand asks, for people: "L1 dram, 3 keys", "L2", "salt 't' L2 = 4096"."""
    kind = command.WhichOneof("kind")
    if kind == "delete_keys":
        d = command.delete_keys
        backend = d.backend or "every backend"
        force = ", force" if d.force else ""
        return f"{_TIER_NAMES.get(d.tier, '?')} {backend}, {len(d.keys)} keys{force}"
    if kind == "resync":
        return _TIER_NAMES.get(command.resync.tier, "?")
    if kind == "set_quota":
        q = command.set_quota
        limit = str(q.limit_bytes) if q.HasField("limit_bytes") else "none"
        return f"salt {q.cache_salt!r} {_TIER_NAMES.get(q.tier, '?')} = {limit}"
    return ""


# -------------------------------------------------------------------------- answers


def delete_outcome(
    request: DeleteRequest, outcome: CommandOutcome | None
) -> policy_pb2.DeleteCommandOutcome:
    """One delete command of an operator delete with the node's answer (if it came)."""
    out = policy_pb2.DeleteCommandOutcome(
        instance_id=request.instance_id,
        tier=tier_to_proto(request.tier),
        backend=request.backend,
        keys=len(request.keys),
        sent=request.accepted,
        command_id=request.command_id,
    )
    if outcome is not None:
        out.code = outcome.code
        out.message = outcome.message
        out.affected = outcome.affected
    return out


def command_failure(outcome: CommandOutcome) -> admin_pb2.CommandFailure:
    """A refused or failed command for the status view."""
    return admin_pb2.CommandFailure(
        command_id=outcome.command_id,
        instance_id=outcome.instance_id,
        command=outcome.kind,
        summary=outcome.summary,
        code=outcome.code,
        message=outcome.message,
        answered_at=timestamp(outcome.answered_at),
    )
