"""How cache events change the directory: STORE, DELETE, ACCESS, fences and their sweep.

Functions over a :class:`DirectoryState`, called with its lock held. Each
binds the tables it needs to locals once per batch, so the per-key loops
touch no attribute.

A STORE of fresh keys of one key space and one size (what storage nodes
send), with no token bindings in play, is applied in bulk
(:func:`store_new_keys`: C-level passes over the batch); any other batch
goes key by key (:func:`store_each`); both give the same result.

Fencing never stalls ingest: :func:`fence` retires the instance's reporter
streams, settles usage, totals and its L1 index at once from the per-stream
rollups (O(streams), not O(keys)), and leaves the rewriting of the affected
records to :func:`reclaim`, in bounded slices (a few hundred keys after each
batch, plus the directory's background timer). Small fences are drained at
once.
"""

from __future__ import annotations

import logging
import operator

from kvmesh.common.events import CacheEventBatch, Tier
from kvmesh.coordinator.core.keyspace import EncodedBatch, columnar

from .l1index import INDEX_SHIFT, IndexShards
from .records import HDR, HDR_SIZE, ONE, ONE_SIZE, PL, PL_SIZE, PlacementIdentity, encode
from .shards import MASK
from .state import DirectoryState

logger = logging.getLogger(__name__)

_TOKENS = operator.itemgetter(2)
_SIZES = operator.itemgetter(1)


def apply_store(st: DirectoryState, batch: CacheEventBatch, encoded: EncodedBatch) -> None:
    """Upsert the batch's placements (by identity), in bulk when the batch allows it."""
    records = st.records
    iid = batch.instance_id
    tier = batch.tier
    pid = records.intern_pid(
        PlacementIdentity(tier, batch.backend, batch.shared, "" if batch.shared else iid)
    )
    stream = records.intern_stream(iid, batch.incarnation)
    if batch.shared:
        records.shared_reporters.setdefault(pid, {})[iid] = None
    is_l1 = tier == Tier.L1
    idx = st.index.ensure(iid) if is_l1 else None
    entries = batch.entries
    cols = columnar(entries)
    bindings = st.bindings.by_hash if st.bindings.cap > 0 else None
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
    prefix = ONE.pack(ts, 0, pid, stream, 0)[: ONE_SIZE - 8]
    if (
        one_size is not None
        and encoded.sid >= 0
        and not with_tokens
        and not bindings
        and encoded.unique
        and store_new_keys(st, encoded, prefix + one_size.to_bytes(8, "little"), idx)
    ):
        n = len(encoded.cks)
        delta = n * one_size
        st.num_keys += n
        st.count[tier] += n
        st.nbytes[tier] += delta
        if is_l1:
            if delta:
                records.roll_l1(stream, pid, encoded.sid, delta, 0)
            records.l1_cnt[stream] = records.l1_cnt.get(stream, 0) + n
        if delta:
            st.emit_usage({(pid, encoded.sid): delta})
        return
    store_each(st, batch, encoded, pid, stream, prefix, idx, with_tokens)


def store_new_keys(
    st: DirectoryState, encoded: EncodedBatch, record: bytes, idx: IndexShards | None
) -> bool:
    """Insert every key of ``encoded`` with ``record`` if none exists yet; False if one does.

    The bulk path of the common batch (fresh keys of one space and one
    size, no token bindings). No key is touched when it returns False.
    """
    if not st.store.insert_new(encoded.cks, encoded.shards, record):
        return False
    if idx is not None:
        st.index.add_bulk(idx, encoded.cks, encoded.shards)
    return True


