"""Checkpoint, metadata and captures (docs/coordinator.md, "Persistence")."""

from __future__ import annotations

import copy
import json
import struct
import threading
from pathlib import Path

import msgpack
import pytest

from kvmesh.common.errors import FailedPrecondition
from kvmesh.common.events import CacheEventBatch, Tier
from kvmesh.common.keys import ObjectKey
from kvmesh.coordinator.core import (
    Coordinator,
    CoordinatorSettings,
    MetadataStore,
    PinTable,
    QuotaManager,
)
from kvmesh.coordinator.core.persistence import (
    CHECKPOINT_MAGIC,
    ArtifactNotFoundError,
    assert_plain_data,
    find_non_plain,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    write_checkpoint,
)
from tests.unit.coordinator.coord_testkit import Stream, key

GIB = 1 << 30


def settings(tmp: Path | None = None, **kw: object) -> CoordinatorSettings:
    base: dict[str, object] = {"health_check_interval": 0, "eviction_check_interval": 0}
    if tmp is not None:
        base["checkpoint_path"] = str(tmp / "state" / "ckpt.bin")
        base["metadata_path"] = str(tmp / "state" / "meta.json")
    base.update(kw)
    return CoordinatorSettings(**base)  # type: ignore[arg-type]


def populated(tmp: Path | None = None) -> Coordinator:
    """3 keys: two L2 private (1024 each), one L1; a shared pool; a declaration; pins; quotas."""
    c = Coordinator(settings(tmp))
    a = Stream("node-a", incarnation=7)
    for b in (
        a.config(Tier.L2, "fs", 10 * GIB, 1),
        a.store([key(1), key(2)], tier=Tier.L2, size=1024, tokens=[1, 2, 3], token_offset=0),
        a.store([key(3)], size=512),
        a.access([key(1)], tier=Tier.L2, backend="fs", ts=3.0),
    ):
        c.ingest(b)
    c.set_quota("", 4096)
    c.pin_keys([key(1)])
    return c


def normalised(obj: object) -> object:
    """What a capture looks like after a msgpack round trip (tuples become lists)."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=False)


def captures(c: Coordinator) -> dict[str, object]:
    with c.quiesce.quiesced(5.0):
        return {comp.name: comp.capture() for comp in c.checkpoint_components}


def test_round_trip_restores_identical_state(tmp_path: Path) -> None:
    """Capture → file → fresh coordinator → capture again is identical."""
    c = populated()
    before = captures(c)
    path = tmp_path / "ckpt"
    write_checkpoint(path, before)
    fresh = Coordinator(settings())
    report = load_checkpoint(path, fresh.checkpoint_components)
    assert report.failed == {}
    assert set(report.restored) == {"stream_cursors", "key_directory", "server_config", "lru_order"}
    assert normalised(captures(fresh)) == normalised(before)
    assert fresh.usage.get_salt_bytes(Tier.L2, "") == 2048
    assert fresh.stats() == c.stats()
    assert fresh.lru.order("") == c.lru.order("")


def test_restored_cursors_fence_the_restarted_emitter(tmp_path: Path) -> None:
    """Restore an inc7 L1 placement; inc8 arrives; the placement is gone."""
    c = populated()
    path = tmp_path / "ckpt"
    write_checkpoint(path, captures(c))
    fresh = Coordinator(settings())
    load_checkpoint(path, fresh.checkpoint_components)
    assert fresh.lookup([key(3)])[0].placements != ()
    fresh.ingest(Stream("node-a", incarnation=8).store([key(9)], tier=Tier.L2))
    assert fresh.lookup([key(3)])[0].placements == ()
    assert len(fresh.lookup([key(1)])[0].placements) == 1  # L2 survives


@pytest.mark.parametrize("section", ["stream_cursors", "key_directory", "server_config"])
def test_second_restore_of_a_stateful_section_is_refused(section: str) -> None:
    """State cannot be counted twice; lru_order / pins / quotas replace."""
    c = populated()
    state = captures(c)
    fresh = Coordinator(settings())
    comp = next(x for x in fresh.checkpoint_components if x.name == section)
    comp.restore(state[section])
    with pytest.raises(ValueError, match=r"empty|restored already"):
        comp.restore(state[section])


def test_replace_sections_accept_a_second_restore() -> None:
    """Lru_order, pins and quotas replace their state."""
    c = populated()
    fresh = Coordinator(settings())
    for _ in range(2):
        fresh.lru.restore(c.lru.capture())
        fresh.pins.restore(c.pins.capture())
        fresh.quotas.restore(c.quotas.capture())
    assert fresh.lru.order("") == c.lru.order("")
    assert fresh.pins.pin_count(key(1)) == 1


def test_save_then_load_into_fresh_coordinator(tmp_path: Path) -> None:
    """3 keys and 2048 L2 bytes come back."""
    c = populated(tmp_path)
    assert c.checkpoint_now().ok is True
    fresh = Coordinator(settings(tmp_path))
    report = fresh.load_state()
    assert report is not None
    assert report.cold is False
    assert fresh.stats().num_keys == 3
    assert fresh.usage.get_salt_bytes(Tier.L2, "") == 2048
    assert fresh.pins.pin_count(key(1)) == 1
    assert fresh.quotas.list_quotas() == {"": 4096}


class _SlowConsumer:
    """Blocks inside consume until released (after the directory applied the batch)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def consume(self, batch: CacheEventBatch) -> None:
        self.entered.set()
        self.release.wait(10.0)

    def fence_instance(self, instance_id: str) -> None:
        pass


