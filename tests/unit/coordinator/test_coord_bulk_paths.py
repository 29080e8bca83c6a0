"""The directory's and the LRU's bulk ingest paths change nothing but speed.

The same random traffic (fresh and re-stored keys, duplicates inside a
batch, several key spaces and sizes, token bindings, shared placements,
deletes, accesses, restarts, captures held across batches) goes into two
coordinators: one gets columnar entries (UniformEntries, as the servicer
builds them) and may take the bulk paths, the other gets tuples with the
bulk paths switched off. Everything observable must come out the same.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvmesh.common.events import CacheEventBatch, CacheEventEntry, EventType, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.common.uniform_batches import UniformEntries
from kvmesh.coordinator.core import Coordinator, CoordinatorSettings
from kvmesh.coordinator.core.directory import writes
from kvmesh.coordinator.core.keyspace import EncodedBatch
from kvmesh.coordinator.core.lru import IsolatedLRU

SPACES = [("m/a", 0, 0, ""), ("m/a", 0, 1, "t1"), ("m/b", 0x01000100, 0, "t2")]


def _traffic(seed: int, steps: int) -> list[tuple[str, Any]]:
    r = random.Random(seed)
    pool = [r.randbytes(32) for _ in range(300)]
    reuse = r.choice([0.6, 0.05])
    seqs = {"n0": 0, "n1": 0}
    incs = {"n0": 1, "n1": 1}
    out: list[tuple[str, Any]] = []
    for _ in range(steps):
        x = r.random()
        iid = r.choice(["n0", "n1"])
        if x < 0.06:
            incs[iid] += 1
            seqs[iid] = 0
            continue
        if x < 0.1:
            out.append(("capture", None))
            continue
        if x < 0.13:
            out.append(("release", None))
            continue
        seqs[iid] += 1
        et = EventType.STORE if x < 0.75 else r.choice([EventType.DELETE, EventType.ACCESS])
        space = r.choice(SPACES)
        size = r.choice([0, 4096, 4 << 20])
        tokens = tuple(r.randrange(2**32) for _ in range(4)) if r.random() < 0.1 else ()
        hashes = [r.choice(pool) if r.random() < reuse else r.randbytes(32) for _ in range(64)]
        if r.random() < 0.1:
            hashes[-1] = hashes[0]  # a key twice in one batch
        template = CacheEventEntry(ObjectKey(hashes[0], *space), size, tokens, 0 if tokens else -1)
        tier = r.choice([Tier.L1, Tier.L2])
        out.append(
            (
                "batch",
                {
                    "instance_id": iid,
                    "incarnation": incs[iid],
                    "seq": seqs[iid],
                    "event_type": et,
                    "tier": tier,
                    "backend": "dram" if tier is Tier.L1 else "fs",
                    "shared": r.random() < 0.1,
                    "ts": 1.7e9 + r.random(),
                    "entries": UniformEntries(hashes, template),
                },
            )
        )
    return out


def _run(traffic: list[tuple[str, Any]], bulk: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        if not bulk:
            m.setattr(writes, "store_new_keys", lambda *_a: False)

            def per_key(self: IsolatedLRU, encoded: EncodedBatch) -> None:
                self.on_keys_created(encoded.cks, encoded.sids)

            m.setattr(IsolatedLRU, "on_batch_created", per_key)
        core = Coordinator(CoordinatorSettings(token_binding_cap=64))
        held = 0
        for kind, fields in traffic:
            if kind == "capture":
                core.directory.capture()
                core.lru.snapshot()
                held += 1
            elif kind == "release" and held:
                core.directory.release_capture()
                core.lru.release_snapshot()
                held -= 1
            elif kind == "batch":
                entries = fields["entries"] if bulk else tuple(fields["entries"])
                core.ingest_validated(CacheEventBatch(**{**fields, "entries": entries}))
        keys = sorted(
            (i.key, tuple(i.placements), i.access_count, i.last_access, i.num_tokens)
            for i in core.list_keys(limit=10_000).entries
        )
        return (
            keys,
            core.stats(),
            {t: core.usage_by_salt(t) for t in Tier},
            core.fleet_usage(),
            {s: core.lru.order(s) for s in core.lru.tracked_salts()},
            {s: core.lru.count(s) for s in core.lru.tracked_salts()},
            sorted(core.directory._st.bindings.by_hash.items()),
        )


@pytest.mark.parametrize("seed", range(6))
def test_bulk_paths_give_the_same_state_as_the_per_key_paths(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    traffic = _traffic(seed, 400)
    assert _run(traffic, True, monkeypatch) == _run(traffic, False, monkeypatch)
