"""The directory's record codec: one ``bytes`` value per key, and the tables its ids point into.

A record is::

    f64 last_access | u32 access_count | n × (u32 identity id, u32 stream id, u64 size)

Identities ``(tier, backend, shared, owner)`` and reporter streams
``(instance_id, incarnation)`` are interned to small ints in
:class:`RecordTables`, so no per-key container object exists. Records are
immutable: every change makes a new value (and the keys a STORE creates
with one size share one record object).

A stream that was fenced is *dead*: its L1 placements read as absent from
that moment (:meth:`RecordTables.live`) until the sweep rewrites the
records. The per-stream L1 rollups let a fence settle usage and totals
without visiting a key (:meth:`RecordTables.retire`).

Not thread-safe: the directory's lock guards every table here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from kvmesh.common.events import Tier
from kvmesh.coordinator.core.types import Placement

#: Record header: last access time, access count.
HDR = struct.Struct("<dI")
#: One placement: identity id, stream id, size in bytes.
PL = struct.Struct("<IIQ")
#: A whole record with exactly one placement (the common case, unpacked in one call).
ONE = struct.Struct("<dIIIQ")
HDR_SIZE = HDR.size
PL_SIZE = PL.size
ONE_SIZE = ONE.size

PlacementRow = tuple[int, int, int]
"""``(identity id, stream id, size)`` of one placement."""


class PlacementIdentity(NamedTuple):
    """What a placement is matched by: owner is ``""`` for a shared pool."""

    tier: Tier
    backend: str
    shared: bool
    owner: str


def encode(la: float, cnt: int, pls: Iterable[PlacementRow]) -> bytes:
    """A record of header ``(la, cnt)`` and placements ``pls``."""
    return HDR.pack(la, cnt) + b"".join(PL.pack(*p) for p in pls)


class RecordTables:
    """Interned identities and reporter streams, fenced streams and per-stream L1 rollups."""

    def __init__(self) -> None:
        self.pids: list[PlacementIdentity] = []
        self.pid_ids: dict[PlacementIdentity, int] = {}
        self.pid_l1: list[bool] = []
        self.streams: list[tuple[str, int]] = []
        self.stream_ids: dict[tuple[str, int], int] = {}
        self.instance_streams: dict[str, set[int]] = {}
        self.shared_reporters: dict[int, dict[str, None]] = {}
        # Lazy fencing: dead (retired) streams, and per-stream L1 rollups
        # that let a fence settle usage and totals without visiting keys.
        self.dead: set[int] = set()
        self.l1_roll: dict[int, dict[tuple[int, int], int]] = {}
        self.l1_cnt: dict[int, int] = {}

    # -- interning ---------------------------------------------------------

    def intern_pid(self, ident: PlacementIdentity) -> int:
        """The id of ``ident``, allocated on first use."""
        pid = self.pid_ids.get(ident)
        if pid is None:
            pid = len(self.pids)
            self.pids.append(ident)
            self.pid_l1.append(ident.tier == Tier.L1)
            self.pid_ids[ident] = pid
        return pid

    def intern_stream(self, instance_id: str, incarnation: int) -> int:
        """The live stream id of ``(instance_id, incarnation)``, allocated on first use."""
        skey = (instance_id, incarnation)
        stream = self.stream_ids.get(skey)
        if stream is None:
            stream = len(self.streams)
            self.streams.append(skey)
            self.stream_ids[skey] = stream
            self.instance_streams.setdefault(instance_id, set()).add(stream)
        return stream

    # -- decoding ----------------------------------------------------------

    def live(self, v: bytes) -> list[PlacementRow]:
        """``(identity, stream, size)`` of the record's placements that are not fenced."""
        dead = self.dead
        pid_l1 = self.pid_l1
        out = []
        for off in range(HDR_SIZE, len(v), PL_SIZE):
            p = PL.unpack_from(v, off)
            if dead and pid_l1[p[0]] and p[1] in dead:
                continue
            out.append(p)
        return out

    def visible(self, v: bytes | None) -> bytes | None:
        """``v`` unless it is missing or holds only fenced placements."""
        if not v or not self.dead:
            return v
        return v if self.live(v) else None

    def placements(self, v: bytes) -> tuple[Placement, ...]:
        """The record's live placements, sorted by (instance, tier, backend)."""
        pids = self.pids
        streams = self.streams
        out: list[Placement] = []
        for pid, stream, size in self.live(v):
            tier, backend, shared, _owner = pids[pid]
            inst, inc = streams[stream]
            out.append(Placement(inst, inc, tier, backend, size, shared))
        if len(out) > 1:
            out.sort(key=lambda p: (p.instance_id, p.tier, p.backend))
        return tuple(out)

    def tier_bytes(self, v: bytes, tier: Tier) -> int:
        """Bytes of the record's live placements on ``tier``."""
        pids = self.pids
        return sum(size for pid, _s, size in self.live(v) if pids[pid].tier == tier)

    def holds(self, v: bytes | None, tier: Tier) -> bool:
        """True when the record has a live placement on ``tier``."""
        if not v:
            return False
        pids = self.pids
        return any(pids[pid].tier == tier for pid, _s, _z in self.live(v))

    def reports_l1(self, instance_id: str, v: bytes) -> bool:
        """True when one of ``instance_id``'s streams holds a live L1 placement of the record."""
        streams = self.instance_streams.get(instance_id, set())
        pid_l1 = self.pid_l1
        return any(pid_l1[opid] and ostream in streams for opid, ostream, _ in self.live(v))

    def delete_targets(
        self, v: bytes, tier: Tier, is_live: Callable[[str], bool]
    ) -> list[tuple[str, str]]:
        """``(instance_id, backend)`` per live placement on ``tier`` (see the directory's)."""
        out: list[tuple[str, str]] = []
        for pid, stream, _size in self.live(v):
            ident = self.pids[pid]
            if ident.tier != tier:
                continue
            if not ident.shared:
                if is_live(ident.owner):
                    out.append((ident.owner, ident.backend))
                continue
            reporter = self.streams[stream][0]
            if is_live(reporter):
                out.append((reporter, ident.backend))
                continue
            for other in self.shared_reporters.get(pid, {}):
                if is_live(other):
                    out.append((other, ident.backend))
                    break
        return out

    # -- rewriting ---------------------------------------------------------

    def upsert(
        self, v: bytes, ts: float, pid: int, stream: int, size: int
    ) -> tuple[bytes, int, int, int, int]:
        """Upsert placement ``pid`` into a record with several placements.

        Returns (new value, byte delta, 1 if a placement was added, the live
        stream the placement was taken over from or -1, that placement's size)
        as a plain tuple (called per key). Fenced placements are dropped while
        the record is rewritten anyway.
        """
        la, cnt = HDR.unpack_from(v)
        pls = self.live(v)
        if not pls:  # only fenced placements: a fresh record
            la, cnt = ts, 0
        elif la < ts:
            la = ts
        for i, (opid, ostream, osize) in enumerate(pls):
            if opid == pid:
                pls[i] = (pid, stream, size)
                moved = ostream if ostream != stream else -1
                return encode(la, cnt, pls), size - osize, 0, moved, osize
        pls.append((pid, stream, size))
        return encode(la, cnt, pls), size, 1, -1, 0

    def without(self, v: bytes, pid: int) -> tuple[bytes, int, int] | None:
        """Record minus live placement ``pid``: (new value, b"" if emptied; its stream; size)."""
        pls = self.live(v)
        for i, (opid, ostream, osize) in enumerate(pls):
            if opid == pid:
                del pls[i]
                la, cnt = HDR.unpack_from(v)
                rest = encode(la, cnt, pls) if pls else b""
                return rest, ostream, osize
        return None

    # -- fencing -------------------------------------------------------------

    def roll_l1(self, stream: int, pid: int, sid: int, nbytes: int, count: int) -> None:
        """Adjust the per-stream L1 rollup (what a fence of that stream will subtract)."""
        roll = self.l1_roll.get(stream)
        if roll is None:
            roll = self.l1_roll[stream] = {}
        k = (pid, sid)
        new = roll.get(k, 0) + nbytes
        if new:
            roll[k] = new
        else:
            roll.pop(k, None)
        self.l1_cnt[stream] = self.l1_cnt.get(stream, 0) + count

    def live_streams(self, instance_id: str) -> list[int]:
        """``instance_id``'s streams that are not fenced yet."""
        return [s for s in self.instance_streams.get(instance_id, ()) if s not in self.dead]

    def retire(self, streams: Iterable[int]) -> tuple[dict[tuple[int, int], int], int, int]:
        """Mark ``streams`` dead; ``(usage deltas by (identity, space), placements, bytes)`` freed.

        A retired id is never handed out again: a later batch of the same
        ``(instance, incarnation)`` — e.g. after a timeout drop — gets a new one.
        """
        deltas: dict[tuple[int, int], int] = {}
        removed = freed = 0
        for s in streams:
            self.stream_ids.pop(self.streams[s], None)
            self.dead.add(s)
            for k, b in self.l1_roll.pop(s, {}).items():
                deltas[k] = deltas.get(k, 0) - b
                freed += b
            removed += self.l1_cnt.pop(s, 0)
        return deltas, removed, freed

    # -- durable form ----------------------------------------------------------

    def capture(self) -> dict[str, object]:
        """The tables' part of the directory's capture (plain data)."""
        return {
            "identities": [[int(p.tier), p.backend, p.shared, p.owner] for p in self.pids],
            "streams": [[iid, inc] for iid, inc in self.streams],
            "dead_streams": sorted(self.dead),
            "shared_reporters": [
                [pid, list(insts)] for pid, insts in self.shared_reporters.items()
            ],
        }

    @classmethod
    def from_capture(cls, state: Mapping[str, Any]) -> RecordTables:
        """Tables of a capture, without rollups (the restore recomputes them from the records)."""
        tables = cls()
        for row in state["identities"]:
            tier_v, backend, shared, owner = row
            if tier_v not in (Tier.L1, Tier.L2):
                raise ValueError(f"placement tier {tier_v!r} is not l1/l2")
            tables.pids.append(
                PlacementIdentity(Tier(tier_v), str(backend), bool(shared), str(owner))
            )
        tables.pid_ids = {p: i for i, p in enumerate(tables.pids)}
        tables.pid_l1 = [p.tier == Tier.L1 for p in tables.pids]
        tables.streams = [(str(iid), int(inc)) for iid, inc in state["streams"]]
        tables.dead = {int(x) for x in state.get("dead_streams", [])}
        tables.stream_ids = {s: i for i, s in enumerate(tables.streams) if i not in tables.dead}
        for i, (iid, _inc) in enumerate(tables.streams):
            tables.instance_streams.setdefault(iid, set()).add(i)
        for pid, insts in state.get("shared_reporters", []):
            tables.shared_reporters[int(pid)] = dict.fromkeys(str(x) for x in insts)
        return tables