def test_capture_during_a_slow_consumer_never_holds_half_a_batch(tmp_path: Path) -> None:
    """The capture waits for the whole batch (or times out, writing nothing)."""
    c = Coordinator(settings(tmp_path, quiesce_timeout=10.0))
    slow = _SlowConsumer()
    c.broadcaster.register(slow)
    t = threading.Thread(target=c.ingest, args=(Stream().store([key(1)], tier=Tier.L2),))
    t.start()
    assert slow.entered.wait(5.0)
    # Directory applied, the batch is not finished: a quick capture must not happen.
    assert c.checkpoint_now(timeout=0.05).ok is False
    assert not Path(c.settings.checkpoint_path).exists()
    done: list[bool] = []
    saver = threading.Thread(target=lambda: done.append(c.checkpoint_now().ok))
    saver.start()
    slow.release.set()
    t.join(5.0)
    saver.join(10.0)
    assert done == [True]
    sections = read_checkpoint(c.settings.checkpoint_path)
    assert sections["stream_cursors"]["cursors"]["node-a"][1] == 1  # type: ignore[index]
    fresh = Coordinator(settings())
    load_checkpoint(c.settings.checkpoint_path, fresh.checkpoint_components)
    assert fresh.stats().num_keys == 1
    assert fresh.usage.get_salt_bytes(Tier.L2, "") == 1024


def test_missing_checkpoint_is_a_cold_start(tmp_path: Path) -> None:
    report = load_checkpoint(tmp_path / "nope", Coordinator(settings()).checkpoint_components)
    assert (report.cold, report.reason) == (True, "missing")


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"NOTMAGIC" + struct.pack("<I", 1) + msgpack.packb({}), "bad magic"),
        (CHECKPOINT_MAGIC + struct.pack("<I", 0x63) + msgpack.packb({}), "version 99"),
        (CHECKPOINT_MAGIC + struct.pack("<I", 1), "missing payload"),
        (CHECKPOINT_MAGIC[:5], "truncated header"),
        (CHECKPOINT_MAGIC + struct.pack("<I", 1) + b"\xc1\xc1", "malformed payload"),
        (CHECKPOINT_MAGIC + struct.pack("<I", 1) + msgpack.packb([1, 2]), "not a map"),
    ],
)
def test_unreadable_checkpoints_start_cold(tmp_path: Path, payload: bytes, reason: str) -> None:
    """Bad magic, version 0x63, no payload, truncated header → cold, no crash."""
    path = tmp_path / "ckpt"
    path.write_bytes(payload)
    c = Coordinator(settings())
    report = load_checkpoint(path, c.checkpoint_components)
    assert report.cold is True
    assert reason.split(maxsplit=1)[0] in report.reason or reason in report.reason
    assert c.stats().num_keys == 0


def test_one_bad_section_does_not_block_the_others(tmp_path: Path) -> None:
    """The broken directory is skipped, cursors and capacity still load."""
    c = populated()
    state = captures(c)
    state["key_directory"] = {"format": 1, "spaces": "garbage"}
    path = tmp_path / "ckpt"
    write_checkpoint(path, state)
    fresh = Coordinator(settings())
    report = load_checkpoint(path, fresh.checkpoint_components)
    assert "key_directory" in report.failed
    assert {"stream_cursors", "server_config", "lru_order"} <= set(report.restored)
    assert fresh.cursors()["node-a"].incarnation == 7
    assert fresh.stats().num_keys == 0


