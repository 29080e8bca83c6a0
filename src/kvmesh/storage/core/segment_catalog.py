"""The node's fingerprint index of CacheBlend segments: which stored documents start how.

A segment (docs/blend.md, "Finding segments in a prompt") is kept under a key
of its tokens alone, so a prompt that contains it cannot name it without
knowing where it starts. This catalog indexes every segment of at least 16
tokens stored on this node by its first 16 (their raw bytes are the
dictionary key: a probe hashes nothing) and finds them in a prompt with
:func:`kvmesh.common.segment_probe.probe`.

An entry is a hint, never trusted: a fingerprint hit is checked against the
segment's whole key (blake3 of the prompt's tokens there) and against L1, and
an entry whose object left L1 is dropped on the way. The catalog lives in the
storage node, beside the objects it describes, so a gateway restart loses
nothing; it is bounded (least recently stored dropped first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import SegmentHead
from kvmesh.common.hashing import segment_key
from kvmesh.common.keys import ObjectKey
from kvmesh.common.segment_probe import SEGMENT_FINGERPRINT_TOKENS, fingerprint, probe

#: Segments indexed (beyond it, the least recently stored first tokens' segments go).
MAX_ENTRIES = 65_536

_Entry = tuple[str, str, int, int, bytes]  # model, salt, kv rank, group, first tokens' bytes


def checked_segment_tokens(
    key: ObjectKey, tokens: Sequence[int] | np.ndarray, field: str
) -> np.ndarray:
    """``tokens`` as uint32, or InvalidArgument when they are not the ones ``key`` names."""
    array = np.asarray(tokens, dtype=np.uint32)
    if array.size == 0 or segment_key(key.model_name, array) != key.chunk_hash:
        raise InvalidArgument(
            f"{field} are not the tokens the segment key was made of "
            "(kvmesh.common.hashing.segment_key of the model and these tokens)",
            field=field,
        )
    return array


class FleetUnavailable(Exception):
    """The coordinator's blend index could not answer."""


class FleetSegments(Protocol):
    """The coordinator's blend index (docs/blend.md, "The fleet's blend index")."""

    def find(
        self,
        like: ObjectKey,
        world_size: int,
        prompt: Sequence[int],
        stride: int,
        timeout: float,
    ) -> list[tuple[int, int, bytes]]:
        """Segments of ``like``'s model and salt that some node holds inside ``prompt``:
        ``[(start, length, chunk_hash)]``, in prompt order, not overlapping. Blocking;
        raises :class:`FleetUnavailable` when the coordinator cannot answer."""
        ...


class SegmentCatalog:
    """Segments by their first tokens; ``find`` locates them in a prompt.

    Several segments may share their first tokens and even their length (a
    system prompt followed by one document or another): each is kept under its
    own key, and the prompt's tokens there say which one it holds.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._max = max_entries
        # entry -> {segment length: {chunk hash: its key}}
        self._index: OrderedDict[_Entry, dict[int, dict[bytes, ObjectKey]]] = OrderedDict()
        # key -> what the node's cache events say of it (docs/blend.md, "The fleet's blend index")
        self._heads: dict[ObjectKey, SegmentHead] = {}
        self._size = 0

    def head_of(self, key: ObjectKey) -> SegmentHead | None:
        """The first tokens and length of the segment under ``key``, if it is indexed."""
        return self._heads.get(key)

    def __len__(self) -> int:
        return self._size

    @staticmethod
    def _entry(key: ObjectKey, head: bytes) -> _Entry:
        return (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id, head)

    def _forget(self, entry: _Entry, length: int, chunk_hash: bytes) -> None:
        lengths = self._index.get(entry, {})
        keys = lengths.get(length, {})
        key = keys.pop(chunk_hash, None)
        if key is None:
            return
        self._size -= 1
        self._heads.pop(key, None)
        if not keys:
            del lengths[length]
            if not lengths:
                del self._index[entry]

    def note(self, key: ObjectKey, tokens: np.ndarray) -> None:
        """Index a segment (tokens already checked against ``key``); short ones are not."""
        if tokens.size < SEGMENT_FINGERPRINT_TOKENS:
            return
        head = tokens[:SEGMENT_FINGERPRINT_TOKENS]
        entry = self._entry(key, fingerprint(head))
        keys = self._index.setdefault(entry, {}).setdefault(int(tokens.size), {})
        if key.chunk_hash not in keys:
            self._size += 1
        keys[key.chunk_hash] = key
        self._heads[key] = SegmentHead(tuple(head.tolist()), int(tokens.size))
        self._index.move_to_end(entry)
        while self._size > self._max:
            _, dropped = self._index.popitem(last=False)
            for by_hash in dropped.values():
                self._size -= len(by_hash)
                for old in by_hash.values():
                    self._heads.pop(old, None)

    def find(
        self,
        like: ObjectKey,
        prompt: Sequence[int] | np.ndarray,
        stride: int,
        resident: Callable[[ObjectKey], bool],
    ) -> tuple[list[tuple[int, int, ObjectKey]], int]:
        """Segments of ``like``'s model, salt, rank and group inside ``prompt``.

        Returns ``([(start, length, key)], positions probed)``: matches in prompt
        order, not overlapping (at each position the longest resident segment wins
        and probing goes on after it). ``stride`` 0 is read as 1.
        """
        tokens = np.asarray(prompt, dtype=np.uint32)
        keys: dict[int, ObjectKey] = {}
        entry = self._entry(like, b"")
        lengths: dict[int, dict[bytes, ObjectKey]] = {}

        def lengths_at(head: bytes) -> list[int]:
            nonlocal entry, lengths
            entry = self._entry(like, head)
            lengths = self._index.get(entry, {})
            return sorted(lengths, reverse=True)

        def accept(start: int, length: int) -> bool:
            chunk_hash = segment_key(like.model_name, tokens[start : start + length])
            key = lengths[length].get(chunk_hash)
            if key is None:
                return False  # the same start, another document: keep it
            if not resident(key):
                self._forget(entry, length, chunk_hash)  # the segment left L1: forget it
                return False
            keys[start] = key
            return True

        found, probed = probe(tokens, stride, lengths_at, accept)
        return [(start, length, keys[start]) for start, length in found], probed
