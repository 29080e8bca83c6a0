"""Disk (and NIXL, same file format) adapter: torn, foreign and crashed writes are never served."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.common.keys import object_name
from kvmesh.storage.core.l2.base import L2Entry, L2Unavailable
from kvmesh.storage.core.l2.disk import DiskL2Adapter
from kvmesh.storage.core.l2.disk_format import (
    OBJECT_SUFFIX,
    PAYLOAD_OFFSET,
    TEMP_PREFIX,
    encode_header,
    file_name_for,
)
from tests.integration.storage.l2.conftest import require_nixl
from tests.integration.storage.l2.l2_support import make_key, payload_for, size_for

REPO_ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "l2"


@pytest.fixture
def opened() -> Iterator[list[DiskL2Adapter]]:
    adapters: list[DiskL2Adapter] = []
    yield adapters
    for adapter in adapters:
        adapter.close()


def open_disk(path: Path, opened: list[DiskL2Adapter], **kwargs: object) -> DiskL2Adapter:
    adapter = DiskL2Adapter(path, **kwargs)  # type: ignore[arg-type]
    opened.append(adapter)
    return adapter


def object_path(base: Path, i: int) -> Path:
    key = make_key(i)
    return base / key.chunk_hash[:1].hex() / file_name_for(object_name(key))


def load(adapter: DiskL2Adapter, i: int, size: int) -> bytes | None:
    out = bytearray(size)
    ok = adapter.get_into([make_key(i)], [memoryview(out)])[0]
    return bytes(out) if ok else None


def store_objects(adapter: DiskL2Adapter, ids: range, size: int = 10_000) -> None:
    items = [(make_key(i), memoryview(payload_for(make_key(i), size))) for i in ids]
    assert all(adapter.put_many(items))


def test_objects_are_files_named_by_object_name(store: Path, opened: list[DiskL2Adapter]) -> None:
    adapter = open_disk(store, opened)
    store_objects(adapter, range(1))
    path = object_path(store, 0)
    assert path.name == object_name(make_key(0)) + OBJECT_SUFFIX
    assert path.stat().st_size == PAYLOAD_OFFSET + 10_000 + 16
    assert path.read_bytes()[PAYLOAD_OFFSET:-16] == payload_for(make_key(0), 10_000)


def test_truncated_object_is_never_served_and_is_removed(
    store: Path, opened: list[DiskL2Adapter]
) -> None:
    adapter = open_disk(store, opened)
    store_objects(adapter, range(2))
    os.truncate(object_path(store, 0), PAYLOAD_OFFSET + 5000)
    assert load(adapter, 0, 10_000) is None
    assert not object_path(store, 0).exists()
    assert adapter.contains([make_key(0), make_key(1)]) == [False, True]
    assert adapter.usage().object_count == 1


def test_torn_files_and_temp_files_are_removed_at_reopen(
    store: Path, opened: list[DiskL2Adapter]
) -> None:
    adapter = open_disk(store, opened)
    store_objects(adapter, range(4))
    adapter.close()
    os.truncate(object_path(store, 0), PAYLOAD_OFFSET + 10)  # torn payload
    os.truncate(object_path(store, 1), 20)  # torn header
    with object_path(store, 2).open("r+b") as f:  # complete size, trailer never written
        f.seek(-16, os.SEEK_END)
        f.write(bytes(16))
    leftover = object_path(store, 3).parent / f"{TEMP_PREFIX}crashed"
    leftover.write_bytes(b"half an object")
    reopened = open_disk(store, opened)
    assert [e.key for e in reopened.iter_entries()] == [make_key(3)]
    assert load(reopened, 3, 10_000) == payload_for(make_key(3), 10_000)
    assert not leftover.exists()
    for i in range(3):
        assert not object_path(store, i).exists()
        assert load(reopened, i, 10_000) is None


def test_foreign_files_with_the_object_suffix_are_removed_and_others_kept(
    store: Path, opened: list[DiskL2Adapter]
) -> None:
    open_disk(store, opened).close()
    sub = store / "ab"
    sub.mkdir(exist_ok=True)
    foreign = sub / f"not-ours{OBJECT_SUFFIX}"
    foreign.write_bytes(b"x" * 5000)
    unrelated = sub / "README"
    unrelated.write_text("operator notes")
    adapter = open_disk(store, opened)
    assert list(adapter.iter_entries()) == []
    assert not foreign.exists()
    assert unrelated.exists()


def test_object_copied_under_another_keys_name_is_rejected(
    store: Path, opened: list[DiskL2Adapter]
) -> None:
    adapter = open_disk(store, opened)
    store_objects(adapter, range(1))
    adapter.close()
    impostor = object_path(store, 1)
    impostor.parent.mkdir(exist_ok=True)
    shutil.copy(object_path(store, 0), impostor)
    reopened = open_disk(store, opened)
    assert reopened.contains([make_key(0), make_key(1)]) == [True, False]
    assert not impostor.exists()


def test_damaged_payload_fails_its_checksum_and_is_removed(
    store: Path, opened: list[DiskL2Adapter]
) -> None:
    adapter = open_disk(store, opened)
    store_objects(adapter, range(1))
    with object_path(store, 0).open("r+b") as f:
        f.seek(PAYLOAD_OFFSET + 1234)
        f.write(b"\x00\xff")
    assert load(adapter, 0, 10_000) is None
    assert adapter.contains([make_key(0)]) == [False]
    assert not object_path(store, 0).exists()


def test_damaged_payload_is_served_when_checksums_are_off(
    store: Path, opened: list[DiskL2Adapter]
) -> None:
    # Pins what verify_checksum=False trades away: size and framing are still checked.
    adapter = open_disk(store, opened, verify_checksum=False)
    store_objects(adapter, range(1))
    with object_path(store, 0).open("r+b") as f:
        f.seek(PAYLOAD_OFFSET)
        f.write(b"\x00")
    assert load(adapter, 0, 10_000) is not None


def test_second_adapter_on_the_same_directory_is_refused(
    store: Path, opened: list[DiskL2Adapter]
) -> None:
    first = open_disk(store, opened)
    with pytest.raises(L2Unavailable) as err:
        DiskL2Adapter(store)
    assert err.value.reason == "L2_PATH_LOCKED"
    first.close()
    open_disk(store, opened)


def test_capacity_bound_refuses_puts_that_do_not_fit(
    store: Path, opened: list[DiskL2Adapter]
) -> None:
    adapter = open_disk(store, opened, capacity_bytes=25_000)
    keys = [make_key(i) for i in range(3)]
    items = [(k, memoryview(payload_for(k, 10_000))) for k in keys]
    assert adapter.put_many(items) == [True, True, False]
    assert adapter.put_many(items[:1]) == [True]  # overwrite needs no new room
    assert adapter.usage().used_bytes == 20_000
    adapter.delete_many(keys[:1])
    assert adapter.put_many(items[2:]) == [True]
    assert sorted(f.name for f in store.rglob(f"{TEMP_PREFIX}*")) == []


def test_long_model_names_get_a_hashed_file_name_and_round_trip(
    store: Path, opened: list[DiskL2Adapter]
) -> None:
    adapter = open_disk(store, opened)
    key = make_key(1, model="org/" + "m" * 500, salt="s" * 128)
    assert adapter.put_many([(key, memoryview(payload_for(key, 100)))]) == [True]
    files = list(store.rglob(f"*{OBJECT_SUFFIX}"))
    assert len(files) == 1
    assert files[0].name.startswith("h-")
    adapter.close()
    reopened = open_disk(store, opened)
    assert list(reopened.iter_entries()) == [L2Entry(key, 100)]
    out = bytearray(100)
    assert reopened.get_into([key], [memoryview(out)]) == [True]
    assert bytes(out) == payload_for(key, 100)


def test_header_describes_the_payload(store: Path, opened: list[DiskL2Adapter]) -> None:
    adapter = open_disk(store, opened)
    store_objects(adapter, range(1))
    raw = object_path(store, 0).read_bytes()
    name = object_name(make_key(0)).encode()
    import zlib

    expected = encode_header(name, 10_000, zlib.crc32(payload_for(make_key(0), 10_000)))
    assert raw[:PAYLOAD_OFFSET] == expected


def test_nixl_and_disk_adapters_read_each_others_objects(
    store: Path, opened: list[DiskL2Adapter]
) -> None:
    require_nixl()
    from kvmesh.storage.core.l2.nixl import NixlL2Adapter

    nixl = NixlL2Adapter(store)
    opened.append(nixl)
    store_objects(nixl, range(0, 3), size=70_000)
    nixl.close()
    disk = open_disk(store, opened)
    assert load(disk, 1, 70_000) == payload_for(make_key(1), 70_000)
    store_objects(disk, range(3, 5), size=70_000)
    disk.close()
    nixl = NixlL2Adapter(store)
    opened.append(nixl)
    assert {e.key for e in nixl.iter_entries()} == {make_key(i) for i in range(5)}
    assert load(nixl, 4, 70_000) == payload_for(make_key(4), 70_000)


CRASH_WRITER = textwrap.dedent(
    """
    import sys
    from kvmesh.storage.core.l2.disk import DiskL2Adapter
    from tests.integration.storage.l2.l2_support import make_key, payload_for, size_for

    adapter = DiskL2Adapter(sys.argv[1])
    for i in range(100_000):
        key = make_key(i)
        assert adapter.put_many([(key, memoryview(payload_for(key, size_for(i))))]) == [True]
        print(i, flush=True)
    """
)


@pytest.mark.parametrize("kill_after", [5, 23])
def test_crash_mid_write_leaves_only_whole_objects(
    store: Path, tmp_path: Path, kill_after: int
) -> None:
    errors = tmp_path / "writer.stderr"
    with errors.open("wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", CRASH_WRITER, str(store)],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    assert child.stdout is not None
    acknowledged = -1
    try:
        deadline = time.monotonic() + 60
        while acknowledged < kill_after:
            assert time.monotonic() < deadline, "writer made no progress"
            ready, _, _ = select.select([child.stdout], [], [], 1.0)
            if ready:
                line = child.stdout.readline()
                assert line, f"writer died: {errors.read_text(errors='replace')}"
                acknowledged = int(line)
        child.send_signal(signal.SIGKILL)  # while it is inside its next put
    finally:
        child.kill()
        child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL

    adapter = DiskL2Adapter(store)
    try:
        entries = {e.key: e.size_bytes for e in adapter.iter_entries()}
        # Puts are sequential and each is durable before the next begins, so what
        # survives is exactly objects 0..m, with every acknowledged one among them.
        assert len(entries) >= acknowledged + 1
        assert entries == {make_key(i): size_for(i) for i in range(len(entries))}
        for key, size in entries.items():
            out = bytearray(size)
            assert adapter.get_into([key], [memoryview(out)]) == [True]
            assert bytes(out) == payload_for(key, size)
        assert list(store.rglob(f"{TEMP_PREFIX}*")) == []
    finally:
        adapter.close()


def test_a_node_answers_misses_from_its_disk_index_and_finds_what_it_listed(
    store: Path, tmp_path: Path, opened: list[DiskL2Adapter]
) -> None:
    """The directory is locked to one adapter, so the node's index of it is complete:
    objects there at start are found, a chunk that is not there is a miss at once."""
    from kvmesh.storage.core.manager import StorageManager
    from kvmesh.storage.core.options import StorageOptions

    assert not open_disk(tmp_path / "shared", opened, shared=True).sole_writer
    earlier = open_disk(store, opened)
    store_objects(earlier, range(0, 2), size=10_000)
    earlier.close()
    shm = tmp_path / "shm"
    shm.mkdir()
    options = StorageOptions(segment_bytes=4 << 20, shm_dir=str(shm), initial_l1_bytes=4 << 20)
    disk = DiskL2Adapter(store)
    assert disk.sole_writer
    manager = StorageManager("node", 4 << 20, l2_adapters=[disk], options=options)
    try:
        assert manager.wait_l2_index(10)
        keys = [make_key(i) for i in range(4)]
        handle = manager.submit_prefetch("r", [keys], 1, row_nbytes=[10_000])
        assert manager.wait_prefetch(handle, 10)
        result = manager.query_prefetch(handle)
        assert result is not None
        assert result.hit_chunks == 2  # listed at start, loaded from disk
        assert result.l2_hit_cells == 2
        manager.finish_read(keys[:2])
        miss = manager.submit_prefetch("r2", [[make_key(9)]], 1, row_nbytes=[10_000])
        assert manager.query_prefetch(miss) is not None  # complete when submit returned
        assert manager.status()["prefetch"]["completed_by_index"] == 1
    finally:
        manager.close()