def test_write_to_a_directory_path_fails_without_raising(tmp_path: Path) -> None:
    """Save_checkpoint logs and returns False."""
    (tmp_path / "ckpt").mkdir()
    c = populated()
    result = save_checkpoint(tmp_path / "ckpt", c.quiesce, c.checkpoint_components)
    assert result.ok is False
    assert "directory" in result.error


def test_captures_are_copies_unaffected_by_later_changes() -> None:
    """Later ingests, pins, quota changes and drops leave a capture unchanged."""
    c = populated()
    comps = [*c.checkpoint_components, c.pins, c.quotas]
    caps = {comp.name: comp.capture() for comp in comps}
    frozen = copy.deepcopy(caps)
    s = Stream("node-a", incarnation=7, seq=10)
    c.ingest(s.store([key(4), key(1)], tier=Tier.L2, size=9))
    c.ingest(s.delete([key(2)], tier=Tier.L2))
    c.ingest(s.access([key(1)], ts=99.0))
    c.ingest(Stream("node-b").config(Tier.L1, "dram", 5, 1))
    c.pin_keys([key(2)])
    c.set_quota("t", 1)
    c.set_default_quota(7)
    c.deregister_instance("node-a")
    assert caps == frozen


def test_every_capture_is_plain_data_and_a_nested_key_is_caught() -> None:
    c = populated()
    for comp in [*c.checkpoint_components, c.pins, c.quotas]:
        assert find_non_plain(comp.capture()) is None, comp.name
    bad = {"keys": [("ok", 1), {"nested": [ObjectKey(b"x" * 32, "m", 1)]}]}
    where = find_non_plain(bad)
    assert where is not None
    assert "ObjectKey" in where
    with pytest.raises(TypeError, match="not plain data"):
        assert_plain_data({"x": {1, 2}})
    with pytest.raises(TypeError):
        assert_plain_data({("tuple", "key"): 1})


def test_metadata_round_trip_and_document_shape(tmp_path: Path) -> None:
    """Pins, quotas, default; JSON with version 1; QuotaManager alone works."""
    path = tmp_path / "meta.json"
    store = MetadataStore(path)
    pins, quotas = PinTable(), QuotaManager()
    store.register(pins)
    store.register(quotas)
    pins.pin([key(1), key(1), key(2, salt="t")])
    quotas.set_quota("t", 123)
    quotas.set_default_limit_bytes(2 * GIB)
    assert store.save() is True
    doc = json.loads(path.read_text())
    assert doc["version"] == 1
    assert isinstance(doc["saved_at"], float)
    assert set(doc["components"]) == {"pins", "quotas"}
    store2 = MetadataStore(path)
    pins2, quotas2 = PinTable(), QuotaManager()
    store2.register(pins2)
    store2.register(quotas2)
    assert store2.load() is True
    assert pins2.pin_count(key(1)) == 2
    assert pins2.is_pinned(key(2, salt="t"))
    assert quotas2.list_quotas() == {"t": 123}
    assert quotas2.get_default_limit_bytes() == 2 * GIB
    alone = MetadataStore(tmp_path / "q.json")
    q = QuotaManager()
    alone.register(q)
    q.set_quota("", 5)
    assert alone.save() is True
    q2 = QuotaManager()
    other = MetadataStore(tmp_path / "q.json")
    other.register(q2)
    other.load()
    assert q2.list_quotas() == {"": 5}


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[1, 2]",
        json.dumps({"version": 99, "saved_at": 1.0, "components": {}}),
        json.dumps({"version": 1, "saved_at": 1.0}),
        json.dumps({"version": 1, "components": {"quotas": {"limits": {"x": 1}}}}),
    ],
)
def test_bad_metadata_documents_leave_components_untouched(tmp_path: Path, text: str) -> None:
    """Unparsable, not an object, version 99, no components, no saved_at."""
    path = tmp_path / "meta.json"
    path.write_text(text)
    store = MetadataStore(path)
    q = QuotaManager()
    q.set_quota("keep", 1)
    store.register(q)
    assert store.load() is False
    assert q.list_quotas() == {"keep": 1}


def test_metadata_store_refuses_checkpoint_components() -> None:
    """Registering checkpoint state raises."""
    c = Coordinator(settings())
    with pytest.raises(ValueError, match="checkpoint state"):
        MetadataStore(None).register(c.directory)


