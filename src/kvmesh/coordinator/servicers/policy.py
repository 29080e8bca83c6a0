"""PolicyService: quotas, pins, usage, eviction and operator deletes."""

from __future__ import annotations

import asyncio
from typing import Any

from kvmesh.api.coordinator.v1 import policy_pb2, policy_pb2_grpc
from kvmesh.common.convert import key_to_proto
from kvmesh.common.errors import FailedPrecondition, InvalidArgument
from kvmesh.common.events import Tier
from kvmesh.common.keys import validate_cache_salt
from kvmesh.coordinator import wire
from kvmesh.coordinator.core.coordinator import Coordinator

#: Seconds DeleteKeys waits for the nodes' answers to its commands.
DELETE_ANSWER_WAIT_S = 2.0


def _answer_wait(context: Any) -> float:
    """How long DeleteKeys waits for the nodes' answers: 2 s, less near the deadline."""
    remaining = context.time_remaining() if context is not None else None
    if remaining is None:
        return DELETE_ANSWER_WAIT_S
    return max(0.0, min(DELETE_ANSWER_WAIT_S, float(remaining) - 0.5))


def _l2_only(value: int, field: str = "tier") -> Tier:
    """The tier of a fleet quota request: L2 (or unspecified); L1 quotas are per node."""
    tier = wire.concrete_tier(value, field, default=Tier.L2)
    if tier is not Tier.L2:
        raise InvalidArgument(
            "fleet quotas apply to L2 (per-node L1 quotas are set on StorageService)", field=field
        )
    return tier


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    """Quotas, pins, usage, eviction and operator deletes."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core

    async def SetQuota(
        self, request: policy_pb2.SetQuotaRequest, context: Any
    ) -> policy_pb2.SetQuotaResponse:
        _l2_only(request.tier)
        validate_cache_salt(request.cache_salt)
        self.core.set_quota(request.cache_salt, request.limit_bytes)
        return policy_pb2.SetQuotaResponse(
            quota=wire.salt_quota(self.core.quota_status(request.cache_salt, Tier.L2))
        )

    async def GetQuota(
        self, request: policy_pb2.GetQuotaRequest, context: Any
    ) -> policy_pb2.GetQuotaResponse:
        tier = wire.concrete_tier(request.tier, default=Tier.L2)
        validate_cache_salt(request.cache_salt)
        return policy_pb2.GetQuotaResponse(
            quota=wire.salt_quota(self.core.quota_status(request.cache_salt, tier))
        )

    async def DeleteQuota(
        self, request: policy_pb2.DeleteQuotaRequest, context: Any
    ) -> policy_pb2.DeleteQuotaResponse:
        _l2_only(request.tier)
        validate_cache_salt(request.cache_salt)
        return policy_pb2.DeleteQuotaResponse(existed=self.core.delete_quota(request.cache_salt))

    async def ListQuotas(
        self, request: policy_pb2.ListQuotasRequest, context: Any
    ) -> policy_pb2.ListQuotasResponse:
        tier = wire.concrete_tier(request.tier, default=Tier.L2)
        listing = self.core.list_quota_status(tier)
        return policy_pb2.ListQuotasResponse(
            quotas=[wire.salt_quota(q) for q in listing.by_cache_salt],
            total_used_bytes=listing.total_bytes,
        )

    async def SetDefaultQuota(
        self, request: policy_pb2.SetDefaultQuotaRequest, context: Any
    ) -> policy_pb2.SetDefaultQuotaResponse:
        _l2_only(request.tier)
        limit = request.limit_bytes if request.HasField("limit_bytes") else None
        self.core.set_default_quota(limit)
        response = policy_pb2.SetDefaultQuotaResponse()
        if limit is not None:
            response.limit_bytes = limit
        return response

    async def GetDefaultQuota(
        self, request: policy_pb2.GetDefaultQuotaRequest, context: Any
    ) -> policy_pb2.GetDefaultQuotaResponse:
        _l2_only(request.tier)
        limit = self.core.get_default_quota()
        response = policy_pb2.GetDefaultQuotaResponse()
        if limit is not None:
            response.limit_bytes = limit
        return response

    def _pin_query(
        self, request: policy_pb2.PinKeysRequest | policy_pb2.UnpinKeysRequest, pin: bool
    ) -> tuple[int, int]:
        """(requested chunks, affected keys) of a pin or unpin by keys or by tokens."""
        which = request.WhichOneof("query")
        if which == "keys":
            keys = wire.keys_from_proto(request.keys)
            affected = self.core.pin_keys(keys) if pin else self.core.unpin_keys(keys)
            return len(keys), affected
        if which == "tokens":
            q = wire.token_query(request.tokens)
            by_tokens = self.core.pin_tokens if pin else self.core.unpin_tokens
            result = by_tokens(q.model_name, q.world_size, q.cache_salt, q.token_ids)
            return result.requested_chunks, result.affected_keys
        raise InvalidArgument("set exactly one of keys or tokens", field="query")

    async def PinKeys(
        self, request: policy_pb2.PinKeysRequest, context: Any
    ) -> policy_pb2.PinKeysResponse:
        requested, affected = self._pin_query(request, pin=True)
        return policy_pb2.PinKeysResponse(requested_chunks=requested, affected_keys=affected)

    async def UnpinKeys(
        self, request: policy_pb2.UnpinKeysRequest, context: Any
    ) -> policy_pb2.UnpinKeysResponse:
        requested, affected = self._pin_query(request, pin=False)
        return policy_pb2.UnpinKeysResponse(requested_chunks=requested, affected_keys=affected)

    async def ListPins(
        self, request: policy_pb2.ListPinsRequest, context: Any
    ) -> policy_pb2.ListPinsResponse:
        page = self.core.list_pins(
            request.cache_salt or None,
            request.model_name or None,
            wire.page_size(request.page_size),
            request.page_token,
        )
        return policy_pb2.ListPinsResponse(
            pins=[
                policy_pb2.Pin(key=key_to_proto(p.key), pin_count=p.pin_count) for p in page.pins
            ],
            next_page_token=page.next_page_token,
            total=page.total,
        )

    async def GetUsage(
        self, request: policy_pb2.GetUsageRequest, context: Any
    ) -> policy_pb2.GetUsageResponse:
        fleet = self.core.fleet_usage()
        salts = []
        for tier in (Tier.L1, Tier.L2):
            for salt, used in sorted(self.core.usage_by_salt(tier).items()):
                salts.append(
                    policy_pb2.SaltUsage(
                        cache_salt=salt, tier=wire.tier_to_proto(tier), used_bytes=used
                    )
                )
        return policy_pb2.GetUsageResponse(
            instances=[
                policy_pb2.InstanceUsage(
                    instance_id=i.instance_id,
                    registered=i.registered,
                    declared_capacity=i.declared_capacity,
                    modules=[wire.module_usage(m) for m in i.modules],
                )
                for i in fleet.instances
            ],
            shared_modules=[wire.module_usage(m) for m in fleet.shared_modules],
            salts=salts,
        )

    async def RunEviction(
        self, request: policy_pb2.RunEvictionRequest, context: Any
    ) -> policy_pb2.RunEvictionResponse:
        report = self.core.run_eviction(dry_run=request.dry_run)
        if not report.ready and not request.dry_run:
            raise FailedPrecondition(
                "the coordinator is not ready to evict yet (nodes are still reporting)",
                reason="NOT_READY",
            )
        return policy_pb2.RunEvictionResponse(
            plan=[
                policy_pb2.SaltEviction(
                    cache_salt=salt,
                    victim_keys=len(keys),
                    victim_bytes=report.plan_bytes.get(salt, 0),
                )
                for salt, keys in sorted(report.plan.items())
            ],
            dispatched_commands=sum(1 for r in report.requests if r.accepted),
        )

    async def DeleteKeys(
        self, request: policy_pb2.DeleteKeysRequest, context: Any
    ) -> policy_pb2.DeleteKeysResponse:
        tier = wire.tier_filter(request.tier)
        which = request.WhichOneof("query")
        if which == "keys":
            result = self.core.delete_keys(
                wire.keys_from_proto(request.keys),
                instance_id=request.instance_id,
                tier=tier,
                force=request.force,
            )
        elif which == "tokens":
            q = wire.token_query(request.tokens)
            result = self.core.delete_tokens(
                q.model_name,
                q.world_size,
                q.cache_salt,
                q.token_ids,
                instance_id=request.instance_id,
                tier=tier,
                force=request.force,
            )
        else:
            raise InvalidArgument("set exactly one of keys or tokens", field="query")
        # The nodes' answers, so a refusal reaches the caller (policy.proto: DeleteKeys).
        ids = [r.command_id for r in result.requests if r.accepted and r.command_id]
        outcomes = {}
        if ids:
            outcomes = await asyncio.to_thread(self.core.commands.wait, ids, _answer_wait(context))
        commands = [wire.delete_outcome(r, outcomes.get(r.command_id)) for r in result.requests]
        return policy_pb2.DeleteKeysResponse(
            requested_keys=result.requested_keys,
            dispatched_keys=result.dispatched_keys,
            pin_skipped=result.pin_skipped,
            commands=commands,
            refused_commands=sum(1 for c in commands if c.code and c.code != "OK"),
            unanswered_commands=sum(1 for c in commands if c.sent and not c.code),
            deleted_keys=sum(c.affected for c in commands if c.code == "OK"),
        )
