"""DirectoryService: read APIs over the directory and the gate's cursors."""

from __future__ import annotations

from typing import Any

from kvmesh.api.coordinator.v1 import directory_pb2, directory_pb2_grpc
from kvmesh.common.errors import InvalidArgument
from kvmesh.coordinator import wire
from kvmesh.coordinator.core.coordinator import Coordinator
from kvmesh.coordinator.core.scoring import ScoreResult, TierWeights


class DirectoryServicer(directory_pb2_grpc.DirectoryServiceServicer):
    """Read APIs over the directory and the gate's cursors."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core

    async def Lookup(
        self, request: directory_pb2.LookupRequest, context: Any
    ) -> directory_pb2.LookupResponse:
        which = request.WhichOneof("query")
        with_tokens = request.include_token_ids
        if which == "keys":
            keys = wire.keys_from_proto(request.keys)
            infos = self.core.lookup(keys, with_tokens=with_tokens)
            return directory_pb2.LookupResponse(
                chunks=len(keys), results=[wire.key_placements(i, with_tokens) for i in infos]
            )
        if which == "tokens":
            q = wire.token_query(request.tokens)
            found = self.core.lookup_tokens(
                q.model_name, q.world_size, q.cache_salt, q.token_ids, with_tokens=with_tokens
            )
            return directory_pb2.LookupResponse(
                chunks=found.chunks,
                results=[wire.key_placements(i, with_tokens) for i in found.results],
                cached_prefix_chunks=found.cached_prefix_chunks,
            )
        raise InvalidArgument("set exactly one of keys or tokens", field="query")

    async def BlendLookup(
        self, request: directory_pb2.BlendLookupRequest, context: Any
    ) -> directory_pb2.BlendLookupResponse:
        q = wire.token_query(request.tokens)
        matches, probed = self.core.blend_lookup(
            q.model_name, q.world_size, q.cache_salt, q.token_ids, request.stride
        )
        return directory_pb2.BlendLookupResponse(
            matches=[
                directory_pb2.BlendMatch(
                    start_token=m.start,
                    num_tokens=m.length,
                    chunk_hash=m.chunk_hash,
                    ranks=[wire.key_placements(info, False) for info in m.ranks],
                )
                for m in matches
            ],
            probed_positions=probed,
        )

    async def ListKeys(
        self, request: directory_pb2.ListKeysRequest, context: Any
    ) -> directory_pb2.ListKeysResponse:
        limit = wire.page_size(request.page_size)
        page = self.core.list_keys(
            tier=wire.tier_filter(request.tier),
            instance_id=request.instance_id,
            backend=request.backend,
            limit=limit,
            page_token=request.page_token,
        )
        response = directory_pb2.ListKeysResponse(
            keys=[wire.key_placements(i, False) for i in page.entries],
            next_page_token=page.next_page_token,
        )
        if page.total is not None:
            response.total = page.total
        return response

    async def GetStats(
        self, request: directory_pb2.GetStatsRequest, context: Any
    ) -> directory_pb2.GetStatsResponse:
        stats = self.core.stats()
        return directory_pb2.GetStatsResponse(
            num_keys=stats.num_keys,
            num_placements=stats.num_placements,
            l1_placements=stats.l1.count,
            l1_size_bytes=stats.l1.size_bytes,
            l2_placements=stats.l2.count,
            l2_size_bytes=stats.l2.size_bytes,
            l1_keys_by_instance=dict(stats.l1_keys_by_instance),
            token_bindings=stats.token_bindings,
        )

    async def ListIngestCursors(
        self, request: directory_pb2.ListIngestCursorsRequest, context: Any
    ) -> directory_pb2.ListIngestCursorsResponse:
        cursors = self.core.cursors()
        return directory_pb2.ListIngestCursorsResponse(
            cursors=[wire.ingest_cursor(c) for _, c in sorted(cursors.items())]
        )

    async def ScoreEngines(
        self, request: directory_pb2.ScoreEnginesRequest, context: Any
    ) -> directory_pb2.ScoreEnginesResponse:
        weights = None
        if request.HasField("weights"):
            base = TierWeights(*self.core.settings.score_weights)
            w = request.weights
            weights = TierWeights(
                engine=w.engine if w.HasField("engine") else base.engine,
                local_l1=w.local_l1 if w.HasField("local_l1") else base.local_l1,
                peer_l1=w.peer_l1 if w.HasField("peer_l1") else base.peer_l1,
                l2=w.l2 if w.HasField("l2") else base.l2,
            )
        result = self.core.score_engines(
            model_name=request.model_name,
            token_ids=request.token_ids,
            chunk_hashes=request.chunk_hashes,
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
            lora_id=request.lora_id,
            world_size=request.world_size or 1,
            engine_ids=request.engine_ids,
            weights=weights,
        )
        return _score_response(result, weights or TierWeights(*self.core.settings.score_weights))


def _score_response(
    result: ScoreResult, weights: TierWeights
) -> directory_pb2.ScoreEnginesResponse:
    return directory_pb2.ScoreEnginesResponse(
        chunks=result.chunks,
        chunk_size=result.chunk_size,
        scores=[
            directory_pb2.EngineScore(
                engine_id=s.engine_id,
                engine_tokens=s.engine_tokens,
                local_l1_tokens=s.local_l1_tokens,
                peer_l1_tokens=s.peer_l1_tokens,
                l2_tokens=s.l2_tokens,
                prefix_tokens=s.prefix_tokens,
                score=s.score,
                known=s.known,
                synced=s.synced,
            )
            for s in result.scores
        ],
        weights=directory_pb2.TierWeights(
            engine=weights.engine,
            local_l1=weights.local_l1,
            peer_l1=weights.peer_l1,
            l2=weights.l2,
        ),
    )
