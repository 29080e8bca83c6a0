"""A backend that dies or hangs makes calls raise L2Unavailable within the timeout, never hang.

The time bounds asserted here are liveness bounds (several times the
configured timeouts), there to catch a hang, not to measure speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvmesh.storage.core.l2.base import L2Adapter, L2Unavailable
from kvmesh.storage.core.l2.memory import MemoryL2Adapter, MemoryL2Pool
from tests.integration.storage.l2.l2_support import make_key, payload_for
from tests.support.ports import free_port
from tests.support.servers import ServerProcess
from tests.support.waiting import wait_until


def assert_unavailable_within(seconds: float, call: Callable[[], object]) -> None:
    start = time.monotonic()
    with pytest.raises(L2Unavailable):
        call()
    assert time.monotonic() - start < seconds


def every_call(adapter: L2Adapter) -> list[Callable[[], object]]:
    key = make_key(1)
    return [
        lambda: adapter.put_many([(key, memoryview(b"abc"))]),
        lambda: adapter.get_into([key], [memoryview(bytearray(3))]),
        lambda: adapter.contains([key]),
        lambda: adapter.delete_many([key]),
        lambda: list(adapter.iter_entries()),
        adapter.usage,
    ]


@pytest.fixture
def redis_adapter_on(
    redis_server_factory: Callable[[], ServerProcess],
) -> Iterator[tuple[ServerProcess, L2Adapter]]:
    from kvmesh.storage.core.l2.redis import RedisL2Adapter

    server = redis_server_factory()
    adapter = RedisL2Adapter(
        host=server.host, port=server.port, connect_timeout_s=1.0, op_timeout_s=1.0
    )
    yield server, adapter
    adapter.close()


def test_redis_killed_raises_unavailable_and_recovers_after_restart(
    redis_adapter_on: tuple[ServerProcess, L2Adapter],
) -> None:
    server, adapter = redis_adapter_on
    key = make_key(1)
    assert adapter.put_many([(key, memoryview(payload_for(key, 100)))]) == [True]
    server.kill()
    for call in every_call(adapter):
        assert_unavailable_within(5.0, call)
    server.start()  # same port; the data is gone (no persistence)

    def works() -> bool:
        try:
            return adapter.put_many([(key, memoryview(payload_for(key, 100)))]) == [True]
        except L2Unavailable:
            return False

    wait_until(works)
    out = bytearray(100)
    assert adapter.get_into([key], [memoryview(out)]) == [True]
    assert bytes(out) == payload_for(key, 100)


def test_redis_hung_server_times_out_instead_of_hanging(
    redis_adapter_on: tuple[ServerProcess, L2Adapter],
) -> None:
    server, adapter = redis_adapter_on
    key = make_key(1)
    assert adapter.put_many([(key, memoryview(b"abc"))]) == [True]
    server.pause()
    try:
        # op_timeout 1 s, one retry: about 2 s, never forever.
        assert_unavailable_within(8.0, lambda: adapter.contains([key]))
    finally:
        server.resume()
    wait_until(lambda: adapter.contains([key]) == [True])


def test_redis_nothing_listening_raises_unavailable_at_first_call() -> None:
    from kvmesh.storage.core.l2.redis import RedisL2Adapter

    adapter = RedisL2Adapter(host="127.0.0.1", port=free_port(), connect_timeout_s=1.0)
    try:
        for call in every_call(adapter):
            assert_unavailable_within(5.0, call)
    finally:
        adapter.close()


def test_s3_killed_raises_unavailable_fast(
    s3_server_factory: Callable[[], ServerProcess],
) -> None:
    from kvmesh.storage.core.l2.s3 import S3L2Adapter

    server = s3_server_factory()
    adapter = S3L2Adapter(
        "down-test",
        endpoint_url=server.url,
        access_key_id="testing",
        secret_access_key="testing",
        connect_timeout_s=1.0,
        read_timeout_s=2.0,
        create_bucket=True,
    )
    try:
        key = make_key(1)
        assert adapter.put_many([(key, memoryview(b"abc"))]) == [True]
        server.kill()
        for call in every_call(adapter):
            assert_unavailable_within(8.0, call)
    finally:
        adapter.close()


def test_memory_down_switch_raises_unavailable_and_keeps_objects() -> None:
    adapter = MemoryL2Adapter()
    key = make_key(1)
    assert adapter.put_many([(key, memoryview(b"abc"))]) == [True]
    adapter.set_down(True)
    for call in every_call(adapter):
        with pytest.raises(L2Unavailable):
            call()
    adapter.set_down(False)
    out = bytearray(3)
    assert adapter.get_into([key], [memoryview(out)]) == [True]
    assert out == b"abc"


def test_memory_adapters_sharing_a_pool_see_each_others_objects() -> None:
    pool = MemoryL2Pool()
    first, second = MemoryL2Adapter(pool=pool, shared=True), MemoryL2Adapter(pool=pool)
    key = make_key(1)
    assert first.put_many([(key, memoryview(b"abc"))]) == [True]
    first.close()
    assert second.contains([key]) == [True]
    assert second.usage().used_bytes == 3


def test_memory_capacity_refuses_puts_that_do_not_fit() -> None:
    adapter = MemoryL2Adapter(capacity_bytes=10)
    keys = [make_key(i) for i in range(3)]
    assert adapter.put_many([(k, memoryview(b"12345")) for k in keys]) == [True, True, False]
    assert adapter.usage().used_bytes == 10


def test_memory_latency_and_bandwidth_slow_calls_down() -> None:
    # Lower bounds only: the injected delay must be at least what was asked for.
    adapter = MemoryL2Adapter(latency_s=0.05, bandwidth_bytes_per_s=1_000_000)
    key = make_key(1)
    start = time.monotonic()
    adapter.put_many([(key, memoryview(bytes(100_000)))])
    assert time.monotonic() - start >= 0.05 + 0.1
    start = time.monotonic()
    adapter.contains([key])
    assert time.monotonic() - start >= 0.05
