"""The storage key of one chunk of KV cache, and the rules every service applies to it.

``ObjectKey`` is a plain tuple so it is cheap to build on hot paths and can be
used as a dict key; ``validate_object_key`` enforces the invariants at the
edges (a servicer receiving a key, a file name being parsed). The rules are
LMCache 0.5.6's, plus an exact
32-byte chunk hash, because every key kvmesh makes is a blake3 digest.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

from kvmesh.common.errors import InvalidArgument

CHUNK_HASH_BYTES = 32
MAX_CACHE_SALT_CHARS = 128
MAX_MODEL_NAME_CHARS = 512
_FORBIDDEN_SALT_CHARS = frozenset("@/\\\0")
_UINT32_MAX = 0xFFFFFFFF


class ObjectKey(NamedTuple):
    """One chunk of one kv rank of one object group, in one tenant's namespace.

    ``cache_salt`` is part of identity: two tenants with the same tokens get
    different keys and can never read each other's KV.
    """

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""

    def describe(self) -> str:
        """Short human form for logs and error messages."""
        salt = f"@{self.cache_salt}" if self.cache_salt else ""
        return (
            f"{self.model_name}@{self.kv_rank:08x}@{self.object_group_id:x}"
            f"@{self.chunk_hash.hex()[:16]}{salt}"
        )


def pack_kv_rank(world_size: int, global_rank: int, local_world_size: int, local_rank: int) -> int:
    """Pack the parallel layout into LMCache's kv_rank integer.

    ``(world_size<<24) | (global_rank<<16) | (local_world_size<<8) | local_rank``;
    each part must fit in one byte.
    """
    parts = {
        "world_size": world_size,
        "global_rank": global_rank,
        "local_world_size": local_world_size,
        "local_rank": local_rank,
    }
    for name, value in parts.items():
        if not 0 <= value <= 0xFF:
            raise InvalidArgument(f"{name} must be in [0, 255], got {value}", field=name)
    if world_size < 1:
        raise InvalidArgument("world_size must be >= 1", field="world_size")
    if global_rank >= world_size:
        raise InvalidArgument(
            f"rank {global_rank} is outside world_size {world_size}", field="global_rank"
        )
    return (world_size << 24) | (global_rank << 16) | (local_world_size << 8) | local_rank


def worker_kv_rank(world_size: int, worker_id: int) -> int:
    """kv_rank of one worker in the MP layout (local == global)."""
    return pack_kv_rank(world_size, worker_id, world_size, worker_id)


def kv_rank_world_size(kv_rank: int) -> int:
    """World size packed into a kv_rank."""
    return (kv_rank >> 24) & 0xFF


@functools.lru_cache(maxsize=4096)
def _check_model_name(model_name: str) -> str | None:
    if not model_name:
        return "model_name must not be empty"
    if len(model_name) > MAX_MODEL_NAME_CHARS:
        return f"model_name is longer than {MAX_MODEL_NAME_CHARS} characters"
    if "@" in model_name:
        return f"model_name must not contain '@': {model_name!r}"
    if "\0" in model_name:
        return "model_name must not contain NUL"
    return None


@functools.lru_cache(maxsize=4096)
def _check_cache_salt(cache_salt: str) -> str | None:
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        return f"cache_salt is longer than {MAX_CACHE_SALT_CHARS} characters"
    bad = _FORBIDDEN_SALT_CHARS.intersection(cache_salt)
    if bad:
        shown = ", ".join(sorted(repr(c) for c in bad))
        return f"cache_salt must not contain {shown}"
    return None


def salt_with_lora(cache_salt: str, lora_name: str | None, lora_id: int | None) -> str:
    """The salt kvmesh keys carry for a request with a LoRA adapter.

    Different adapters never share KV, so the adapter is part of the salt:
    the vLLM connector writes keys this way, and the coordinator computes the
    same salt from an engine's KV events and from a score request.
    """
    if not lora_name:
        return cache_salt
    return f"{cache_salt}\x1flora:{lora_name}:{lora_id or 0}"


def validate_model_name(model_name: str, field: str = "model_name") -> None:
    """Raise InvalidArgument unless ``model_name`` is usable in a key."""
    problem = _check_model_name(model_name)
    if problem is not None:
        raise InvalidArgument(problem, field=field)


def validate_cache_salt(cache_salt: str, field: str = "cache_salt") -> None:
    """Raise InvalidArgument unless ``cache_salt`` is usable in a key."""
    problem = _check_cache_salt(cache_salt)
    if problem is not None:
        raise InvalidArgument(problem, field=field)


def validate_object_key(key: ObjectKey, field: str = "key") -> None:
    """Raise InvalidArgument naming ``field`` unless every key invariant holds."""
    if len(key.chunk_hash) != CHUNK_HASH_BYTES:
        raise InvalidArgument(
            f"{field}.chunk_hash must be {CHUNK_HASH_BYTES} bytes, got {len(key.chunk_hash)}",
            field=f"{field}.chunk_hash",
        )
    problem = _check_model_name(key.model_name)
    if problem is not None:
        raise InvalidArgument(f"{field}.{problem}", field=f"{field}.model_name")
    problem = _check_cache_salt(key.cache_salt)
    if problem is not None:
        raise InvalidArgument(f"{field}.{problem}", field=f"{field}.cache_salt")
    if not 0 <= key.kv_rank <= _UINT32_MAX:
        raise InvalidArgument(f"{field}.kv_rank out of range", field=f"{field}.kv_rank")
    if not 0 <= key.object_group_id <= _UINT32_MAX:
        raise InvalidArgument(
            f"{field}.object_group_id out of range", field=f"{field}.object_group_id"
        )


def validate_object_keys(keys: Sequence[ObjectKey], field: str = "keys") -> None:
    """Validate many keys; names shared by consecutive keys are checked once.

    The data path names 32+ keys per request that all share one model and
    salt: checking those strings once per request instead of once per key
    keeps validation off the latency budget. Errors name ``field[i]``.
    """
    last_names: tuple[str, str] | None = None
    for i, key in enumerate(keys):
        names = (key.model_name, key.cache_salt)
        if (
            names != last_names
            or len(key.chunk_hash) != CHUNK_HASH_BYTES
            or not 0 <= key.kv_rank <= _UINT32_MAX
            or not 0 <= key.object_group_id <= _UINT32_MAX
        ):
            validate_object_key(key, field=f"{field}[{i}]")
            last_names = names


def object_name(key: ObjectKey) -> str:
    """Stable, parseable name of a key for L2 backends (files, Redis keys, S3 objects).

    ``<model>@<kv_rank 08x>@<group x>@<hash hex>[@<salt>]`` — LMCache's naming,
    except that '%' and '/' in the model name are percent-encoded (LMCache
    writes '/' as '-SEP-', which makes models "a/b" and "a-SEP-b" collide).
    '@' cannot appear in a model name or salt, so the name splits back
    unambiguously.
    """
    model = key.model_name.replace("%", "%25").replace("/", "%2F")
    name = f"{model}@{key.kv_rank:08x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    if key.cache_salt:
        name += f"@{key.cache_salt}"
    return name


def _unquote_model(text: str) -> str:
    out = []
    i = 0
    while i < len(text):
        if text[i] == "%":
            code = text[i + 1 : i + 3]
            if code == "25":
                out.append("%")
            elif code == "2F":
                out.append("/")
            else:
                raise ValueError(f"bad escape in {text!r}")
            i += 3
        else:
            if text[i] == "/":
                raise ValueError(f"unescaped '/' in {text!r}")
            out.append(text[i])
            i += 1
    return "".join(out)


def parse_object_name(name: str) -> ObjectKey:
    """Inverse of :func:`object_name`; raises InvalidArgument on a foreign name."""
    parts = name.split("@")
    if len(parts) not in (4, 5):
        raise InvalidArgument(f"not a kvmesh object name: {name!r}", field="name")
    try:
        key = ObjectKey(
            chunk_hash=bytes.fromhex(parts[3]),
            model_name=_unquote_model(parts[0]),
            kv_rank=int(parts[1], 16),
            object_group_id=int(parts[2], 16),
            cache_salt=parts[4] if len(parts) == 5 else "",
        )
    except ValueError as exc:
        raise InvalidArgument(f"not a kvmesh object name: {name!r}", field="name") from exc
    validate_object_key(key, field="name")
    return key
