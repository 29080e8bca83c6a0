"""KeyDirectory: key → placements, with an L1 reverse index and token bindings (reference §4.1).

Behaviour follows LMCache 0.5.6: a placement's identity is ``(instance,
tier, backend)`` when private and ``(tier, backend)`` fleet-wide when
shared; a STORE upserts by identity (a shared placement records its *last*
reporter and that reporter's incarnation), a DELETE removes by identity and
drops an emptied record, an ACCESS refreshes ``last_access`` and counts one
use per entry without ever creating a record, and ``fence_instance`` removes
exactly the L1 placements whose recorded reporter is the fenced instance
(L2 always survives, a shared L1 placement re-reported by someone else
survives). Lookups are exact-key; token lookups are resolved by the caller.

Storage — designed for ten million keys without GC or resize stalls:

* Keys are compact ``bytes`` (``chunk_hash || u32 space id``, see
  :mod:`.keyspace`). A record is one ``bytes`` value::

      f64 last_access | u32 access_count | n × (u32 identity id, u32 stream id, u64 size)

  Identities ``(tier, backend, shared, owner)`` and reporter streams
  ``(instance_id, incarnation)`` are interned to small ints. No per-key
  container object exists, so every big dict holds only untracked objects
  and stays untracked by the cyclic GC: a full collection costs the same at
  ten keys or ten million. Records are immutable, so the keys a STORE
  creates with one size share one record object (about 80 bytes per key
  saved) until one of them changes.
* A STORE of fresh keys of one key space and one size (what storage nodes
  send), with no token bindings in play, is applied in bulk: each step is a
  C-level ``map`` over the batch instead of a Python loop per key. Any other
  batch goes key by key; both give the same result.
* The key space is split into 4096 dicts by ``hash(ck)``. One huge dict
  stalls for seconds when it resizes (measured: 1.5 s at 5.6 M keys here,
  mostly first-touch page faults); a shard of ~2.5 k keys resizes in
  microseconds.
* Shards are copy-on-write for checkpoints: ``capture()`` hands out the live
  shard dicts and marks them frozen; the first later write to a frozen shard
  replaces it with a copy. Capture is O(shards), not O(keys), so the quiesce
  stays short, and the copying cost is spread over later batches.
* The L1 reverse index is, per instance, 256 small dicts ``ck → None``;
  the clean-up after a fence visits only that instance's keys.
* Fencing never stalls ingest. ``fence_instance`` retires the instance's
  reporter streams (a later batch of the same ``(instance, incarnation)``,
  e.g. after a heartbeat-timeout drop, gets a fresh stream id) and marks
  them dead; every reader treats an L1 placement of a dead stream as absent
  from that moment, and usage, per-tier totals and the instance's L1 index
  are settled at once from per-stream L1 rollups (O(streams), not O(keys)).
  Rewriting the affected records — dropping dead placements and emptied
  keys — is then drained in bounded slices: a few hundred keys after each
  batch plus :meth:`KeyDirectory.reclaim_fenced` from a background timer.
  Small fences (≤ ``fence_sync_keys`` keys) are drained at once, so
  ``num_keys`` is exact for them; during a large drain ``num_keys`` still
  counts the keys left in ``fence_backlog_keys``.
* Token bindings (the chunk's tokens, 4 bytes per token: ~1 KiB per 256-token
  chunk, which would dominate memory at ten million keys) are kept for at
  most ``token_binding_cap`` chunk hashes (0 disables them); beyond the cap
  the oldest eighth is dropped in one sweep. A binding lists the keys that
  were stored while it existed and is dropped when the last of those leaves.
  Bindings are hints: a dropped one only makes lookups return no tokens.
* Per-tier counts and bytes are running totals, so ``stats()`` never walks
  keys.

Usage accounting: while applying a batch or a fence, the directory reports
the byte changes it made to the :class:`CacheUsageManager` (see
:mod:`.usage`), so directory and usage can never disagree. In particular a
shared L1 placement fenced here is un-counted there too (LMCache's usage
view never fenced shared L1; reference §12.2).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import logging
import operator
import os
import struct
import sys
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import CacheEventBatch, CacheEventEntry, EventType, Tier
from kvmesh.common.keys import ObjectKey

from .keyspace import SHARD_BITS, SPACE_BYTES, EncodedBatch, KeySpaces, columnar, space_id_of
from .persistence import PersistenceType
from .types import DirectoryStats, KeyInfo, KeyPage, Placement, TierTotals
from .usage import CacheUsageManager, UsageDelta

logger = logging.getLogger(__name__)

_HDR = struct.Struct("<dI")
_PL = struct.Struct("<IIQ")
_ONE = struct.Struct("<dIIIQ")
_HDR_SIZE = _HDR.size
_PL_SIZE = _PL.size
_ONE_SIZE = _ONE.size
_U32 = struct.Struct("<I")

NUM_SHARDS = 1 << SHARD_BITS
_MASK = NUM_SHARDS - 1
_INDEX_SHIFT = 4  # 256 reverse-index shards per instance
DEFAULT_TOKEN_BINDING_CAP = 65_536
DEFAULT_FENCE_SYNC_KEYS = 4096
DEFAULT_RECLAIM_PER_BATCH = 256
DEFAULT_LIST_LIMIT = 1000
MAX_LIST_LIMIT = 10_000
_PAGE_TOKEN_VERSION = 1
_PAGE_HEAD = struct.Struct("<B4sH")
_BIG_ENDIAN = sys.byteorder == "big"
_TOKENS = operator.itemgetter(2)
_SIZES = operator.itemgetter(1)
# Runs a map() of dict.__setitem__ to the end in C (a maxlen-0 deque keeps nothing).
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend


class PlacementIdentity(NamedTuple):
    """What a placement is matched by: owner is ``""`` for a shared pool."""

    tier: Tier
    backend: str
    shared: bool
    owner: str


_Binding = tuple[bytes, int, tuple[bytes, ...]]
"""(little-endian uint32 tokens, token_offset, compact keys referencing it)."""


def _tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("I", tokens)
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI machine
        arr.byteswap()
    return arr.tobytes()


def _bytes_to_tokens(raw: bytes) -> tuple[int, ...]:
    arr = array("I")
    arr.frombytes(raw)
    if _BIG_ENDIAN:  # pragma: no cover
        arr.byteswap()
    return tuple(arr)


class KeyDirectory:
    """Where every key lives in the fleet, as a cache-event consumer."""

    name = "key_directory"
    persistence_type = PersistenceType.CHECKPOINT

    def __init__(
        self,
        spaces: KeySpaces,
        usage: CacheUsageManager | None = None,
        *,
        token_binding_cap: int = DEFAULT_TOKEN_BINDING_CAP,
        fence_sync_keys: int = DEFAULT_FENCE_SYNC_KEYS,
        reclaim_per_batch: int = DEFAULT_RECLAIM_PER_BATCH,
    ) -> None:
        if token_binding_cap < 0:
            raise ValueError("token_binding_cap must be >= 0")
        self._spaces = spaces
        self._usage = usage if usage is not None else CacheUsageManager()
        self._lock = threading.Lock()
        self._shards: list[dict[bytes, bytes]] = [{} for _ in range(NUM_SHARDS)]
        self._frozen = bytearray(NUM_SHARDS)
        self._num_keys = 0
        # Running totals indexed by int(Tier): [unused, L1, L2].
        self._count = [0, 0, 0]
        self._bytes = [0, 0, 0]
        self._pids: list[PlacementIdentity] = []
        self._pid_ids: dict[PlacementIdentity, int] = {}
        self._pid_l1: list[bool] = []
        self._streams: list[tuple[str, int]] = []
        self._stream_ids: dict[tuple[str, int], int] = {}
        self._instance_streams: dict[str, set[int]] = {}
        self._shared_reporters: dict[int, dict[str, None]] = {}
        self._l1_index: dict[str, dict[int, dict[bytes, None]]] = {}
        # Lazy fencing: dead (retired) streams, per-stream L1 rollups that let
        # a fence settle usage and totals without visiting keys, and the
        # detached reverse indexes still to be swept.
        self._dead: set[int] = set()
        self._l1_roll: dict[int, dict[tuple[int, int], int]] = {}
        self._l1_cnt: dict[int, int] = {}
        # Each item: the detached index shards of one fence, consumed with
        # popitem() so the keys' memory is freed slice by slice too.
        self._backlog: deque[list[dict[bytes, None]]] = deque()
        self._backlog_keys = 0
        self._fence_sync_keys = fence_sync_keys
        self._reclaim_per_batch = reclaim_per_batch
        self._bindings: dict[bytes, _Binding] = {}
        self._binding_cap = token_binding_cap
        self.bindings_dropped = 0
        self._restored = False
        self._capture_holds = 0
        self._epoch = os.urandom(4)

    @property
    def usage(self) -> CacheUsageManager:
        """The usage view this directory feeds."""
        return self._usage

    @property
    def spaces(self) -> KeySpaces:
        """The key-space codec shared with the other consumers."""
        return self._spaces

    # -- interning ---------------------------------------------------------

    def _intern_pid(self, ident: PlacementIdentity) -> int:
        pid = self._pid_ids.get(ident)
        if pid is None:
            pid = len(self._pids)
            self._pids.append(ident)
            self._pid_l1.append(ident.tier == Tier.L1)
            self._pid_ids[ident] = pid
        return pid

    def _intern_stream(self, instance_id: str, incarnation: int) -> int:
        skey = (instance_id, incarnation)
        stream = self._stream_ids.get(skey)
        if stream is None:
            stream = len(self._streams)
            self._streams.append(skey)
            self._stream_ids[skey] = stream
            self._instance_streams.setdefault(instance_id, set()).add(stream)
        return stream

    def _thaw(self, si: int) -> dict[bytes, bytes]:
        """Replace frozen shard ``si`` (shared with a capture) by a private copy."""
        shard = self._shards[si].copy()
        self._shards[si] = shard
        self._frozen[si] = 0
        return shard

    def _live(self, v: bytes) -> list[tuple[int, int, int]]:
        """``(identity, stream, size)`` of the record's placements that are not fenced."""
        dead = self._dead
        pid_l1 = self._pid_l1
        out = []
        for off in range(_HDR_SIZE, len(v), _PL_SIZE):
            p = _PL.unpack_from(v, off)
            if dead and pid_l1[p[0]] and p[1] in dead:
                continue
            out.append(p)
        return out

    def _visible(self, v: bytes | None) -> bytes | None:
        """``v`` unless it is missing or holds only fenced placements."""
        if not v or not self._dead:
            return v
        return v if self._live(v) else None

    @staticmethod
    def _encode(la: float, cnt: int, pls: Iterable[tuple[int, int, int]]) -> bytes:
        return _HDR.pack(la, cnt) + b"".join(_PL.pack(*p) for p in pls)

    def _roll_l1(self, stream: int, pid: int, sid: int, nbytes: int, count: int) -> None:
        """Adjust the per-stream L1 rollup (what a fence of that stream will subtract)."""
        roll = self._l1_roll.get(stream)
        if roll is None:
            roll = self._l1_roll[stream] = {}
        k = (pid, sid)
        new = roll.get(k, 0) + nbytes
        if new:
            roll[k] = new
        else:
            roll.pop(k, None)
        self._l1_cnt[stream] = self._l1_cnt.get(stream, 0) + count

    # -- consumer ----------------------------------------------------------

    def consume(self, batch: CacheEventBatch) -> None:
        """Apply one admitted batch (STORE, DELETE, ACCESS; CONFIG only registers the reporter)."""
        et = batch.event_type
        encoded = self._spaces.encode_batch(batch)
        with self._lock:
            if batch.instance_id not in self._l1_index:
                self._l1_index[batch.instance_id] = {}
            cks = encoded.cks
            if cks:
                if et == EventType.STORE:
                    self._apply_store(batch, encoded)
                elif et == EventType.DELETE:
                    self._apply_delete(batch, cks, encoded.sids)
                elif et == EventType.ACCESS:
                    self._apply_access(batch, cks)
            if self._backlog:
                self._reclaim_locked(self._reclaim_per_batch)

    def _apply_store(self, batch: CacheEventBatch, encoded: EncodedBatch) -> None:
        iid = batch.instance_id
        tier = batch.tier
        pid = self._intern_pid(
            PlacementIdentity(tier, batch.backend, batch.shared, "" if batch.shared else iid)
        )
        stream = self._intern_stream(iid, batch.incarnation)
        if batch.shared:
            self._shared_reporters.setdefault(pid, {})[iid] = None
        is_l1 = tier == Tier.L1
        idx = self._l1_index[iid] if is_l1 else None
        entries = batch.entries
        cols = columnar(entries)
        bindings = self._bindings if self._binding_cap > 0 else None
        # One C-level pass tells whether any entry carries tokens, so the
        # common token-less batch skips the per-entry check.
        if cols is not None:
            one_size: int | None = cols.template.size_bytes
            with_tokens = bindings is not None and bool(cols.template.token_ids)
        else:
            sizes = list(map(_SIZES, entries))
            one_size = sizes[0] if sizes.count(sizes[0]) == len(sizes) else None
            with_tokens = bindings is not None and any(map(len, map(_TOKENS, entries)))
        ts = float(batch.ts)
        # Every new record of this batch is prefix + u64 size. Records are
        # immutable, so the new keys of one size share one record object.
        prefix = _ONE.pack(ts, 0, pid, stream, 0)[: _ONE_SIZE - 8]
        if (
            one_size is not None
            and encoded.sid >= 0
            and not with_tokens
            and not bindings
            and encoded.unique
            and self._store_new_keys(encoded, prefix + one_size.to_bytes(8, "little"), idx)
        ):
            n = len(encoded.cks)
            delta = n * one_size
            self._num_keys += n
            self._count[tier] += n
            self._bytes[tier] += delta
            if is_l1:
                if delta:
                    self._roll_l1(stream, pid, encoded.sid, delta, 0)
                self._l1_cnt[stream] = self._l1_cnt.get(stream, 0) + n
            if delta:
                self._emit_usage({(pid, encoded.sid): delta})
            return
        self._store_each(batch, encoded, pid, stream, prefix, idx, with_tokens)

    def _store_new_keys(
        self, encoded: EncodedBatch, record: bytes, idx: dict[int, dict[bytes, None]] | None
    ) -> bool:
        """Insert every key of ``encoded`` with ``record`` if none exists yet; False if one does.

        The bulk path of the common batch (fresh keys of one space and one
        size, no token bindings): each step is a C-level pass over the
        batch instead of a Python loop per key. No key is touched when it
        returns False (frozen shards may have been copied, which only
        anticipates the copy-on-write of the per-key path).
        """
        cks = encoded.cks
        sis = encoded.shards
        shards = self._shards
        if 1 in self._frozen:  # a capture holds some shards: copy the ones written
            frozen = self._frozen
            for si in set(sis):
                if frozen[si]:
                    self._thaw(si)
        dicts = list(map(shards.__getitem__, sis))
        n = len(cks)
        # One probe per key inserts the fresh ones; ``record`` is new, so a key
        # that existed is one whose value is not that very object.
        found = list(map(dict.setdefault, dicts, cks, itertools.repeat(record, n)))
        inserted = list(map(operator.is_, found, itertools.repeat(record, n))).count(True)
        if inserted != n:
            if inserted:  # some existed: undo, so the per-key path starts from the same state
                for d, ck, v in zip(dicts, cks, found, strict=True):
                    if v is record:
                        del d[ck]
            return False
        if idx is not None:
            get = idx.get
            index_shards = []
            for si in sis:
                ish = get(si >> _INDEX_SHIFT)
                if ish is None:
                    ish = idx[si >> _INDEX_SHIFT] = {}
                index_shards.append(ish)
            _consume(map(dict.__setitem__, index_shards, cks, itertools.repeat(None, n)))
        return True

    def _store_each(
        self,
        batch: CacheEventBatch,
        encoded: EncodedBatch,
        pid: int,
        stream: int,
        prefix: bytes,
        idx: dict[int, dict[bytes, None]] | None,
        with_tokens: bool,
    ) -> None:
        """Upsert entry by entry (keys that exist, several spaces or sizes, token bindings)."""
        cks = encoded.cks
        sids = encoded.sids
        tier = batch.tier
        is_l1 = idx is not None
        shards = self._shards
        frozen = self._frozen
        dead = self._dead
        pid_l1 = self._pid_l1
        bindings = self._bindings if self._binding_cap > 0 else None
        unpack = _ONE.unpack
        pack = _ONE.pack
        ts = float(batch.ts)
        last_size = -1
        record = b""
        sdelta: dict[int, int] = {}
        run_sid = -1
        run = 0
        new_keys = added = 0
        # L1 placements taken over from another live stream: (old stream, sid, size).
        moves: list[tuple[int, int, int]] = []
        try:
            for ck, entry, sid in zip(cks, batch.entries, sids, strict=True):
                si = hash(ck) & _MASK
                sh = self._thaw(si) if frozen[si] else shards[si]
                v = sh.get(ck)
                size = entry[1]
                if v is None:
                    if size != last_size:
                        record = prefix + size.to_bytes(8, "little")
                        last_size = size
                    sh[ck] = record
                    new_keys += 1
                    added += 1
                    d = size
                    if bindings:
                        self._attach_binding(entry[0][0], ck)
                elif len(v) == _ONE_SIZE:
                    la, cnt, opid, ostream, osize = unpack(v)
                    if dead and pid_l1[opid] and ostream in dead:
                        # The only placement was fenced: start the record afresh.
                        sh[ck] = pack(ts, 0, pid, stream, size)
                        added += 1
                        d = size
                    else:
                        if la < ts:  # noqa: PLR1730 - hot loop: a compare beats a max() call
                            la = ts
                        if opid != pid:
                            sh[ck] = pack(la, cnt, opid, ostream, osize) + _PL.pack(
                                pid, stream, size
                            )
                            added += 1
                            d = size
                        else:
                            sh[ck] = pack(la, cnt, pid, stream, size)
                            d = size - osize
                            if ostream != stream and is_l1:
                                moves.append((ostream, sid, osize))
                else:
                    sh[ck], d, grew, moved_from, osize = self._store_multi(v, ts, pid, stream, size)
                    added += grew
                    if moved_from >= 0 and is_l1:
                        moves.append((moved_from, sid, osize))
                if d:
                    if sid != run_sid:
                        if run:
                            sdelta[run_sid] = sdelta.get(run_sid, 0) + run
                        run_sid = sid
                        run = 0
                    run += d
                if idx is not None:
                    ish = idx.get(si >> _INDEX_SHIFT)
                    if ish is None:
                        ish = idx[si >> _INDEX_SHIFT] = {}
                    ish[ck] = None
                if with_tokens and len(entry[2]):
                    self._fill_binding(entry, ck)
        finally:
            if run:
                sdelta[run_sid] = sdelta.get(run_sid, 0) + run
            self._num_keys += new_keys
            self._count[tier] += added
            self._bytes[tier] += sum(sdelta.values())
            if is_l1:
                # The batch's stream gains what it added; a placement taken
                # over from another live stream moves between the two.
                for sid, d in sdelta.items():
                    self._roll_l1(stream, pid, sid, d, 0)
                self._l1_cnt[stream] = self._l1_cnt.get(stream, 0) + added
                for ostream, sid, osize in moves:
                    self._roll_l1(ostream, pid, sid, -osize, -1)
                    self._roll_l1(stream, pid, sid, osize, 1)
            self._emit_usage({(pid, sid): d for sid, d in sdelta.items()})

    def _store_multi(
        self, v: bytes, ts: float, pid: int, stream: int, size: int
    ) -> tuple[bytes, int, int, int, int]:
        """Upsert into a record with several placements.

        Returns (new value, byte delta, 1 if a placement was added, the live
        stream the placement was taken over from or -1, that placement's size).
        Fenced placements are dropped while the record is rewritten anyway.
        """
        la, cnt = _HDR.unpack_from(v)
        pls = self._live(v)
        if not pls:  # only fenced placements: a fresh record
            la, cnt = ts, 0
        elif la < ts:
            la = ts
        for i, (opid, ostream, osize) in enumerate(pls):
            if opid == pid:
                pls[i] = (pid, stream, size)
                moved = ostream if ostream != stream else -1
                return self._encode(la, cnt, pls), size - osize, 0, moved, osize
        pls.append((pid, stream, size))
        return self._encode(la, cnt, pls), size, 1, -1, 0

    def _apply_delete(self, batch: CacheEventBatch, cks: list[bytes], sids: list[int]) -> None:
        iid = batch.instance_id
        tier = batch.tier
        pid = self._pid_ids.get(
            PlacementIdentity(tier, batch.backend, batch.shared, "" if batch.shared else iid)
        )
        if pid is None:  # nothing was ever stored under this identity
            return
        is_l1 = tier == Tier.L1
        shards = self._shards
        frozen = self._frozen
        dead = self._dead
        bindings = self._bindings
        sdelta: dict[int, int] = {}
        removed_keys = removed = 0
        gone: list[tuple[int, int, int]] = []  # L1: (stream, sid, size) removed
        try:
            for ck, sid in zip(cks, sids, strict=True):
                si = hash(ck) & _MASK
                v = shards[si].get(ck)
                if v is None:
                    continue
                if len(v) == _ONE_SIZE:
                    _la, _cnt, opid, ostream, osize = _ONE.unpack(v)
                    if opid != pid or (is_l1 and dead and ostream in dead):
                        continue  # not ours, or already fenced (the sweep removes it)
                    sh = shards[si] if not frozen[si] else self._thaw(si)
                    del sh[ck]
                    remaining = b""
                    removed_keys += 1
                else:
                    found = self._without(v, pid)
                    if found is None:
                        continue
                    remaining, ostream, osize = found
                    sh = shards[si] if not frozen[si] else self._thaw(si)
                    if remaining:
                        sh[ck] = remaining
                    else:
                        del sh[ck]
                        removed_keys += 1
                removed += 1
                if osize:
                    sdelta[sid] = sdelta.get(sid, 0) - osize
                if not remaining and bindings:
                    self._detach_binding(ck)
                if is_l1:
                    gone.append((ostream, sid, osize))
                    self._unindex_if_absent(iid, ck, si, remaining)
                    reporter = self._streams[ostream][0]
                    if reporter != iid:
                        self._unindex_if_absent(reporter, ck, si, remaining)
        finally:
            self._num_keys -= removed_keys
            self._count[tier] -= removed
            self._bytes[tier] += sum(sdelta.values())
            for ostream, sid, osize in gone:
                self._roll_l1(ostream, pid, sid, -osize, -1)
            self._emit_usage({(pid, sid): d for sid, d in sdelta.items()})

    def _without(self, v: bytes, pid: int) -> tuple[bytes, int, int] | None:
        """Record minus live placement ``pid``: (new value, b"" if emptied; its stream; size)."""
        pls = self._live(v)
        for i, (opid, ostream, osize) in enumerate(pls):
            if opid == pid:
                del pls[i]
                la, cnt = _HDR.unpack_from(v)
                rest = self._encode(la, cnt, pls) if pls else b""
                return rest, ostream, osize
        return None

    def _unindex_if_absent(self, instance_id: str, ck: bytes, si: int, remaining: bytes) -> None:
        """Drop ``ck`` from ``instance_id``'s L1 index unless it still reports an L1 copy."""
        idx = self._l1_index.get(instance_id)
        if idx is None:
            return
        ish = idx.get(si >> _INDEX_SHIFT)
        if ish is None or ck not in ish:
            return
        if remaining:
            streams = self._instance_streams.get(instance_id, set())
            for opid, ostream, _ in self._live(remaining):
                if self._pid_l1[opid] and ostream in streams:
                    return
        del ish[ck]

    def _apply_access(self, batch: CacheEventBatch, cks: list[bytes]) -> None:
        ts = float(batch.ts)
        shards = self._shards
        frozen = self._frozen
        for ck in cks:
            si = hash(ck) & _MASK
            v = shards[si].get(ck)
            if v is None:
                continue
            la, cnt = _HDR.unpack_from(v)
            sh = shards[si] if not frozen[si] else self._thaw(si)
            sh[ck] = _HDR.pack(max(la, ts), cnt + 1) + v[_HDR_SIZE:]

    def _emit_usage(self, deltas: Mapping[tuple[int, int], int]) -> None:
        if not deltas:
            return
        rows: dict[tuple[Tier, str, str, str], int] = {}
        for (pid, sid), d in deltas.items():
            ident = self._pids[pid]
            k = (ident.tier, ident.owner, ident.backend, self._spaces.salt(sid))
            rows[k] = rows.get(k, 0) + d
        self._usage.apply_deltas(UsageDelta(*k, d) for k, d in rows.items())

    def fence_instance(self, instance_id: str) -> None:
        """Drop the L1 placements ``instance_id`` last reported (its restart or departure).

        Settled at once in O(streams): the streams are retired and marked
        dead, usage and totals are adjusted from the per-stream rollups, and
        the instance's L1 index is detached. Records are rewritten by the
        sweep (at once when at most ``fence_sync_keys`` keys are involved).
        """
        with self._lock:
            idx = self._l1_index.pop(instance_id, None)
            live = [s for s in self._instance_streams.get(instance_id, ()) if s not in self._dead]
            if not live and not idx:
                return
            deltas: dict[tuple[int, int], int] = {}
            removed = freed = 0
            for s in live:
                # Retire the id: a later batch of the same (instance,
                # incarnation) — e.g. after a timeout drop — gets a new one.
                self._stream_ids.pop(self._streams[s], None)
                self._dead.add(s)
                for k, b in self._l1_roll.pop(s, {}).items():
                    deltas[k] = deltas.get(k, 0) - b
                    freed += b
                removed += self._l1_cnt.pop(s, 0)
            self._count[Tier.L1] -= removed
            self._bytes[Tier.L1] -= freed
            self._emit_usage(deltas)
            n = sum(len(ish) for ish in idx.values()) if idx else 0
            if n:
                assert idx is not None
                self._backlog.append([ish for ish in idx.values() if ish])
                self._backlog_keys += n
                if self._backlog_keys <= self._fence_sync_keys:
                    self._reclaim_locked(self._backlog_keys)
            logger.info(
                "Fenced %s: %d L1 placements (%d bytes) dropped; %d keys to sweep",
                instance_id,
                removed,
                freed,
                n,
            )

    def reclaim_fenced(self, budget: int = 4096) -> int:
        """Sweep up to ``budget`` keys of earlier fences; returns the keys still to sweep."""
        with self._lock:
            if self._backlog:
                self._reclaim_locked(budget)
            return self._backlog_keys

    def _reclaim_locked(self, budget: int) -> None:
        done = 0
        backlog = self._backlog
        while backlog and done < budget:
            shards = backlog[0]
            while shards and done < budget:
                ish = shards[-1]
                if not ish:
                    shards.pop()
                    continue
                ck, _ = ish.popitem()
                done += 1
                self._reclaim_key(ck)
            if not shards:
                backlog.popleft()
        self._backlog_keys -= done

    def _reclaim_key(self, ck: bytes) -> None:
        """Rewrite one record without its fenced placements (already un-counted)."""
        si = hash(ck) & _MASK
        v = self._shards[si].get(ck)
        if v is None:
            return
        pls = self._live(v)
        if len(pls) * _PL_SIZE == len(v) - _HDR_SIZE:
            return
        sh = self._thaw(si) if self._frozen[si] else self._shards[si]
        if pls:
            la, cnt = _HDR.unpack_from(v)
            sh[ck] = self._encode(la, cnt, pls)
        else:
            del sh[ck]
            self._num_keys -= 1
            if self._bindings:
                self._detach_binding(ck)

    # -- token bindings ----------------------------------------------------

    def _attach_binding(self, chunk_hash: bytes, ck: bytes) -> None:
        b = self._bindings.get(chunk_hash)
        if b is not None and ck not in b[2]:
            self._bindings[chunk_hash] = (b[0], b[1], (*b[2], ck))

    def _detach_binding(self, ck: bytes) -> None:
        h = ck[:-SPACE_BYTES]
        b = self._bindings.get(h)
        if b is None or ck not in b[2]:
            return
        refs = tuple(r for r in b[2] if r != ck)
        if refs:
            self._bindings[h] = (b[0], b[1], refs)
        else:
            del self._bindings[h]

    def _fill_binding(self, entry: CacheEventEntry, ck: bytes) -> None:
        h = entry[0][0]
        toks = entry[2]
        offset = entry[3]
        b = self._bindings.get(h)
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
                    self._bindings[h] = (raw, offset, (*b[2], ck))
                return
        try:
            raw = _tokens_to_bytes(toks)
        except (OverflowError, TypeError, ValueError):
            logger.warning(
                "Token ids of chunk %s do not fit uint32; binding left unchanged", h.hex()[:16]
            )
            return
        refs = b[2] if b is not None else ()
        if ck not in refs:
            refs = (*refs, ck)
        if b is None and len(self._bindings) >= self._binding_cap:
            self._shrink_bindings()
        self._bindings[h] = (raw, offset, refs)

    def _shrink_bindings(self) -> None:
        """Drop the oldest eighth of the bindings at once (amortised O(1) per insert)."""
        target = (self._binding_cap * 7) // 8
        n = len(self._bindings) - target
        if n <= 0:
            return
        for h in list(itertools.islice(self._bindings, n)):
            del self._bindings[h]
        self.bindings_dropped += n
        logger.debug("Token binding cap %d reached: dropped %d oldest", self._binding_cap, n)

    # -- reads -------------------------------------------------------------

    def _record(self, key: ObjectKey) -> bytes | None:
        ck = self._spaces.find_key(key)
        if ck is None:
            return None
        return self._visible(self._shards[hash(ck) & _MASK].get(ck))

    def _placements(self, v: bytes) -> tuple[Placement, ...]:
        pids = self._pids
        streams = self._streams
        out: list[Placement] = []
        for pid, stream, size in self._live(v):
            tier, backend, shared, _owner = pids[pid]
            inst, inc = streams[stream]
            out.append(Placement(inst, inc, tier, backend, size, shared))
        if len(out) > 1:
            out.sort(key=lambda p: (p.instance_id, p.tier, p.backend))
        return tuple(out)

    def _info(self, key: ObjectKey, v: bytes | None, *, with_tokens: bool) -> KeyInfo:
        if v is None:
            return KeyInfo(key, ())
        la, cnt = _HDR.unpack_from(v)
        b = self._bindings.get(key[0])
        raw = b[0] if b is not None else b""
        toks = _bytes_to_tokens(raw) if with_tokens and raw else ()
        return KeyInfo(key, self._placements(v), cnt, la, len(raw) // 4, toks)

    def lookup(self, keys: Iterable[ObjectKey], *, with_tokens: bool = True) -> list[KeyInfo]:
        """One KeyInfo per key, in request order; unknown keys have no placements."""
        keys = list(keys)
        with self._lock:
            values = [self._record(k) for k in keys]
        # Records are immutable bytes and the intern tables are append-only,
        # so decoding happens outside the lock.
        return [
            self._info(k, v, with_tokens=with_tokens) for k, v in zip(keys, values, strict=True)
        ]

    def get_token_ids(self, chunk_hashes: Iterable[bytes]) -> list[tuple[int, ...]]:
        """Tokens bound to each chunk hash; empty for unknown or unfilled bindings."""
        with self._lock:
            raws = [self._bindings.get(h) for h in chunk_hashes]
        return [_bytes_to_tokens(b[0]) if b is not None else () for b in raws]

    def get_token_binding(self, chunk_hash: bytes) -> tuple[tuple[int, ...], int] | None:
        """``(token_ids, token_offset)`` bound to ``chunk_hash``, or None."""
        with self._lock:
            b = self._bindings.get(chunk_hash)
        if b is None:
            return None
        return _bytes_to_tokens(b[0]), b[1]

    def get_access_counts(self, keys: Iterable[ObjectKey]) -> list[int]:
        """Access count per key (0 for unknown keys)."""
        with self._lock:
            values = [self._record(k) for k in keys]
        return [_HDR.unpack_from(v)[1] if v else 0 for v in values]

    def get_keys_across_object_groups(self, keys: Iterable[ObjectKey]) -> list[list[ObjectKey]]:
        """Per key: itself plus every stored key differing only in object_group_id, by group."""
        out: list[list[ObjectKey]] = []
        with self._lock:
            for key in keys:
                found: dict[int, ObjectKey] = {key[3]: key}
                for vsid in self._spaces.group_variants(key[1], key[2], key[4]):
                    model, rank, group, salt = self._spaces.space(vsid)
                    if group == key[3]:
                        continue
                    ck = self._spaces.encode_with_space(key[0], vsid)
                    if self._visible(self._shards[hash(ck) & _MASK].get(ck)):
                        found[group] = ObjectKey(key[0], model, rank, group, salt)
                out.append([found[g] for g in sorted(found)])
        return out

    def key_bytes(self, tier: Tier, key: ObjectKey) -> int:
        """Bytes of every placement of ``key`` on ``tier``."""
        with self._lock:
            v = self._record(key)
        return self._tier_bytes(v, tier) if v else 0

    def ck_tier_bytes(self, ck: bytes, tier: Tier) -> int:
        """Bytes of every placement of compact key ``ck`` on ``tier``."""
        with self._lock:
            v = self._shards[hash(ck) & _MASK].get(ck)
        return self._tier_bytes(v, tier) if v else 0

    def _tier_bytes(self, v: bytes, tier: Tier) -> int:
        pids = self._pids
        return sum(size for pid, _s, size in self._live(v) if pids[pid].tier == tier)

    def _holds(self, v: bytes | None, tier: Tier) -> bool:
        if not v:
            return False
        pids = self._pids
        return any(pids[pid].tier == tier for pid, _s, _z in self._live(v))

    def holds_tier(self, ck: bytes, tier: Tier) -> bool:
        """True when compact key ``ck`` has at least one placement on ``tier``."""
        with self._lock:
            v = self._shards[hash(ck) & _MASK].get(ck)
        return self._holds(v, tier)

    def lacking_tier(self, cks: Sequence[bytes], tier: Tier) -> list[int]:
        """Positions of the compact keys that have no placement on ``tier``."""
        with self._lock:
            return [
                i
                for i, ck in enumerate(cks)
                if not self._holds(self._shards[hash(ck) & _MASK].get(ck), tier)
            ]

    def delete_targets(
        self, ck: bytes, tier: Tier, is_live: Callable[[str], bool]
    ) -> list[tuple[str, str]]:
        """``(instance_id, backend)`` to send a delete of ``ck`` on ``tier`` to, one per placement.

        A private placement goes to its owner; a shared one to its last
        reporter, or else to any instance that has reported into that pool.
        Placements no live instance can reach are left out.
        """
        with self._lock:
            v = self._shards[hash(ck) & _MASK].get(ck)
            if not v:
                return []
            out: list[tuple[str, str]] = []
            for pid, stream, _size in self._live(v):
                ident = self._pids[pid]
                if ident.tier != tier:
                    continue
                if not ident.shared:
                    if is_live(ident.owner):
                        out.append((ident.owner, ident.backend))
                    continue
                reporter = self._streams[stream][0]
                if is_live(reporter):
                    out.append((reporter, ident.backend))
                    continue
                for other in self._shared_reporters.get(pid, {}):
                    if is_live(other):
                        out.append((other, ident.backend))
                        break
            return out

    def list_keys(
        self,
        *,
        tier: Tier | None = None,
        instance_id: str = "",
        backend: str = "",
        limit: int = DEFAULT_LIST_LIMIT,
        page_token: str = "",
        max_scan: int | None = None,
    ) -> KeyPage:
        """A page of keys whose placements pass the filters (placements are filtered too).

        Order is by (shard, compact key) and the token is the position after
        the last key returned, so the walk is stable while keys change: a
        key present for the whole walk is returned exactly once, a key
        deleted meanwhile is skipped, a key added meanwhile may or may not
        appear. Tokens are valid only in the coordinator process that made
        them. At most ``max_scan`` keys (default ``max(4 * limit, 20000)``)
        are examined per call.
        """
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise InvalidArgument(f"limit must be in [1, {MAX_LIST_LIMIT}]", field="limit")
        scan_budget = max_scan if max_scan is not None else max(4 * limit, 20_000)
        shard, after = self._parse_page_token(page_token)
        filtered = tier is not None or bool(instance_id) or bool(backend)
        out: list[KeyInfo] = []
        decode = self._spaces.decode
        next_token = ""
        with self._lock:
            total = None if filtered else self._num_keys
            scanned = 0
            while shard < NUM_SHARDS:
                keys = sorted(self._shards[shard])
                start = 0
                if after is not None:
                    lo, hi = 0, len(keys)
                    while lo < hi:  # first key > after
                        mid = (lo + hi) // 2
                        if keys[mid] <= after:
                            lo = mid + 1
                        else:
                            hi = mid
                    start = lo
                data = self._shards[shard]
                for ck in keys[start:]:
                    scanned += 1
                    v = data[ck]
                    pls = self._placements(v)
                    if filtered:
                        pls = tuple(
                            p
                            for p in pls
                            if (tier is None or p.tier == tier)
                            and (not instance_id or p.instance_id == instance_id)
                            and (not backend or p.backend == backend)
                        )
                    if pls:
                        la, cnt = _HDR.unpack_from(v)
                        b = self._bindings.get(ck[:-SPACE_BYTES])
                        ntok = len(b[0]) // 4 if b is not None else 0
                        out.append(KeyInfo(decode(ck), pls, cnt, la, ntok))
                    if len(out) >= limit or scanned >= scan_budget:
                        next_token = self._page_token(shard, ck)
                        break
                if next_token:
                    break
                shard += 1
                after = None
        # A token pointing at the very last key of the last shard would give
        # an empty page; that is harmless and keeps the loop simple.
        return KeyPage(tuple(out), next_token, total)

    def _page_token(self, shard: int, ck: bytes) -> str:
        raw = _PAGE_HEAD.pack(_PAGE_TOKEN_VERSION, self._epoch, shard) + ck
        return base64.urlsafe_b64encode(raw).decode("ascii")

    def _parse_page_token(self, token: str) -> tuple[int, bytes | None]:
        if not token:
            return 0, None
        try:
            raw = base64.urlsafe_b64decode(token.encode("ascii"))
            version, epoch, shard = _PAGE_HEAD.unpack_from(raw)
        except (binascii.Error, UnicodeEncodeError, struct.error, ValueError):
            raise InvalidArgument("malformed page token", field="page_token") from None
        if version != _PAGE_TOKEN_VERSION or shard >= NUM_SHARDS:
            raise InvalidArgument("malformed page token", field="page_token")
        if epoch != self._epoch:
            raise InvalidArgument(
                "page token was issued by another coordinator process; restart the listing",
                field="page_token",
                reason="PAGE_TOKEN_EXPIRED",
            )
        return shard, raw[_PAGE_HEAD.size :]

    def stats(self) -> DirectoryStats:
        """Totals without walking keys (the per-instance count sums ≤256 shard sizes).

        While a large fence is being swept, ``num_keys`` still includes up to
        ``fence_backlog_keys`` keys whose only placements were fenced.
        """
        with self._lock:
            by_inst = {
                iid: sum(len(s) for s in idx.values()) for iid, idx in self._l1_index.items()
            }
            return DirectoryStats(
                num_keys=self._num_keys,
                num_placements=self._count[Tier.L1] + self._count[Tier.L2],
                l1=TierTotals(self._count[Tier.L1], self._bytes[Tier.L1]),
                l2=TierTotals(self._count[Tier.L2], self._bytes[Tier.L2]),
                l1_keys_by_instance=by_inst,
                token_bindings=len(self._bindings),
                token_binding_cap=self._binding_cap,
                fence_backlog_keys=self._backlog_keys,
            )

    def __len__(self) -> int:
        return self._num_keys

    def is_gc_untracked(self) -> bool:
        """True when no per-key container is visible to the cyclic GC (for tests and benches)."""
        import gc

        with self._lock:
            if any(gc.is_tracked(s) for s in self._shards):
                return False
            return not any(
                gc.is_tracked(s) for idx in self._l1_index.values() for s in idx.values()
            )

    # -- durable component -------------------------------------------------

    def capture(self) -> dict[str, object]:
        """Plain-data state; shard dicts are shared copy-on-write (O(shards), not O(keys)).

        ``{"format": 1, "spaces": [[model, rank, group, salt]…],
        "identities": [[tier, backend, shared, owner]…], "streams": [[instance,
        incarnation]…], "dead_streams": [stream…], "shared_reporters":
        [[identity, [instance…]]…], "shards": [{ck: record}…], "bindings":
        [[chunk_hash, offset, tokens_le_u32]…]}``. Records may still hold
        fenced placements (of ``dead_streams``); restore drops them. The
        reverse index, totals, per-stream rollups and usage are recomputed.
        """
        with self._lock:
            self._frozen[:] = b"\x01" * NUM_SHARDS
            self._capture_holds += 1
            return {
                "format": 1,
                "spaces": self._spaces.table(),
                "identities": [[int(p.tier), p.backend, p.shared, p.owner] for p in self._pids],
                "streams": [[iid, inc] for iid, inc in self._streams],
                "dead_streams": sorted(self._dead),
                "shared_reporters": [
                    [pid, list(insts)] for pid, insts in self._shared_reporters.items()
                ],
                "shards": list(self._shards),
                "bindings": [[h, b[1], b[0]] for h, b in self._bindings.items()],
            }

    def release_capture(self) -> None:
        """The caller dropped a capture; once none is held, shards stop being copy-on-write.

        Without this a capture stays valid forever and every shard is copied
        on its next write (correct, just wasted work).
        """
        with self._lock:
            self._capture_holds = max(0, self._capture_holds - 1)
            if self._capture_holds == 0:
                self._frozen = bytearray(NUM_SHARDS)

    def restore(self, state: object) -> None:
        """Load a capture into an empty directory (and an empty usage view).

        Everything is rebuilt aside and swapped in at the end, so a bad
        section leaves the directory untouched.
        """
        if not isinstance(state, Mapping) or state.get("format") != 1:
            raise ValueError("key_directory state is not a format-1 mapping")
        table = state["spaces"]
        mapping = self._spaces.translation(table)
        pids: list[PlacementIdentity] = []
        for row in state["identities"]:
            tier_v, backend, shared, owner = row
            if tier_v not in (Tier.L1, Tier.L2):
                raise ValueError(f"placement tier {tier_v!r} is not l1/l2")
            pids.append(PlacementIdentity(Tier(tier_v), str(backend), bool(shared), str(owner)))
        streams = [(str(iid), int(inc)) for iid, inc in state["streams"]]
        dead = {int(x) for x in state.get("dead_streams", [])}
        inst_streams: dict[str, set[int]] = {}
        for i, (iid, _inc) in enumerate(streams):
            inst_streams.setdefault(iid, set()).add(i)
        shared_rep: dict[int, dict[str, None]] = {}
        for pid, insts in state.get("shared_reporters", []):
            shared_rep[int(pid)] = dict.fromkeys(str(x) for x in insts)
        pid_l1 = [p.tier == Tier.L1 for p in pids]
        n_pids, n_streams, n_spaces = len(pids), len(streams), len(table)

        shards: list[dict[bytes, bytes]] = [{} for _ in range(NUM_SHARDS)]
        index: dict[str, dict[int, dict[bytes, None]]] = {iid: {} for iid in inst_streams}
        count = [0, 0, 0]
        nbytes = [0, 0, 0]
        deltas: dict[tuple[int, int], int] = {}
        l1_roll: dict[int, dict[tuple[int, int], int]] = {}
        l1_cnt: dict[int, int] = {}
        captured_bindings = {bytes(h): (int(off), bytes(raw)) for h, off, raw in state["bindings"]}
        refs: dict[bytes, list[bytes]] = {}
        num_keys = 0
        retranslate = self._spaces.retranslate
        for shard in state["shards"]:
            if not isinstance(shard, Mapping):
                raise TypeError("key_directory shard is not a mapping")
            for raw_ck, raw_v in shard.items():
                if not isinstance(raw_ck, bytes) or not isinstance(raw_v, bytes):
                    raise TypeError("key_directory record is not bytes")
                v = raw_v
                if len(v) < _ONE_SIZE or (len(v) - _HDR_SIZE) % _PL_SIZE:
                    raise ValueError(f"key_directory record of {len(v)} bytes is malformed")
                ck = retranslate(raw_ck, mapping, n_spaces)
                si = hash(ck) & _MASK
                sid = space_id_of(ck)
                live: list[tuple[int, int, int]] = []
                for off in range(_HDR_SIZE, len(v), _PL_SIZE):
                    pid, stream, size = _PL.unpack_from(v, off)
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
                        ish = index[streams[stream][0]].setdefault(si >> _INDEX_SHIFT, {})
                        ish[ck] = None
                        roll = l1_roll.setdefault(stream, {})
                        roll[(pid, sid)] = roll.get((pid, sid), 0) + size
                        l1_cnt[stream] = l1_cnt.get(stream, 0) + 1
                if not live:
                    continue
                if len(live) * _PL_SIZE != len(v) - _HDR_SIZE:
                    la, cnt = _HDR.unpack_from(v)
                    v = self._encode(la, cnt, live)
                shards[si][ck] = v
                num_keys += 1
                h = ck[:-SPACE_BYTES]
                if h in captured_bindings:
                    refs.setdefault(h, []).append(ck)
        # Keep the captured (age) order so the cap keeps dropping the oldest.
        bindings: dict[bytes, _Binding] = {
            h: (raw, off, tuple(refs[h]))
            for h, (off, raw) in captured_bindings.items()
            if h in refs
        }
        with self._lock:
            if self._num_keys or any(self._l1_index.values()) or self._restored:
                raise ValueError(
                    "key_directory restore requires an empty directory (or it was restored already)"
                )
            if not self._usage.is_empty():
                raise ValueError("key_directory restore requires an empty usage view")
            self._shards = shards
            self._frozen = bytearray(NUM_SHARDS)
            self._num_keys = num_keys
            self._count = count
            self._bytes = nbytes
            self._pids = pids
            self._pid_ids = {p: i for i, p in enumerate(pids)}
            self._pid_l1 = pid_l1
            self._streams = streams
            self._stream_ids = {s: i for i, s in enumerate(streams) if i not in dead}
            self._instance_streams = inst_streams
            self._dead = dead
            self._l1_roll = l1_roll
            self._l1_cnt = l1_cnt
            self._shared_reporters = shared_rep
            self._l1_index = {**self._l1_index, **index}
            self._bindings = bindings
            self._restored = True
            self._emit_usage(deltas)
        logger.info("Key directory restored: %d keys", num_keys)
