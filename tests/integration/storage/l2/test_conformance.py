"""The L2 adapter contract, checked identically for every adapter against its real backend.

Decision pinned here: a 0-byte object is a valid object (stored, listed with
size 0, loaded into a 0-byte buffer), so no adapter special-cases it.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l2.base import L2Adapter, L2Entry, L2Unavailable
from tests.integration.storage.l2.conftest import AdapterCase
from tests.integration.storage.l2.l2_support import make_key, payload_for

SENTINEL = 0xA5
SIZES = [0, 1, 4097, (1 << 20) + 3]


def put(adapter: L2Adapter, key: ObjectKey, data: bytes) -> None:
    assert adapter.put_many([(key, memoryview(data))]) == [True]


def get(adapter: L2Adapter, key: ObjectKey, size: int) -> bytes | None:
    out = bytearray([SENTINEL]) * size
    (ok,) = adapter.get_into([key], [memoryview(out)])
    return bytes(out) if ok else None


def test_adapter_satisfies_the_protocol(l2: L2Adapter, l2_case: AdapterCase) -> None:
    assert isinstance(l2, L2Adapter)
    assert l2.backend == l2_case.kind
    assert l2.shared is False


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_returns_the_stored_bytes(l2: L2Adapter, size: int) -> None:
    key = make_key(size)
    data = payload_for(key, size)
    put(l2, key, data)
    assert get(l2, key, size) == data


def test_round_trip_of_a_32_mib_object(l2: L2Adapter) -> None:
    key = make_key(32)
    data = payload_for(key, 32 << 20)
    put(l2, key, data)
    out = np.zeros(32 << 20, dtype=np.uint8)
    assert l2.get_into([key], [out.data]) == [True]
    assert out.tobytes() == data


def test_batch_put_and_get_report_per_item_results(l2: L2Adapter) -> None:
    keys = [make_key(i) for i in range(6)]
    stored = keys[::2]
    assert l2.put_many([(k, memoryview(payload_for(k, 1000 + i))) for i, k in enumerate(stored)])
    outs = [bytearray(1000 + i // 2) for i in range(6)]
    assert l2.get_into(keys, [memoryview(o) for o in outs]) == [True, False] * 3
    for i, key in enumerate(stored):
        assert bytes(outs[2 * i]) == payload_for(key, 1000 + i)


def test_missing_key_is_a_miss_and_leaves_the_buffer_untouched(l2: L2Adapter) -> None:
    out = bytearray([SENTINEL]) * 4096
    assert l2.get_into([make_key(1)], [memoryview(out)]) == [False]
    assert out == bytearray([SENTINEL]) * 4096


@pytest.mark.parametrize("buffer_size", [4095, 4097, 0])
def test_size_mismatch_is_a_miss_and_leaves_the_buffer_untouched(
    l2: L2Adapter, buffer_size: int
) -> None:
    key = make_key(1)
    put(l2, key, payload_for(key, 4096))
    out = bytearray([SENTINEL]) * buffer_size
    assert l2.get_into([key], [memoryview(out)]) == [False]
    assert out == bytearray([SENTINEL]) * buffer_size
    assert get(l2, key, 4096) == payload_for(key, 4096)


def test_buffers_of_any_item_size_are_read_and_written_as_bytes(l2: L2Adapter) -> None:
    key = make_key(1)
    source = np.arange(512, dtype=np.float16)  # 1024 bytes, item size 2
    assert l2.put_many([(key, source.data)]) == [True]
    out = np.zeros(512, dtype=np.float16)
    assert l2.get_into([key], [out.data]) == [True]
    assert np.array_equal(out, source)


def test_contains_reports_presence_per_key(l2: L2Adapter) -> None:
    keys = [make_key(i) for i in range(4)]
    put(l2, keys[1], b"x")
    put(l2, keys[3], b"")
    assert l2.contains(keys) == [False, True, False, True]
    assert l2.contains([]) == []


def test_overwrite_is_idempotent_and_the_last_write_wins(l2: L2Adapter) -> None:
    key = make_key(1)
    data = payload_for(key, 3000)
    put(l2, key, data)
    put(l2, key, data)
    assert get(l2, key, 3000) == data
    assert l2.usage().object_count == 1
    assert l2.usage().used_bytes == 3000
    put(l2, key, data[:1000])
    assert get(l2, key, 1000) == data[:1000]
    assert get(l2, key, 3000) is None
    assert list(l2.iter_entries()) == [L2Entry(key, 1000)]


def test_delete_is_idempotent_and_counts_only_existing_objects(l2: L2Adapter) -> None:
    keys = [make_key(i) for i in range(5)]
    for key in keys[:3]:
        put(l2, key, payload_for(key, 100))
    assert l2.delete_many([keys[0], keys[1], keys[4]]) == 2
    assert l2.delete_many([keys[0], keys[1], keys[4]]) == 0
    assert l2.delete_many([]) == 0
    assert l2.contains(keys) == [False, False, True, False, False]
    assert get(l2, keys[0], 100) is None
    assert get(l2, keys[2], 100) == payload_for(keys[2], 100)


def test_iter_entries_lists_exactly_what_is_stored_with_sizes(l2: L2Adapter) -> None:
    assert list(l2.iter_entries()) == []
    stored = {make_key(i): 10 * i for i in range(12)}  # includes a 0-byte object
    assert all(l2.put_many([(k, memoryview(payload_for(k, n))) for k, n in stored.items()]))
    l2.delete_many([make_key(5)])
    del stored[make_key(5)]
    entries = list(l2.iter_entries())
    assert len(entries) == len(stored)
    assert {e.key: e.size_bytes for e in entries} == stored


def test_usage_counts_bytes_and_objects_and_reports_capacity(l2: L2Adapter) -> None:
    assert (l2.usage().used_bytes, l2.usage().object_count) == (0, 0)
    for i in range(4):
        key = make_key(i)
        put(l2, key, payload_for(key, 1000 * (i + 1)))
    usage = l2.usage()
    assert (usage.used_bytes, usage.object_count) == (10_000, 4)
    assert usage.capacity_bytes == 1 << 40
    l2.delete_many([make_key(3)])
    assert (l2.usage().used_bytes, l2.usage().object_count) == (6000, 3)


@pytest.mark.parametrize(
    "other",
    [
        {"salt": "tenant-b"},
        {"kv_rank": 0x01010101},
        {"group": 1},
        {"model": "org-model-a"},
        {"model": "org/model-a/v2"},
    ],
    ids=["cache_salt", "kv_rank", "object_group_id", "model_without_slash", "longer_model"],
)
def test_keys_differing_in_one_field_are_distinct_objects(
    l2: L2Adapter, other: dict[str, object]
) -> None:
    base = make_key(1, salt="tenant-a")
    fields = {"salt": "tenant-a", **other}
    variant = make_key(1, **fields)  # type: ignore[arg-type]
    put(l2, base, payload_for(base, 512))
    assert l2.contains([variant]) == [False]
    assert get(l2, variant, 512) is None
    put(l2, variant, payload_for(variant, 512))
    assert get(l2, base, 512) == payload_for(base, 512)
    assert get(l2, variant, 512) == payload_for(variant, 512)
    assert {e.key for e in l2.iter_entries()} == {base, variant}
    assert l2.delete_many([variant]) == 1
    assert l2.contains([base, variant]) == [True, False]


def test_concurrent_puts_and_gets_from_several_threads(l2: L2Adapter) -> None:
    threads_n, per_thread = 4, 16
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads_n)

    def worker(t: int) -> None:
        try:
            barrier.wait(timeout=30)
            for i in range(per_thread):
                key = make_key(t * 1000 + i)
                size = 2048 + 97 * i
                assert l2.put_many([(key, memoryview(payload_for(key, size)))]) == [True]
                # Everyone also reads a key every thread writes (overwrites of equal content).
                shared = make_key(999_999)
                assert l2.put_many([(shared, memoryview(payload_for(shared, 4096)))]) == [True]
                assert get(l2, key, size) == payload_for(key, size)
                assert get(l2, shared, 4096) == payload_for(shared, 4096)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert l2.usage().object_count == threads_n * per_thread + 1


def test_reopen_keeps_objects_only_on_persistent_backends(l2_case: AdapterCase) -> None:
    first = l2_case.open()
    key = make_key(1)
    put(first, key, payload_for(key, 5000))
    first.close()
    second = l2_case.open()
    if l2_case.persistent:
        assert get(second, key, 5000) == payload_for(key, 5000)
        assert list(second.iter_entries()) == [L2Entry(key, 5000)]
    else:
        assert get(second, key, 5000) is None
        assert list(second.iter_entries()) == []


def test_closed_adapter_raises_unavailable(l2: L2Adapter) -> None:
    key = make_key(1)
    put(l2, key, b"abc")
    l2.close()
    l2.close()  # idempotent
    with pytest.raises(L2Unavailable):
        l2.put_many([(key, memoryview(b"abc"))])
    with pytest.raises(L2Unavailable):
        l2.get_into([key], [memoryview(bytearray(3))])
    with pytest.raises(L2Unavailable):
        l2.contains([key])
    with pytest.raises(L2Unavailable):
        l2.delete_many([key])
    with pytest.raises(L2Unavailable):
        list(l2.iter_entries())


def test_invalid_arguments_are_rejected_before_anything_is_written(l2: L2Adapter) -> None:
    good = make_key(1)
    bad = ObjectKey(b"short", "m", 0)
    with pytest.raises(InvalidArgument) as err:
        l2.put_many([(good, memoryview(b"a")), (bad, memoryview(b"b"))])
    assert err.value.field == "items[1].key.chunk_hash"
    assert l2.contains([good]) == [False]
    with pytest.raises(InvalidArgument):
        l2.get_into([good], [])
    with pytest.raises(InvalidArgument):
        l2.get_into([good], [memoryview(b"read-only")])
