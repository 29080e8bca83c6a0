"""Token sequence → directory keys (docs/coordinator.md, "Token lookups").

Only complete chunks are hashed (chained blake3, :class:`TokenHasher`), and
each chunk hash fans out to one key per kv rank ``r`` of ``world_size`` with
``kv_rank = worker_kv_rank(world_size, r)``, ``object_group_id = 0`` and the
request's salt; order is chunk-major, then rank. The input must be the
request's whole sequence from position 0 (the hash is prefix-chained).
:func:`lookup_tokens` looks the keys up and measures the cached prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.hashing import TokenHasher
from kvmesh.common.keys import (
    ObjectKey,
    validate_cache_salt,
    validate_model_name,
    worker_kv_rank,
)

from .directory import KeyDirectory
from .types import TokenLookup

MAX_TOKEN_IDS = 1_000_000
MAX_WORLD_SIZE = 255


def validate_world_size(world_size: int) -> None:
    """InvalidArgument unless ``world_size`` is in 1..MAX_WORLD_SIZE."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidArgument(
            f"world_size must be in [1, {MAX_WORLD_SIZE}], got {world_size}", field="world_size"
        )


def resolve_token_keys(
    hasher: TokenHasher,
    model_name: str,
    world_size: int,
    cache_salt: str,
    token_ids: Sequence[int] | np.ndarray,
) -> tuple[list[ObjectKey], int]:
    """Keys of every complete chunk of ``token_ids`` and the chunk count.

    Raises InvalidArgument for a bad model name or salt, a world size outside
    1..255, more than ``MAX_TOKEN_IDS`` tokens or a token outside uint32.
    """
    validate_model_name(model_name)
    validate_cache_salt(cache_salt)
    validate_world_size(world_size)
    if len(token_ids) > MAX_TOKEN_IDS:
        raise InvalidArgument(
            f"at most {MAX_TOKEN_IDS} token ids per request, got {len(token_ids)}",
            field="token_ids",
        )
    hashes = hasher.hash_chunks(token_ids)
    ranks = [worker_kv_rank(world_size, r) for r in range(world_size)]
    keys = [ObjectKey(h, model_name, rank, 0, cache_salt) for h in hashes for rank in ranks]
    return keys, len(hashes)


def lookup_tokens(
    hasher: TokenHasher,
    directory: KeyDirectory,
    model_name: str,
    world_size: int,
    cache_salt: str,
    token_ids: Sequence[int] | np.ndarray,
    *,
    with_tokens: bool = True,
) -> TokenLookup:
    """Resolve tokens to keys, expand across object groups, look each up."""
    keys, chunks = resolve_token_keys(hasher, model_name, world_size, cache_salt, token_ids)
    if not keys:
        return TokenLookup(0, ())
    groups = directory.get_keys_across_object_groups(keys)
    expanded = [k for ks in groups for k in ks]
    results = tuple(directory.lookup(expanded, with_tokens=with_tokens))
    # Leading chunks where every rank has a placement in some object group.
    held: list[bool] = []
    pos = 0
    for ks in groups:
        held.append(any(r.placements for r in results[pos : pos + len(ks)]))
        pos += len(ks)
    ranks = len(keys) // chunks
    cached = 0
    while cached < chunks and all(held[cached * ranks : (cached + 1) * ranks]):
        cached += 1
    return TokenLookup(chunks, results, cached)
