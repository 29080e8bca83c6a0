"""The node's fingerprint index of CacheBlend segments: which stored documents start how.

A segment (docs/blend.md, "Finding segments in a prompt") is kept under a key
of its tokens alone, so a prompt that contains it cannot name it without
knowing where it starts. This catalog indexes every segment of at least
:data:`FINGERPRINT_TOKENS` tokens stored on this node by its first tokens
(their raw bytes are the dictionary key: a probe hashes nothing) and finds
them in a prompt by probing every ``stride``-th position.

An entry is a hint, never trusted: a fingerprint hit is checked against the
segment's whole key (blake3 of the prompt's tokens there) and against L1, and
an entry whose object left L1 is dropped on the way. The catalog lives in the
storage node, beside the objects it describes, so a gateway restart loses
nothing; it is bounded (least recently stored dropped first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.hashing import segment_key, tokens_to_be_u32
from kvmesh.common.keys import ObjectKey

#: Tokens at a segment's start that index it; shorter segments are not found.
FINGERPRINT_TOKENS = 16
#: Index entries kept (one per distinct model, salt, rank and first tokens).
MAX_ENTRIES = 65_536
#: Longest prompt one find probes.
MAX_PROMPT_TOKENS = 1 << 20

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


class SegmentCatalog:
    """Segments by their first tokens; ``find`` locates them in a prompt."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._max = max_entries
        # entry -> {segment length: its key}
        self._index: OrderedDict[_Entry, dict[int, ObjectKey]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(lengths) for lengths in self._index.values())

    @staticmethod
    def _entry(key: ObjectKey, head: bytes) -> _Entry:
        return (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id, head)

    def note(self, key: ObjectKey, tokens: np.ndarray) -> None:
        """Index a segment (tokens already checked against ``key``); short ones are not."""
        if tokens.size < FINGERPRINT_TOKENS:
            return
        entry = self._entry(key, tokens_to_be_u32(tokens[:FINGERPRINT_TOKENS]))
        self._index.setdefault(entry, {})[int(tokens.size)] = key
        self._index.move_to_end(entry)
        while len(self._index) > self._max:
            self._index.popitem(last=False)

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
        if tokens.size > MAX_PROMPT_TOKENS:
            raise InvalidArgument(
                f"at most {MAX_PROMPT_TOKENS} tokens per find, got {tokens.size}",
                field="token_ids",
            )
        step = max(1, stride)
        raw = tokens_to_be_u32(tokens)
        width = 4 * FINGERPRINT_TOKENS
        matches: list[tuple[int, int, ObjectKey]] = []
        probed = at = 0
        while at + FINGERPRINT_TOKENS <= tokens.size:
            probed += 1
            entry = self._entry(like, raw[4 * at : 4 * at + width])
            lengths = self._index.get(entry)
            found = 0
            if lengths:
                for length in sorted(lengths, reverse=True):
                    key = lengths[length]
                    if at + length > tokens.size:
                        continue
                    if segment_key(key.model_name, tokens[at : at + length]) != key.chunk_hash:
                        continue  # the same start, another document: keep it
                    if resident(key):
                        found = length
                        matches.append((at, length, key))
                        break
                    del lengths[length]  # the segment left L1: forget it
                if not lengths:
                    del self._index[entry]
            if found:
                at += found
                at += -at % step  # the next probe position on the stride
            else:
                at += step
        return matches, probed
