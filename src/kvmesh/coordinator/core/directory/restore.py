"""Rebuilding the directory from a capture, aside from the live one.

Everything a capture does not store is recomputed from the records: the L1
reverse index, per-tier totals, per-stream L1 rollups and the usage deltas.
Placements of streams that were dead at capture time (fenced, not yet
swept) are dropped here. The result is swapped in by
:meth:`KeyDirectory.restore` only once it is complete, so a bad section
leaves the directory untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.coordinator.core.keyspace import SPACE_BYTES, KeySpaces, space_id_of

from .bindings import TokenBindings
from .l1index import INDEX_SHIFT, IndexShards
from .records import HDR, HDR_SIZE, ONE_SIZE, PL, PL_SIZE, PlacementRow, RecordTables, encode
from .shards import MASK, NUM_SHARDS


@dataclass
class Rebuilt:
    """A directory's state rebuilt from a capture, ready to be swapped in."""

    tables: RecordTables
    shards: list[dict[bytes, bytes]] = field(
        default_factory=lambda: [{} for _ in range(NUM_SHARDS)]
    )
    index: dict[str, IndexShards] = field(default_factory=dict)
    num_keys: int = 0
    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    nbytes: list[int] = field(default_factory=lambda: [0, 0, 0])
    deltas: dict[tuple[int, int], int] = field(default_factory=dict)
    """Usage to apply: bytes by (identity, space)."""
    bindings: dict[bytes, tuple[int, bytes]] = field(default_factory=dict)
    """Captured bindings: ``{chunk_hash: (offset, tokens)}``."""
    refs: dict[bytes, list[bytes]] = field(default_factory=dict)
    """Restored keys of each captured binding."""


def rebuild(state: object, spaces: KeySpaces) -> Rebuilt:
    """The state of a ``key_directory`` capture (ValueError / TypeError when malformed)."""
    if not isinstance(state, Mapping) or state.get("format") != 1:
        raise ValueError("key_directory state is not a format-1 mapping")
    st: Mapping[str, Any] = state
    table = st["spaces"]
    mapping = spaces.translation(table)
    tables = RecordTables.from_capture(st)
    out = Rebuilt(tables)
    out.index = {iid: {} for iid in tables.instance_streams}
    out.bindings = TokenBindings.captured(st["bindings"])
    pids, streams, dead, pid_l1 = tables.pids, tables.streams, tables.dead, tables.pid_l1
    n_pids, n_streams, n_spaces = len(pids), len(streams), len(table)
    count, nbytes, deltas = out.count, out.nbytes, out.deltas
    l1_roll, l1_cnt, index = tables.l1_roll, tables.l1_cnt, out.index
    shards, captured, refs = out.shards, out.bindings, out.refs
    retranslate = spaces.retranslate
    num_keys = 0
    for shard in st["shards"]:
        if not isinstance(shard, Mapping):
            raise TypeError("key_directory shard is not a mapping")
        for raw_ck, raw_v in shard.items():
            if not isinstance(raw_ck, bytes) or not isinstance(raw_v, bytes):
                raise TypeError("key_directory record is not bytes")
            v = raw_v
            if len(v) < ONE_SIZE or (len(v) - HDR_SIZE) % PL_SIZE:
                raise ValueError(f"key_directory record of {len(v)} bytes is malformed")
            ck = retranslate(raw_ck, mapping, n_spaces)
            si = hash(ck) & MASK
            sid = space_id_of(ck)
            live: list[PlacementRow] = []
            for off in range(HDR_SIZE, len(v), PL_SIZE):
                pid, stream, size = PL.unpack_from(v, off)
                if pid >= n_pids or stream >= n_streams:
                    raise ValueError("key_directory record refers to an unknown id")
                if pid_l1[pid] and stream in dead:
                    continue  # fenced before the capture, not yet swept
                live.append((pid, stream, size))
                tier = pids[pid].tier
                count[tier] += 1
                nbytes[tier] += size
                if size:
                    deltas[(pid, sid)] = deltas.get((pid, sid), 0) + size
                if pid_l1[pid]:
                    ish = index[streams[stream][0]].setdefault(si >> INDEX_SHIFT, {})
                    ish[ck] = None
                    roll = l1_roll.setdefault(stream, {})
                    roll[(pid, sid)] = roll.get((pid, sid), 0) + size
                    l1_cnt[stream] = l1_cnt.get(stream, 0) + 1
            if not live:
                continue
            if len(live) * PL_SIZE != len(v) - HDR_SIZE:
                la, cnt = HDR.unpack_from(v)
                v = encode(la, cnt, live)
            shards[si][ck] = v
            num_keys += 1
            h = ck[:-SPACE_BYTES]
            if h in captured:
                refs.setdefault(h, []).append(ck)
    out.num_keys = num_keys
    return out