def store_each(
    st: DirectoryState,
    batch: CacheEventBatch,
    encoded: EncodedBatch,
    pid: int,
    stream: int,
    prefix: bytes,
    idx: IndexShards | None,
    with_tokens: bool,
) -> None:
    """Upsert entry by entry (keys that exist, several spaces or sizes, token bindings)."""
    cks = encoded.cks
    sids = encoded.sids
    tier = batch.tier
    is_l1 = idx is not None
    records = st.records
    shards = st.store.shards
    frozen = st.store.frozen
    thaw = st.store.thaw
    dead = records.dead
    pid_l1 = records.pid_l1
    upsert = records.upsert
    bindings = st.bindings.by_hash if st.bindings.cap > 0 else None
    attach = st.bindings.attach
    fill = st.bindings.fill
    unpack = ONE.unpack
    pack = ONE.pack
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
            si = hash(ck) & MASK
            sh = thaw(si) if frozen[si] else shards[si]
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
                    attach(entry[0][0], ck)
            elif len(v) == ONE_SIZE:
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
                        sh[ck] = pack(la, cnt, opid, ostream, osize) + PL.pack(pid, stream, size)
                        added += 1
                        d = size
                    else:
                        sh[ck] = pack(la, cnt, pid, stream, size)
                        d = size - osize
                        if ostream != stream and is_l1:
                            moves.append((ostream, sid, osize))
            else:
                sh[ck], d, grew, moved_from, osize = upsert(v, ts, pid, stream, size)
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
                ish = idx.get(si >> INDEX_SHIFT)
                if ish is None:
                    ish = idx[si >> INDEX_SHIFT] = {}
                ish[ck] = None
            if with_tokens and len(entry[2]):
                fill(entry, ck)
    finally:
        if run:
            sdelta[run_sid] = sdelta.get(run_sid, 0) + run
        st.num_keys += new_keys
        st.count[tier] += added
        st.nbytes[tier] += sum(sdelta.values())
        if is_l1:
            # The batch's stream gains what it added; a placement taken
            # over from another live stream moves between the two.
            for sid, d in sdelta.items():
                records.roll_l1(stream, pid, sid, d, 0)
            records.l1_cnt[stream] = records.l1_cnt.get(stream, 0) + added
            for ostream, sid, osize in moves:
                records.roll_l1(ostream, pid, sid, -osize, -1)
                records.roll_l1(stream, pid, sid, osize, 1)
        st.emit_usage({(pid, sid): d for sid, d in sdelta.items()})


def apply_delete(
    st: DirectoryState, batch: CacheEventBatch, cks: list[bytes], sids: list[int]
) -> None:
    """Remove the batch's placements (by identity); drop emptied records."""
    records = st.records
    iid = batch.instance_id
    tier = batch.tier
    pid = records.pid_ids.get(
        PlacementIdentity(tier, batch.backend, batch.shared, "" if batch.shared else iid)
    )
    if pid is None:  # nothing was ever stored under this identity
        return
    is_l1 = tier == Tier.L1
    shards = st.store.shards
    frozen = st.store.frozen
    thaw = st.store.thaw
    dead = records.dead
    streams = records.streams
    without = records.without
    bindings = st.bindings.by_hash
    detach = st.bindings.detach
    sdelta: dict[int, int] = {}
    removed_keys = removed = 0
    gone: list[tuple[int, int, int]] = []  # L1: (stream, sid, size) removed
    try:
        for ck, sid in zip(cks, sids, strict=True):
            si = hash(ck) & MASK
            v = shards[si].get(ck)
            if v is None:
                continue
            if len(v) == ONE_SIZE:
                _la, _cnt, opid, ostream, osize = ONE.unpack(v)
                if opid != pid or (is_l1 and dead and ostream in dead):
                    continue  # not ours, or already fenced (the sweep removes it)
                sh = shards[si] if not frozen[si] else thaw(si)
                del sh[ck]
                remaining = b""
                removed_keys += 1
            else:
                found = without(v, pid)
                if found is None:
                    continue
                remaining, ostream, osize = found
                sh = shards[si] if not frozen[si] else thaw(si)
                if remaining:
                    sh[ck] = remaining
                else:
                    del sh[ck]
                    removed_keys += 1
            removed += 1
            if osize:
                sdelta[sid] = sdelta.get(sid, 0) - osize
            if not remaining and bindings:
                detach(ck)
            if is_l1:
                gone.append((ostream, sid, osize))
                unindex_if_absent(st, iid, ck, si, remaining)
                reporter = streams[ostream][0]
                if reporter != iid:
                    unindex_if_absent(st, reporter, ck, si, remaining)
    finally:
        st.num_keys -= removed_keys
        st.count[tier] -= removed
        st.nbytes[tier] += sum(sdelta.values())
        for ostream, sid, osize in gone:
            records.roll_l1(ostream, pid, sid, -osize, -1)
        st.emit_usage({(pid, sid): d for sid, d in sdelta.items()})


