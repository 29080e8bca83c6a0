"""Token bindings: the tokens of a chunk, kept as a hint next to the directory's keys.

A binding is ``(little-endian uint32 tokens, token_offset, compact keys
referencing it)``, by chunk hash. Tokens cost 4 bytes each (~1 KiB per
256-token chunk, which would dominate memory at ten million keys), so at
most ``cap`` chunk hashes keep one (0 disables them); beyond the cap the
oldest eighth is dropped in one sweep. A binding lists the keys that were
stored while it existed and is dropped when the last of those leaves.
Bindings are hints: a dropped one only makes lookups return no tokens.

Not thread-safe: the directory's lock guards it. Hot loops test
:attr:`TokenBindings.by_hash` (a plain dict) for emptiness instead of
calling a method per key.
"""

from __future__ import annotations

import itertools
import logging
import struct
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvmesh.common.events import CacheEventEntry
from kvmesh.coordinator.core.keyspace import SPACE_BYTES

logger = logging.getLogger(__name__)

DEFAULT_TOKEN_BINDING_CAP = 65_536
_U32 = struct.Struct("<I")
_BIG_ENDIAN = sys.byteorder == "big"

Binding = tuple[bytes, int, tuple[bytes, ...]]
"""(little-endian uint32 tokens, token_offset, compact keys referencing it)."""


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian uint32 (OverflowError when one does not fit)."""
    arr = array("I", tokens)
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI machine
        arr.byteswap()
    return arr.tobytes()


def bytes_to_tokens(raw: bytes) -> tuple[int, ...]:
    """The tokens of :func:`tokens_to_bytes`."""
    arr = array("I")
    arr.frombytes(raw)
    if _BIG_ENDIAN:  # pragma: no cover
        arr.byteswap()
    return tuple(arr)


class TokenBindings:
    """Bindings by chunk hash, in age order, bounded by ``cap``."""

    def __init__(self, cap: int = DEFAULT_TOKEN_BINDING_CAP) -> None:
        if cap < 0:
            raise ValueError("token_binding_cap must be >= 0")
        self.cap = cap
        self.by_hash: dict[bytes, Binding] = {}
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.by_hash)

    def attach(self, chunk_hash: bytes, ck: bytes) -> None:
        """Add ``ck`` to the keys of ``chunk_hash``'s binding, when there is one."""
        b = self.by_hash.get(chunk_hash)
        if b is not None and ck not in b[2]:
            self.by_hash[chunk_hash] = (b[0], b[1], (*b[2], ck))

    def detach(self, ck: bytes) -> None:
        """``ck`` left the directory: drop it from its binding, and the binding once unused."""
        h = ck[:-SPACE_BYTES]
        b = self.by_hash.get(h)
        if b is None or ck not in b[2]:
            return
        refs = tuple(r for r in b[2] if r != ck)
        if refs:
            self.by_hash[h] = (b[0], b[1], refs)
        else:
            del self.by_hash[h]

    def fill(self, entry: CacheEventEntry, ck: bytes) -> None:
        """Bind ``entry``'s tokens to its chunk hash (and ``ck`` to the binding)."""
        h = entry[0][0]
        toks = entry[2]
        offset = entry[3]
        b = self.by_hash.get(h)
        if b is not None:
            raw = b[0]
            # Same chunk hash means same tokens (the hash chains the tokens),
            # so an O(1) spot check is enough to skip a re-conversion; a
            # binding that differs anywhere checked is replaced below.
            if (
                b[1] == offset
                and len(raw) == 4 * len(toks)
                and _U32.unpack_from(raw, 0)[0] == toks[0]
                and _U32.unpack_from(raw, len(raw) - 4)[0] == toks[-1]
            ):
                if ck not in b[2]:
                    self.by_hash[h] = (raw, offset, (*b[2], ck))
                return
        try:
            raw = tokens_to_bytes(toks)
        except (OverflowError, TypeError, ValueError):
            logger.warning(
                "Token ids of chunk %s do not fit uint32; binding left unchanged", h.hex()[:16]
            )
            return
        refs = b[2] if b is not None else ()
        if ck not in refs:
            refs = (*refs, ck)
        if b is None and len(self.by_hash) >= self.cap:
            self._shrink()
        self.by_hash[h] = (raw, offset, refs)

    def _shrink(self) -> None:
        """Drop the oldest eighth of the bindings at once (amortised O(1) per insert)."""
        target = (self.cap * 7) // 8
        n = len(self.by_hash) - target
        if n <= 0:
            return
        for h in list(itertools.islice(self.by_hash, n)):
            del self.by_hash[h]
        self.dropped += n
        logger.debug("Token binding cap %d reached: dropped %d oldest", self.cap, n)

    # -- reads ---------------------------------------------------------------

    def raw(self, chunk_hash: bytes) -> bytes:
        """The packed tokens bound to ``chunk_hash`` (b"" when none)."""
        b = self.by_hash.get(chunk_hash)
        return b[0] if b is not None else b""

    def get(self, chunk_hash: bytes) -> Binding | None:
        """The binding of ``chunk_hash``, or None."""
        return self.by_hash.get(chunk_hash)

    # -- durable form ----------------------------------------------------------

    def capture(self) -> list[list[object]]:
        """``[[chunk_hash, offset, tokens_le_u32]…]`` in age order."""
        return [[h, b[1], b[0]] for h, b in self.by_hash.items()]

    @staticmethod
    def captured(rows: Iterable[Any]) -> dict[bytes, tuple[int, bytes]]:
        """A capture's rows as ``{chunk_hash: (offset, tokens)}`` (age order kept)."""
        return {bytes(h): (int(off), bytes(raw)) for h, off, raw in rows}

    def restore(
        self, captured: Mapping[bytes, tuple[int, bytes]], refs: Mapping[bytes, list[bytes]]
    ) -> None:
        """Replace the bindings with the captured ones some restored key refers to."""
        # Keep the captured (age) order so the cap keeps dropping the oldest.
        self.by_hash = {
            h: (raw, off, tuple(refs[h])) for h, (off, raw) in captured.items() if h in refs
        }
