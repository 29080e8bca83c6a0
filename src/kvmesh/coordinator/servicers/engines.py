"""EngineService: follow, stop following and list vLLM engines (docs/routing.md)."""

from __future__ import annotations

from typing import Any

from kvmesh.api.coordinator.v1 import engines_pb2, engines_pb2_grpc
from kvmesh.common.errors import InvalidArgument
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.core.engines import EngineSpec


def spec_from_proto(spec: engines_pb2.EngineSpec) -> EngineSpec:
    """A request's spec, validated (InvalidArgument names the field)."""
    return EngineSpec(
        engine_id=spec.engine_id,
        endpoint=spec.endpoint,
        model_name=spec.model_name,
        replay_endpoint=spec.replay_endpoint,
        instance_id=spec.instance_id,
        topic=spec.topic,
        data_parallel_size=spec.data_parallel_size or 1,
    )


def spec_to_proto(spec: EngineSpec) -> engines_pb2.EngineSpec:
    return engines_pb2.EngineSpec(
        engine_id=spec.engine_id,
        endpoint=spec.endpoint,
        replay_endpoint=spec.replay_endpoint,
        model_name=spec.model_name,
        instance_id=spec.instance_id,
        topic=spec.topic,
        data_parallel_size=spec.data_parallel_size,
    )


class EngineServicer(engines_pb2_grpc.EngineServiceServicer):
    """Register, deregister and list followed engines."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core

    async def RegisterEngine(
        self, request: engines_pb2.RegisterEngineRequest, context: Any
    ) -> engines_pb2.RegisterEngineResponse:
        if not request.HasField("spec"):
            raise InvalidArgument("spec is required", field="spec")
        replaced = self.core.engines.register(spec_from_proto(request.spec))
        return engines_pb2.RegisterEngineResponse(replaced=replaced)

    async def DeregisterEngine(
        self, request: engines_pb2.DeregisterEngineRequest, context: Any
    ) -> engines_pb2.DeregisterEngineResponse:
        existed = self.core.engines.deregister(request.engine_id)
        return engines_pb2.DeregisterEngineResponse(existed=existed)

    async def ListEngines(
        self, request: engines_pb2.ListEnginesRequest, context: Any
    ) -> engines_pb2.ListEnginesResponse:
        engines = self.core.engines
        out = []
        for spec in engines.specs():
            streams = []
            for state in engines.states(spec.engine_id):
                counts = engines.index.counts(spec.engine_id, state.rank)
                streams.append(
                    engines_pb2.EngineStream(
                        data_parallel_rank=state.rank,
                        last_seq=state.last_seq,
                        incarnations=state.incarnations,
                        gaps=state.gaps,
                        replays=state.replays,
                        batches=state.batches,
                        blocks=counts.blocks,
                        chunks=counts.chunks,
                        synced=state.synced,
                        malformed=state.malformed,
                    )
                )
            out.append(engines_pb2.EngineStatus(spec=spec_to_proto(spec), streams=streams))
        return engines_pb2.ListEnginesResponse(engines=out)
