"""vLLM's KV events on the wire: decode what engines publish, encode what we re-publish.

vLLM (``--kv-events-config``) sends ZMQ multipart frames ``[topic, seq,
payload]``: ``seq`` is an 8-byte big-endian counter that starts at 0 with
the process, ``payload`` a msgpack array ``[ts, events, data_parallel_rank]``
whose events are msgpack maps tagged by ``"type"``:

- ``BlockStored``: ``block_hashes``, ``parent_block_hash`` (of the first
  block; nil for a prompt's first block), ``token_ids`` (every block's tokens,
  concatenated), ``block_size``, ``lora_id``, ``medium``, ``lora_name``,
  ``extra_keys`` (one entry per block: the LoRA name when ``lora_name`` is
  set, multimodal ``(identifier, offset)`` pairs, the cache salt, prompt
  embedding digests), ``group_idx`` and more fields this module ignores;
- ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
- ``AllBlocksCleared``.

Block hashes are ints (vLLM's default) or bytes; both are kept as they come.
Decoding never trusts the payload: anything malformed raises
:class:`EventFormatError` and the caller skips that batch. See
docs/routing.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]  # ships no type information

BlockHash = int | bytes

#: The replay socket's end-of-stream seq (-1, 8 bytes big-endian, signed).
END_SEQ = (-1).to_bytes(8, "big", signed=True)

#: Most tokens or hashes one event may carry (a sanity bound on untrusted input).
MAX_EVENT_ITEMS = 1 << 22


class EventFormatError(ValueError):
    """A frame or payload that is not a vLLM KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks an engine now holds, chained from ``parent``."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    #: Per block; None when the engine sent none.
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks an engine dropped from ``medium``."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole cache."""


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: a step's events of one data-parallel rank."""

    ts: float
    events: tuple[EngineEvent, ...]
    data_parallel_rank: int | None = None


def decode_seq(frame: bytes) -> int:
    """The seq of a frame (8 bytes, big-endian, signed so END_SEQ reads as -1)."""
    if len(frame) != 8:
        raise EventFormatError(f"seq frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """8-byte big-endian seq frame."""
    return seq.to_bytes(8, "big", signed=True)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack payload; raise EventFormatError on anything unexpected."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise EventFormatError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise EventFormatError("payload is not an array [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise EventFormatError("ts is not a number")
    if not isinstance(events, list):
        raise EventFormatError("events is not an array")
    if rank is not None and not _is_int(rank):
        raise EventFormatError("data_parallel_rank is not an integer")
    return EventBatch(float(ts), tuple(_decode_event(e) for e in events), rank)


def _decode_event(raw: Any) -> EngineEvent:
    if not isinstance(raw, dict):
        raise EventFormatError("an event is not a map")
    kind = raw.get("type")
    if kind == "BlockStored":
        hashes = _hashes(raw.get("block_hashes"))
        tokens = raw.get("token_ids")
        if not isinstance(tokens, list) or len(tokens) > MAX_EVENT_ITEMS:
            raise EventFormatError("BlockStored.token_ids is not an array")
        if not all(_is_int(t) and 0 <= t < 1 << 32 for t in tokens):
            raise EventFormatError("BlockStored.token_ids holds a value outside uint32")
        block_size = raw.get("block_size")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise EventFormatError("BlockStored.block_size is not a positive integer")
        parent = raw.get("parent_block_hash")
        if parent is not None:
            parent = _hash(parent)
        extra = raw.get("extra_keys")
        if extra is not None:
            if not isinstance(extra, list):
                raise EventFormatError("BlockStored.extra_keys is not an array")
            extra = tuple(tuple(e) if isinstance(e, list) else None for e in extra)
        return BlockStored(
            block_hashes=hashes,
            parent=parent,
            token_ids=tuple(tokens),
            block_size=block_size,
            medium=_opt_str(raw, "medium"),
            lora_name=_opt_str(raw, "lora_name"),
            lora_id=_opt_int(raw, "lora_id"),
            extra_keys=extra,
            group_idx=_opt_int(raw, "group_idx"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            _hashes(raw.get("block_hashes")),
            _opt_str(raw, "medium"),
            _opt_int(raw, "group_idx"),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventFormatError(f"unknown event type {kind!r}")


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload vLLM would publish for ``batch`` (fields at defaults omitted)."""
    events = [_encode_event(e) for e in batch.events]
    fields: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        fields.append(batch.data_parallel_rank)
    payload: bytes = msgpack.packb(fields, use_bin_type=True)
    return payload


def _encode_event(event: EngineEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = [list(e) if e is not None else None for e in event.extra_keys]
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes)}
        out["medium"] = event.medium
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    return {"type": "AllBlocksCleared"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hash(value: Any) -> BlockHash:
    if isinstance(value, bytes) and 0 < len(value) <= 64:
        return value
    if _is_int(value):
        return int(value)
    raise EventFormatError("a block hash is neither an integer nor 1-64 bytes")


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list) or not value or len(value) > MAX_EVENT_ITEMS:
        raise EventFormatError("block_hashes is not a non-empty array")
    return tuple(_hash(h) for h in value)


def _opt_str(raw: dict[str, Any], name: str) -> str | None:
    value = raw.get(name)
    if value is not None and not isinstance(value, str):
        raise EventFormatError(f"{name} is not a string")
    return value


def _opt_int(raw: dict[str, Any], name: str) -> int | None:
    value = raw.get(name)
    if value is not None and not _is_int(value):
        raise EventFormatError(f"{name} is not an integer")
    return value


def chain_salt(stored: BlockStored, first_block: int = 0) -> str | None:
    """The cache salt vLLM folded into a chain's first block, from ``extra_keys``.

    Returns "" when the block has no salt, and None when its extra keys hold
    something kvmesh's token hashing cannot reproduce (multimodal features,
    prompt embeddings): such a chain never matches a kvmesh key.
    """
    keys: Sequence[Any] | None = None
    if stored.extra_keys is not None and first_block < len(stored.extra_keys):
        keys = stored.extra_keys[first_block]
    if not keys:
        return ""
    items = list(keys)
    if stored.lora_name and items and items[0] == stored.lora_name:
        items = items[1:]
    if any(not isinstance(item, str) for item in items) or len(items) > 1:
        return None
    return items[0] if items else ""
