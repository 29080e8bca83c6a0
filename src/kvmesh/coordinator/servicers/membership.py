"""MembershipService: register, heartbeat, deregister, list."""

from __future__ import annotations

from typing import Any

from kvmesh.api.coordinator.v1 import membership_pb2, membership_pb2_grpc
from kvmesh.common.errors import InvalidArgument
from kvmesh.coordinator import wire
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.servicers.ingest import NodeStreams


class MembershipServicer(membership_pb2_grpc.MembershipServiceServicer):
    """Register, heartbeat, deregister, list."""

    def __init__(self, core: Coordinator, streams: NodeStreams) -> None:
        self.core = core
        self.streams = streams

    async def RegisterInstance(
        self, request: membership_pb2.RegisterInstanceRequest, context: Any
    ) -> membership_pb2.RegisterInstanceResponse:
        if not request.instance_id.strip():
            raise InvalidArgument(
                "instance_id must not be empty (kvmesh node ids are stable, never generated)",
                field="instance_id",
            )
        if "/" in request.instance_id or len(request.instance_id) > 256:
            raise InvalidArgument("instance_id is malformed", field="instance_id")
        if request.incarnation < 0:
            raise InvalidArgument("incarnation must be >= 0", field="incarnation")
        registration = self.core.register_instance(
            request.instance_id,
            incarnation=request.incarnation,
            endpoints=wire.endpoints_from_proto(request.endpoints),
            metadata=dict(request.metadata),
        )
        s = self.core.settings
        return membership_pb2.RegisterInstanceResponse(
            instance_id=registration.instance_id,
            re_registered=registration.re_registered,
            heartbeat_interval_ms=int(s.heartbeat_interval * 1000),
            instance_timeout_ms=int(s.instance_timeout * 1000),
        )

    async def Heartbeat(
        self, request: membership_pb2.HeartbeatRequest, context: Any
    ) -> membership_pb2.HeartbeatResponse:
        self.core.heartbeat(request.instance_id)
        return membership_pb2.HeartbeatResponse()

    async def DeregisterInstance(
        self, request: membership_pb2.DeregisterInstanceRequest, context: Any
    ) -> membership_pb2.DeregisterInstanceResponse:
        existed = self.core.deregister_instance(request.instance_id)
        return membership_pb2.DeregisterInstanceResponse(existed=existed)

    async def ListInstances(
        self, request: membership_pb2.ListInstancesRequest, context: Any
    ) -> membership_pb2.ListInstancesResponse:
        return membership_pb2.ListInstancesResponse(
            instances=[
                wire.instance(i, self.streams.connected(i.instance_id))
                for i in sorted(self.core.list_instances(), key=lambda i: i.instance_id)
            ]
        )
