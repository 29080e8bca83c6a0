"""Chained blake3 over fixed-size token chunks, byte-identical to LMCache 0.5.6.

``h_0 = blake3(NONE_HASH || be_u32(tokens[0:C]))``,
``h_i = blake3(h_{i-1} || be_u32(tokens[iC:(i+1)C]))`` and
``NONE_HASH = blake3(be_i64(0) || be_u32(0))`` (twelve zero bytes). Only
complete chunks are hashed; a trailing partial chunk is ignored. The gateway
hashes prompts with it and the coordinator resolves token lookups with it, so
both must agree bit for bit (test vectors in tests/unit/test_hashing.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import blake3
import numpy as np

from kvmesh.common.errors import InvalidArgument

DEFAULT_CHUNK_SIZE = 256
NONE_HASH: bytes = blake3.blake3(b"\0" * 12).digest()
_UINT32_LIMIT = 1 << 32


def tokens_to_be_u32(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Big-endian uint32 bytes of ``tokens``; raises InvalidArgument if one does not fit."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return b""
    if arr.dtype == np.uint32:  # as a Protobuf fixed32 field arrives: nothing to check
        return arr.astype(">u4").tobytes()
    if arr.dtype.kind not in "iu":
        raise InvalidArgument("token_ids must be integers", field="token_ids")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise InvalidArgument("token_ids must be >= 0", field="token_ids")
    if int(arr.max()) >= _UINT32_LIMIT:
        raise InvalidArgument("token_ids must fit in 32 bits", field="token_ids")
    return arr.astype(">u4", copy=False).tobytes()


class TokenHasher:
    """Prefix-chained chunk hashes of a token sequence.

    With ``memo_entries`` > 0 it remembers the hash of recently seen
    (previous hash, chunk tokens) pairs, least recently used first out. A
    KV cache exists because prefixes repeat — every request behind one
    system prompt hashes the same chunks — and blake3 of one 256-token link
    (1056 bytes) costs ~2–3 µs here, against well under 1 µs to find the
    exact same bytes in a dict. The memo key is the full input of the hash,
    so a hit is exact, never a collision; each entry holds about 1.1 KiB.
    """

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, *, memo_entries: int = 0) -> None:
        if chunk_size < 1:
            raise InvalidArgument("chunk_size must be >= 1", field="chunk_size")
        if memo_entries < 0:
            raise InvalidArgument("memo_entries must be >= 0", field="memo_entries")
        self.chunk_size = chunk_size
        self.memo_entries = memo_entries
        self._memo: OrderedDict[bytes, bytes] = OrderedDict()
        self.memo_hits = 0
        self.memo_misses = 0

    def num_full_chunks(self, num_tokens: int) -> int:
        """How many complete chunks ``num_tokens`` tokens contain."""
        return num_tokens // self.chunk_size

    def hash_chunks(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        prefix_hash: bytes = NONE_HASH,
        max_chunks: int | None = None,
    ) -> list[bytes]:
        """Chunk hashes of every complete chunk of ``tokens``.

        ``prefix_hash`` continues an earlier chain: pass the last hash of the
        chunks before ``tokens`` to extend a prefix incrementally.
        """
        n_chunks = len(tokens) // self.chunk_size
        if max_chunks is not None:
            n_chunks = min(n_chunks, max_chunks)
        if n_chunks == 0:
            return []
        # As an array first: slicing a Protobuf repeated field (or a list) copies
        # it into Python ints, which costs more than hashing it.
        raw = tokens_to_be_u32(np.asarray(tokens)[: n_chunks * self.chunk_size])
        step = self.chunk_size * 4
        hashes: list[bytes] = []
        prev = prefix_hash
        if not self.memo_entries:
            for i in range(n_chunks):
                prev = blake3.blake3(prev + raw[i * step : (i + 1) * step]).digest()
                hashes.append(prev)
            return hashes
        memo = self._memo
        hits = 0
        for i in range(n_chunks):
            link = prev + raw[i * step : (i + 1) * step]
            found = memo.get(link)
            if found is None:
                found = blake3.blake3(link).digest()
                memo[link] = found
                if len(memo) > self.memo_entries:
                    memo.popitem(last=False)
            else:
                memo.move_to_end(link)
                hits += 1
            prev = found
            hashes.append(prev)
        self.memo_hits += hits
        self.memo_misses += n_chunks - hits
        return hashes


_SEGMENT_DOMAIN = b"kvmesh-blend-segment/v1\0"


def segment_key(model_name: str, tokens: Sequence[int] | np.ndarray) -> bytes:
    """The 32-byte key of a CacheBlend segment: the model and the segment's tokens alone.

    Not chained to any prefix and not salted here (the salt is a separate part of
    an object's key), so a document stored once is found after any prefix
    (docs/blend.md, "Segments in storage"). Raises InvalidArgument for tokens
    that are not uint32.
    """
    digest = blake3.blake3(_SEGMENT_DOMAIN + model_name.encode() + b"\0")
    digest.update(tokens_to_be_u32(tokens))
    return digest.digest()
