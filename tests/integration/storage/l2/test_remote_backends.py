"""Redis and S3 specifics: key naming on the server, foreign keys, batching limits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvmesh.common.keys import object_name
from kvmesh.storage.core.l2.base import L2Entry
from tests.integration.storage.l2.l2_support import make_key, payload_for
from tests.support.servers import ServerProcess


@pytest.fixture
def redis_client(redis_server: ServerProcess) -> Iterator[object]:
    import redis

    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    yield client
    client.close()


def test_redis_values_are_stored_under_prefix_at_object_name(
    redis_server: ServerProcess, redis_client: object
) -> None:
    import redis

    from kvmesh.storage.core.l2.redis import RedisL2Adapter

    assert isinstance(redis_client, redis.Redis)
    adapter = RedisL2Adapter(redis_server.url, key_prefix="naming")
    try:
        key = make_key(1)
        adapter.put_many([(key, memoryview(payload_for(key, 64)))])
        assert redis_client.get(f"naming@{object_name(key)}") == payload_for(key, 64)
    finally:
        adapter.delete_many([make_key(1)])
        adapter.close()


def test_redis_listing_skips_foreign_keys_and_other_prefixes(
    redis_server: ServerProcess, redis_client: object
) -> None:
    import redis

    from kvmesh.storage.core.l2.redis import RedisL2Adapter

    assert isinstance(redis_client, redis.Redis)
    mine = RedisL2Adapter(host=redis_server.host, port=redis_server.port, key_prefix="p[1]")
    other = RedisL2Adapter(host=redis_server.host, port=redis_server.port, key_prefix="p[1]x")
    try:
        key = make_key(1)
        mine.put_many([(key, memoryview(b"mine"))])
        other.put_many([(make_key(2), memoryview(b"other"))])
        redis_client.set("p[1]@not-an-object-name", b"junk")
        redis_client.hset("p[1]@" + object_name(make_key(3)), "field", "a hash, not a string")
        assert list(mine.iter_entries()) == [L2Entry(key, 4)]
        assert mine.usage().object_count == 1
    finally:
        redis_client.delete("p[1]@not-an-object-name", "p[1]@" + object_name(make_key(3)))
        mine.delete_many([make_key(1)])
        other.delete_many([make_key(2)])
        mine.close()
        other.close()


def test_redis_ttl_makes_objects_expire(redis_server: ServerProcess, redis_client: object) -> None:
    import redis

    from kvmesh.storage.core.l2.redis import RedisL2Adapter

    assert isinstance(redis_client, redis.Redis)
    adapter = RedisL2Adapter(redis_server.url, key_prefix="ttl", ttl_s=60)
    try:
        key = make_key(1)
        adapter.put_many([(key, memoryview(b"x"))])
        ttl_ms = redis_client.pttl(f"ttl@{object_name(key)}")
        assert isinstance(ttl_ms, int)
        assert 0 < ttl_ms <= 60_000
    finally:
        adapter.delete_many([make_key(1)])
        adapter.close()


def test_s3_listing_paginates_and_deletes_in_bounded_batches(
    s3_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvmesh.storage.core.l2 import s3
    from kvmesh.storage.core.l2.s3 import S3L2Adapter

    # Small limits so a few dozen objects span several pages and delete requests
    # (the real limits are S3's 1000; moto is too slow for thousands of PUTs).
    monkeypatch.setattr(s3, "_LIST_PAGE_SIZE", 7)
    monkeypatch.setattr(s3, "_DELETE_BATCH", 5)
    calls: list[int] = []
    adapter = S3L2Adapter(
        "kvmesh-l2-many",
        endpoint_url=s3_server.url,
        access_key_id="testing",
        secret_access_key="testing",
        prefix="many/",
        create_bucket=True,
    )
    real_delete = adapter._client.delete_objects

    def counting_delete(**kwargs: Any) -> Any:
        calls.append(len(kwargs["Delete"]["Objects"]))
        return real_delete(**kwargs)

    monkeypatch.setattr(adapter._client, "delete_objects", counting_delete)
    try:
        keys = [make_key(i) for i in range(33)]
        assert all(adapter.put_many([(k, memoryview(b"%d" % i)) for i, k in enumerate(keys)]))
        entries = list(adapter.iter_entries())
        assert len(entries) == 33
        assert {e.key for e in entries} == set(keys)
        assert adapter.delete_many([*keys, make_key(5000)]) == 33
        assert calls == [5] * 6 + [3]
        assert list(adapter.iter_entries()) == []
    finally:
        adapter.close()


def test_s3_objects_are_named_prefix_plus_object_name(s3_server: ServerProcess) -> None:
    import boto3

    from kvmesh.storage.core.l2.s3 import S3L2Adapter

    adapter = S3L2Adapter(
        "kvmesh-l2-naming",
        endpoint_url=s3_server.url,
        access_key_id="testing",
        secret_access_key="testing",
        prefix="node-a/",
        create_bucket=True,
    )
    raw = boto3.client(
        "s3",
        endpoint_url=s3_server.url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    try:
        key = make_key(1)
        adapter.put_many([(key, memoryview(b"payload"))])
        body = raw.get_object(Bucket="kvmesh-l2-naming", Key=f"node-a/{object_name(key)}")["Body"]
        assert body.read() == b"payload"
        raw.put_object(Bucket="kvmesh-l2-naming", Key="node-a/foreign.txt", Body=b"x")
        assert list(adapter.iter_entries()) == [L2Entry(key, 7)]
    finally:
        adapter.close()
        raw.close()
