"""The fleet's blend index: CacheBlend segments any node holds, found inside a prompt.

A broadcaster consumer, registered after the key directory (docs/blend.md,
"The fleet's blend index"). A node's STORE event for a segment carries the
segment's first tokens and length (``CacheEventEntry.segment``); this index
keeps, per model, salt and object group, which segment hashes start with
which 16 tokens. ``lookup`` probes a prompt with
:func:`kvmesh.common.segment_probe.probe`: a candidate is checked against
its whole key (blake3 of the prompt's tokens there) and against the
directory, which must hold a placement of it for every kv rank of the
requester's world size; the answer names the nodes and tiers, so a node can
fetch the segment from a peer (P2P) as it fetches prefix chunks.

Entries are hints. The directory is the truth about placements: an entry
whose segment no node holds any more is dropped when a lookup meets it. The
index is derived data and is not checkpointed; after a coordinator restart it
is filled again by new stores (documented in docs/blend.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvmesh.common.errors import FailedPrecondition
from kvmesh.common.events import CacheEventBatch, EventType
from kvmesh.common.hashing import segment_key
from kvmesh.common.keys import ObjectKey, worker_kv_rank
from kvmesh.common.segment_probe import SEGMENT_FINGERPRINT_TOKENS, fingerprint, probe

from .directory import KeyDirectory
from .types import KeyInfo

#: Segments indexed (beyond it, the least recently stored first tokens' segments go).
MAX_ENTRIES = 262_144

_Entry = tuple[str, str, int, bytes]  # model, salt, object group, first tokens' bytes


class BlendMatch:
    """A segment found in a prompt: tokens ``[start, start + length)``, every kv rank held."""

    __slots__ = ("chunk_hash", "length", "ranks", "start")

    def __init__(self, start: int, length: int, chunk_hash: bytes, ranks: list[KeyInfo]) -> None:
        self.start = start
        self.length = length
        self.chunk_hash = chunk_hash
        #: One KeyInfo (placements) per kv rank of the requester's world size.
        self.ranks = ranks


class BlendIndex:
    """CacheEventConsumer: segments of the whole fleet by their first tokens."""

    def __init__(
        self, directory: KeyDirectory, *, enabled: bool, max_entries: int = MAX_ENTRIES
    ) -> None:
        self.directory = directory
        self.enabled = enabled
        self._max = max_entries
        # entry -> {segment length: chunk hashes} (segments may share their start and
        # length: a system prompt followed by one document or another)
        self._index: OrderedDict[_Entry, dict[int, set[bytes]]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    # ---- CacheEventConsumer --------------------------------------------------------------------

    def consume(self, batch: CacheEventBatch) -> None:
        if not self.enabled or batch.event_type is not EventType.STORE:
            return
        for entry in batch.entries:
            segment = entry.segment
            if segment is None or len(segment.head_tokens) < SEGMENT_FINGERPRINT_TOKENS:
                continue
            key = entry.key
            head = fingerprint(np.asarray(segment.head_tokens, dtype=np.uint32))
            slot = (key.model_name, key.cache_salt, key.object_group_id, head)
            hashes = self._index.setdefault(slot, {}).setdefault(segment.num_tokens, set())
            if key.chunk_hash not in hashes:
                hashes.add(key.chunk_hash)
                self._size += 1
            self._index.move_to_end(slot)
        while self._size > self._max:
            _, dropped = self._index.popitem(last=False)
            self._size -= sum(map(len, dropped.values()))

    def fence_instance(self, instance_id: str) -> None:
        """Nothing to do: placements live in the directory, which a lookup consults."""

    # ---- lookup --------------------------------------------------------------------------------

    def lookup(
        self,
        model_name: str,
        world_size: int,
        cache_salt: str,
        prompt: Sequence[int] | np.ndarray,
        stride: int,
    ) -> tuple[list[BlendMatch], int]:
        """Segments held somewhere in the fleet inside ``prompt``: (matches, positions probed).

        Raises FailedPrecondition when the index is off (``--enable-blend-lookup``).
        """
        if not self.enabled:
            raise FailedPrecondition(
                "the blend index is off: start the coordinator with --enable-blend-lookup",
                reason="BLEND_LOOKUP_DISABLED",
            )
        tokens = np.asarray(prompt, dtype=np.uint32)
        ranks = [worker_kv_rank(world_size, r) for r in range(world_size)]
        lengths: dict[int, set[bytes]] = {}
        slot: _Entry = (model_name, cache_salt, 0, b"")
        held: dict[int, BlendMatch] = {}

        def lengths_at(head: bytes) -> list[int]:
            nonlocal lengths, slot
            slot = (model_name, cache_salt, 0, head)
            lengths = self._index.get(slot, {})
            return sorted(lengths, reverse=True)

        def accept(start: int, length: int) -> bool:
            chunk_hash = segment_key(model_name, tokens[start : start + length])
            hashes = lengths[length]
            if chunk_hash not in hashes:
                return False  # the same start, another document
            keys = [ObjectKey(chunk_hash, model_name, rank, 0, cache_salt) for rank in ranks]
            infos = self.directory.lookup(keys, with_tokens=False)
            if all(info.placements for info in infos):
                held[start] = BlendMatch(start, length, chunk_hash, infos)
                return True
            if not any(info.placements for info in infos):
                hashes.discard(chunk_hash)  # no node holds it any more
                self._size -= 1
                if not hashes:
                    del lengths[length]
                    if not lengths:
                        self._index.pop(slot, None)
            return False

        found, probed = probe(tokens, stride, lengths_at, accept)
        return [held[start] for start, _ in found], probed
