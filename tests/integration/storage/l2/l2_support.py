"""Keys and payloads for the L2 tests, importable by child processes too.

Payload bytes are derived from the key, so any process can check that what
it read back is the object stored under that key and whole.
"""

from __future__ import annotations

import hashlib

from kvmesh.common.keys import ObjectKey, object_name

MODEL = "org/model-a"


def make_key(
    i: int, *, model: str = MODEL, kv_rank: int = 0, group: int = 0, salt: str = ""
) -> ObjectKey:
    """The i-th test key (a real 32-byte chunk hash)."""
    digest = hashlib.blake2b(str(i).encode(), digest_size=32).digest()
    return ObjectKey(digest, model, kv_rank, group, salt)


def payload_for(key: ObjectKey, size: int) -> bytes:
    """``size`` bytes that only ``key`` stores (every key field changes them)."""
    seed = hashlib.blake2b(object_name(key).encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


def size_for(i: int) -> int:
    """A varying object size for the crash test (64 KiB .. ~1 MiB)."""
    return 65536 + (i * 104729) % (1 << 20)
