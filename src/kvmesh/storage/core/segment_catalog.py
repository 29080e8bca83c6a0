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

#: Index entries kept (one per distinct model, salt, rank and first tokens).
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
    """Segments by their first tokens; ``find`` locates them in a prompt."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._max = max_entries
        # entry -> {segment length: its key}
        self._index: OrderedDict[_Entry, dict[int, ObjectKey]] = OrderedDict()
        # key -> what the node's cache events say of it (docs/blend.md, "The fleet's blend index")
        self._heads: dict[ObjectKey, SegmentHead] = {}

    def head_of(self, key: ObjectKey) -> SegmentHead | None:
        """The first tokens and length of the segment under ``key``, if it is indexed."""
        return self._heads.get(key)

    def _drop(self, lengths: dict[int, ObjectKey], length: int) -> None:
        self._heads.pop(lengths.pop(length), None)

    def __len__(self) -> int:
        return sum(len(lengths) for lengths in self._index.values())

    @staticmethod
    def _entry(key: ObjectKey, head: bytes) -> _Entry:
        return (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id, head)

    def note(self, key: ObjectKey, tokens: np.ndarray) -> None:
        """Index a segment (tokens already checked against ``key``); short ones are not."""
        if tokens.size < SEGMENT_FINGERPRINT_TOKENS:
            return
        head = tokens[:SEGMENT_FINGERPRINT_TOKENS]
        entry = self._entry(key, fingerprint(head))
        lengths = self._index.setdefault(entry, {})
        if int(tokens.size) in lengths:
            self._drop(lengths, int(tokens.size))
        lengths[int(tokens.size)] = key
        self._heads[key] = SegmentHead(tuple(head.tolist()), int(tokens.size))
        self._index.move_to_end(entry)
        while len(self._index) > self._max:
            _, dropped = self._index.popitem(last=False)
            for length in list(dropped):
                self._drop(dropped, length)

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
        lengths: dict[int, ObjectKey] = {}

        def lengths_at(head: bytes) -> list[int]:
            nonlocal lengths
            entry = self._entry(like, head)
            lengths = self._index.get(entry, {})
            return sorted(lengths, reverse=True)

        def accept(start: int, length: int) -> bool:
            key = lengths[length]
            if segment_key(key.model_name, tokens[start : start + length]) != key.chunk_hash:
                return False  # the same start, another document: keep it
            if not resident(key):
                self._drop(lengths, length)  # the segment left L1: forget it
                if not lengths:
                    self._index.pop(self._entry(like, fingerprint(tokens[start:])), None)
                return False
            keys[start] = key
            return True

        found, probed = probe(tokens, stride, lengths_at, accept)
        return [(start, length, keys[start]) for start, length in found], probed