def unindex_if_absent(
    st: DirectoryState, instance_id: str, ck: bytes, si: int, remaining: bytes
) -> None:
    """Drop ``ck`` from ``instance_id``'s L1 index unless it still reports an L1 copy."""
    ish = st.index.shard_holding(instance_id, ck, si)
    if ish is None:
        return
    if remaining and st.records.reports_l1(instance_id, remaining):
        return
    del ish[ck]


def apply_access(st: DirectoryState, batch: CacheEventBatch, cks: list[bytes]) -> None:
    """Refresh ``last_access`` and count one use per entry; never creates a record."""
    ts = float(batch.ts)
    shards = st.store.shards
    frozen = st.store.frozen
    thaw = st.store.thaw
    for ck in cks:
        si = hash(ck) & MASK
        v = shards[si].get(ck)
        if v is None:
            continue
        la, cnt = HDR.unpack_from(v)
        sh = shards[si] if not frozen[si] else thaw(si)
        sh[ck] = HDR.pack(max(la, ts), cnt + 1) + v[HDR_SIZE:]


def fence(st: DirectoryState, instance_id: str, sync_keys: int) -> None:
    """Drop the L1 placements ``instance_id`` last reported; sweep now if ≤ ``sync_keys`` keys."""
    records = st.records
    had_index, n = st.index.detach(instance_id)
    live = records.live_streams(instance_id)
    if not live and not had_index:
        return
    deltas, removed, freed = records.retire(live)
    st.count[Tier.L1] -= removed
    st.nbytes[Tier.L1] -= freed
    st.emit_usage(deltas)
    if n and st.index.backlog_keys <= sync_keys:
        reclaim(st, st.index.backlog_keys)
    logger.info(
        "Fenced %s: %d L1 placements (%d bytes) dropped; %d keys to sweep",
        instance_id,
        removed,
        freed,
        n,
    )


def reclaim(st: DirectoryState, budget: int) -> None:
    """Rewrite up to ``budget`` records of earlier fences without their fenced placements.

    The placements were un-counted when fenced; a record left empty is
    dropped (with its token binding reference).
    """
    index = st.index
    backlog = index.backlog
    shards = st.store.shards
    frozen = st.store.frozen
    thaw = st.store.thaw
    live = st.records.live
    bindings = st.bindings.by_hash
    detach = st.bindings.detach
    done = dropped = 0
    try:
        while backlog and done < budget:
            pending = backlog[0]
            while pending and done < budget:
                ish = pending[-1]
                if not ish:
                    pending.pop()
                    continue
                ck, _ = ish.popitem()
                done += 1
                si = hash(ck) & MASK
                v = shards[si].get(ck)
                if v is None:
                    continue
                pls = live(v)
                if len(pls) * PL_SIZE == len(v) - HDR_SIZE:
                    continue
                sh = thaw(si) if frozen[si] else shards[si]
                if pls:
                    la, cnt = HDR.unpack_from(v)
                    sh[ck] = encode(la, cnt, pls)
                else:
                    del sh[ck]
                    dropped += 1
                    if bindings:
                        detach(ck)
            if not pending:
                backlog.popleft()
    finally:
        index.backlog_keys -= done
        st.num_keys -= dropped