def test_artifact_write_read_missing_and_failed_write(tmp_path: Path) -> None:
    """Write/read; missing → ArtifactNotFoundError; failed write keeps old file."""
    path = tmp_path / "deep" / "dir" / "ckpt"
    write_checkpoint(path, {"s": {"a": [1, b"x", None, 2.5, True]}})
    assert read_checkpoint(path) == {"s": {"a": [1, b"x", None, 2.5, True]}}
    with pytest.raises(ArtifactNotFoundError):
        read_checkpoint(tmp_path / "missing")
    old = path.read_bytes()
    with pytest.raises(TypeError):
        write_checkpoint(path, {"s": {"ok": 1}, "t": {"bad": {1, 2}}})
    assert path.read_bytes() == old
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]


def test_null_stores_discard_writes_and_find_nothing(tmp_path: Path) -> None:
    """Without paths nothing is written or read."""
    store = MetadataStore(None)
    store.register(QuotaManager())
    assert store.save() is True
    assert store.load() is False
    c = Coordinator(settings())
    with pytest.raises(FailedPrecondition):
        c.checkpoint_now()
    assert c.load_state() is None


def test_clean_stop_writes_both_artifacts_and_restart_reloads_them(tmp_path: Path) -> None:
    """Interval 0 still checkpoints on stop; the restart sees 1 key and the default."""
    c = Coordinator(settings(tmp_path, checkpoint_interval=0))
    c.start()
    c.ingest(Stream().store([key(1)], tier=Tier.L2))
    c.set_default_quota(2 * GIB)
    c.stop()
    assert Path(c.settings.checkpoint_path).exists()
    assert Path(c.settings.metadata_path).exists()
    again = Coordinator(settings(tmp_path, checkpoint_interval=0))
    again.start()
    try:
        assert again.stats().num_keys == 1
        assert again.get_default_quota() == 2 * GIB
        status = again.status()
        assert status.restored is True
        assert status.last_checkpoint_time is not None
        assert status.started_at is not None
        assert again.eviction.is_ready() is False  # readiness re-armed after restore
    finally:
        again.stop()


def test_quota_change_is_on_disk_before_the_call_returns(tmp_path: Path) -> None:
    """The metadata file holds 1073741824 right after set_quota."""
    c = Coordinator(settings(tmp_path))
    c.set_quota("t", GIB)
    doc = json.loads(Path(c.settings.metadata_path).read_text())
    assert doc["components"]["quotas"]["limits"] == {"t": 1073741824}
    c.pin_keys([key(1)])
    doc = json.loads(Path(c.settings.metadata_path).read_text())
    assert len(doc["components"]["pins"]["entries"]) == 1


def test_nothing_configured_creates_no_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    c = Coordinator(settings())
    c.start()
    c.ingest(Stream().store([key(1)]))
    c.set_quota("", 1)
    c.stop()
    assert list(tmp_path.iterdir()) == []


def test_periodic_checkpoint_timer_writes_the_file(tmp_path: Path) -> None:
    """With an interval the checkpoint is rewritten in the background."""
    from tests.support.waiting import wait_until

    c = Coordinator(settings(tmp_path, checkpoint_interval=0.02))
    c.start()
    try:
        c.ingest(Stream().store([key(1)]))
        assert wait_until(lambda: Path(c.settings.checkpoint_path).exists())
    finally:
        c.stop()


def test_checkpoint_releases_copy_on_write_after_writing(tmp_path: Path) -> None:
    """Kvmesh: once written, the capture is dropped and shards stop being copied on write."""
    c = populated(tmp_path)
    assert c.checkpoint_now().ok is True
    assert not any(c.directory._st.store.frozen)
    assert all(not b.frozen for b in c.lru._salts.values())


def test_overlapping_snapshots_keep_shards_frozen_until_all_are_released() -> None:
    """Kvmesh: an eviction snapshot released during a checkpoint write cannot unfreeze it."""
    c = populated()
    cap = c.lru.capture()
    frozen = copy.deepcopy(cap)
    c.set_quota("", 0)
    assert c.plan_eviction() != {}  # took and released its own snapshot
    c.ingest(Stream("node-a", incarnation=7, seq=50).store([key(1), key(5)], tier=Tier.L2))
    assert cap == frozen
    c.lru.release_capture()
    assert all(not b.frozen for b in c.lru._salts.values())


def test_stop_without_load_does_not_overwrite_the_checkpoint(tmp_path: Path) -> None:
    """Kvmesh: an instance that never loaded state must not replace a good checkpoint."""
    c = populated(tmp_path)
    assert c.checkpoint_now().ok is True
    before = Path(c.settings.checkpoint_path).read_bytes()
    Coordinator(settings(tmp_path)).stop()
    assert Path(c.settings.checkpoint_path).read_bytes() == before
