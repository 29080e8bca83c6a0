"""Segment stores and retrieves on engines whose KV memory the node opened (CacheBlend).

A segment is one document's K/V under a key of its tokens alone
(docs/blend.md, "Segments in storage"), stored with its keys rotated to
positions 0.. so that it can be placed after any prefix. Here the node makes
the copies itself, as for chunks: it gathers a request's tokens
``[start_token, start_token + num_tokens)`` out of the engine's paged blocks
into one L1 object, rotating the keys back to 0.., and scatters an object into
another request's blocks at any token position, rotating them forward
(:mod:`kvmesh.kernels.segments`). The rotation uses the RoPE parameters the
engine registered with its layout; an engine registered without them gets
FAILED_PRECONDITION, since its keys cannot be moved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvmesh.common.errors import FailedPrecondition, InvalidArgument
from kvmesh.common.keys import ObjectKey, validate_object_keys
from kvmesh.common.node_types import StoreOutcome
from kvmesh.kernels.kinds import KVLayoutKind
from kvmesh.storage.core.copies import ChunkCopier
from kvmesh.storage.core.manager import StorageManager
from kvmesh.storage.core.node_lookups import MAX_CHUNK_BYTES
from kvmesh.storage.core.segment_catalog import (
    FleetSegments,
    FleetUnavailable,
    SegmentCatalog,
    checked_segment_tokens,
)
from kvmesh.storage.core.transfer.layout import KVLayout, chunk_nbytes

#: Longest wait for the coordinator's blend index inside one FindSegments.
FLEET_FIND_TIMEOUT_S = 2.0
#: After the coordinator's blend index failed, finds stay local this long.
FLEET_RETRY_S = 30.0

logger = logging.getLogger(__name__)


class NodeSegments:
    """``StoreSegment`` and ``RetrieveSegment`` of the storage service."""

    def __init__(
        self,
        manager: StorageManager,
        copier: ChunkCopier,
        layout: Callable[[str], KVLayout],
    ) -> None:
        """``layout(engine_id)``: the engine's registered layout (FAILED_PRECONDITION if none)."""
        self._manager = manager
        self._copier = copier
        self._layout = layout
        self.catalog = SegmentCatalog()
        #: The coordinator's blend index (a node with a coordinator and P2P); None: local only.
        self.fleet: FleetSegments | None = None
        #: While the coordinator cannot answer, finds stay local until then (monotonic).
        self._fleet_down_until = 0.0
        self._clock = time.monotonic

    def note(
        self, keys: Sequence[ObjectKey], tokens: Sequence[int] | np.ndarray, field: str
    ) -> None:
        """Index the one segment ``keys`` names by ``tokens`` (checked) for :meth:`find`."""
        if len(keys) != 1:
            raise InvalidArgument(
                f"{field} need exactly one segment key, got {len(keys)} keys", field=field
            )
        self.catalog.note(keys[0], checked_segment_tokens(keys[0], tokens, field))

    def find(
        self, like: ObjectKey, prompt: Sequence[int] | np.ndarray, stride: int
    ) -> tuple[list[tuple[int, int, ObjectKey]], int]:
        """Segments resident in L1 inside ``prompt`` (see :meth:`SegmentCatalog.find`)."""
        if not like.model_name:
            raise InvalidArgument("model_name must be set", field="model_name")
        return self.catalog.find(
            like, prompt, stride, lambda key: self._manager.l1.contains([key])[0]
        )

    async def find_in_fleet(
        self, like: ObjectKey, prompt: Sequence[int] | np.ndarray, stride: int
    ) -> tuple[list[tuple[int, int, ObjectKey, bool]], int]:
        """:meth:`find`, then, where the prompt is still uncovered, the segments other
        nodes hold (the coordinator's blend index): ``([(start, length, key, here)],
        probed)``. A coordinator that cannot answer leaves the local matches."""
        local, probed = self.find(like, prompt, stride)
        found = [(start, length, key, True) for start, length, key in local]
        if self.fleet is None or self._clock() < self._fleet_down_until:
            return found, probed
        tokens = np.asarray(prompt, dtype=np.uint32).tolist()
        world_size = (like.kv_rank >> 24) or 1  # the packed kv rank's top byte
        try:
            remote = await asyncio.to_thread(
                self.fleet.find, like, world_size, tokens, stride, FLEET_FIND_TIMEOUT_S
            )
        except FleetUnavailable as exc:
            # A coordinator that is down (or runs without the index) costs one call per
            # FLEET_RETRY_S, not a timeout per lookup.
            self._fleet_down_until = self._clock() + FLEET_RETRY_S
            logger.warning(
                "segments are found on this node only for %.0f s: %s", FLEET_RETRY_S, exc
            )
            return found, probed
        taken = [(start, start + length) for start, length, _, _ in found]
        for start, length, chunk_hash in remote:
            end = start + length
            if all(end <= a or start >= b for a, b in taken):
                key = ObjectKey(chunk_hash, like.model_name, like.kv_rank,
                                like.object_group_id, like.cache_salt)  # fmt: skip
                found.append((start, length, key, self._manager.l1.contains([key])[0]))
        found.sort(key=lambda match: match[0])
        return found, probed

    def _checked(
        self,
        engine_id: str,
        key: ObjectKey,
        block_ids: Sequence[int],
        start: int,
        count: int,
        *,
        writes: bool,
    ) -> int:
        """The segment object's size, once every argument is known to be good (before
        any shortcut: a bad placement is refused even when the key is cached)."""
        layout = self._layout(engine_id)
        if layout.kind is KVLayoutKind.MLA:
            raise InvalidArgument(
                "segments need a K/V layout; an MLA cache has one latent plane",
                field="segment.engine_id",
                reason="SEGMENT_LAYOUT",
            )
        if layout.rope is None:
            raise FailedPrecondition(
                f"engine {engine_id!r} registered its KV without RoPE parameters "
                "(layout.rope): its keys cannot be moved to another position",
                reason="NO_ROPE_PARAMETERS",
            )
        validate_object_keys([key], "segment.key")
        if count < 1:
            raise InvalidArgument("a segment needs num_tokens >= 1", field="segment.num_tokens")
        need = -(-(start + count) // layout.block_size)
        if len(block_ids) < need:
            raise InvalidArgument(
                f"tokens [{start}, {start + count}) at block_size {layout.block_size} need "
                f"{need} block ids, got {len(block_ids)}",
                field="segment.block_ids",
                reason="TOO_FEW_BLOCK_IDS",
            )
        touched = block_ids[start // layout.block_size : need]
        for i, block in enumerate(touched, start // layout.block_size):
            if block >= layout.num_blocks:
                raise InvalidArgument(
                    f"segment.block_ids[{i}] = {block} is outside the engine's "
                    f"{layout.num_blocks} blocks",
                    field="segment.block_ids",
                )
        if writes and len(set(touched)) < len(touched):
            raise InvalidArgument(
                "a block id is listed twice among the blocks this retrieve writes",
                field="segment.block_ids",
            )
        nbytes = chunk_nbytes(layout, count)
        if nbytes > MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"a {count}-token segment is {nbytes} bytes, more than one object may hold "
                f"({MAX_CHUNK_BYTES})",
                field="segment.num_tokens",
            )
        return nbytes

    async def store(
        self,
        engine_id: str,
        key: ObjectKey,
        block_ids: Sequence[int],
        start: int,
        count: int,
        tokens: Sequence[int] | np.ndarray = (),
    ) -> StoreOutcome:
        """Gather tokens ``[start, start + count)`` into a new object under ``key``;
        with its ``tokens``, also index it for :meth:`find`."""
        nbytes = self._checked(engine_id, key, block_ids, start, count, writes=False)
        if len(tokens) and len(tokens) != count:
            raise InvalidArgument(
                f"segment.token_ids holds {len(tokens)} tokens, num_tokens is {count}",
                field="segment.token_ids",
            )
        if len(tokens):
            # Before the copy: the store's cache event reads the catalog (a hint,
            # dropped by find when the object never arrives).
            self.catalog.note(key, checked_segment_tokens(key, tokens, "segment.token_ids"))
        return await self._copier.store_segment(engine_id, key, block_ids, start, count, nbytes)

    async def retrieve(
        self, engine_id: str, key: ObjectKey, block_ids: Sequence[int], start: int, count: int
    ) -> bool:
        """Scatter the object under ``key`` into tokens ``[start, start + count)``; False
        (nothing written) when it is not in L1 or holds another size."""
        nbytes = self._checked(engine_id, key, block_ids, start, count, writes=True)
        return await self._copier.retrieve_segment(engine_id, key, block_ids, start, count, nbytes)
