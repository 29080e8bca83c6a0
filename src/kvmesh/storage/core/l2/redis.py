"""L2 in a Redis or Valkey server: one string value per object.

Keys are ``object_name(key)``, prefixed with ``<key_prefix>@`` when a prefix
is set (LMCache's valkey naming), so a SCAN with the prefix lists exactly
this adapter's namespace. Only commands both Redis and Valkey have are used
(SET, GET, EXISTS, UNLINK, STRLEN, SCAN).

No torn object: SET replaces a value atomically, so a reader sees the old
value, the new one or nothing; a load also checks the value's length
against the buffer before copying, so a wrong-size value is a miss.

Timeouts: every socket connect is bounded by ``connect_timeout_s`` and every
read/write by ``op_timeout_s``; a connection error is retried ``retries``
times (default 1, which also replaces pooled connections that died while the
server restarted), then the call raises :class:`L2Unavailable`. A dead
server is therefore reported within ``(retries + 1) * op_timeout_s`` at the
worst (a refused connection: at once), never a hang; the pool reconnects on
its own when the server is back.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey, object_name, parse_object_name
from kvmesh.storage.core.l2.base import (
    L2Entry,
    L2Unavailable,
    L2Usage,
    check_get_args,
    check_put_items,
    usage_of,
)

logger = logging.getLogger(__name__)

# Objects per pipeline round trip, and the payload bytes one pipeline may carry,
# so a huge batch does not hold hundreds of MiB in one request buffer.
_PIPELINE_KEYS = 512
_PIPELINE_BYTES = 64 << 20
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


class RedisL2Adapter:
    """Blocking, thread-safe client of one Redis / Valkey server (see module docstring).

    ``capacity_bytes`` is declared, not enforced: a Redis pool is bounded by
    the server's ``maxmemory`` (a SET refused for memory is a per-item
    failure) and, when shared, by the coordinator's fleet eviction.
    ``ttl_s`` makes every stored object expire after that many seconds.
    """

    backend = "redis"

    def __init__(
        self,
        url: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        key_prefix: str = "",
        connect_timeout_s: float = 2.0,
        op_timeout_s: float = 5.0,
        max_connections: int = 16,
        retries: int = 1,
        capacity_bytes: int = 0,
        ttl_s: float | None = None,
        shared: bool = False,
    ) -> None:
        if "@" in key_prefix:
            raise InvalidArgument("key_prefix must not contain '@'", field="key_prefix")
        if connect_timeout_s <= 0 or op_timeout_s <= 0:
            raise InvalidArgument("timeouts must be > 0", field="op_timeout_s")
        if max_connections < 1:
            raise InvalidArgument("max_connections must be >= 1", field="max_connections")
        if retries < 0:
            raise InvalidArgument("retries must be >= 0", field="retries")
        if capacity_bytes < 0:
            raise InvalidArgument("capacity_bytes must be >= 0", field="capacity_bytes")
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidArgument("ttl_s must be > 0", field="ttl_s")
        self.shared = shared
        self.capacity_bytes = capacity_bytes
        self.key_prefix = key_prefix
        self._prefix = f"{key_prefix}@" if key_prefix else ""
        self._ttl_ms = int(ttl_s * 1000) if ttl_s is not None else None
        self._op_timeout_s = op_timeout_s
        self._closed = False
        self._close_lock = threading.Lock()
        conn_kwargs: dict[str, Any] = {
            "socket_connect_timeout": connect_timeout_s,
            "socket_timeout": op_timeout_s,
            "retry": Retry(ExponentialBackoff(cap=0.2, base=0.01), retries),
            "client_name": "kvmesh-l2",
        }
        if username is not None:
            conn_kwargs["username"] = username
        if password is not None:
            conn_kwargs["password"] = password
        # A blocking pool waits (up to the op timeout) for a free connection
        # instead of failing when more threads than max_connections call at once.
        if url is not None:
            pool = redis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=op_timeout_s, **conn_kwargs
            )
            self.endpoint = url.split("@")[-1]
        else:
            pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
                host=host,
                port=port,
                db=db,
                max_connections=max_connections,
                timeout=op_timeout_s,
                **conn_kwargs,
            )
            self.endpoint = f"{host}:{port}/{db}"
        self._pool = pool
        self._client: Any = redis.Redis(connection_pool=pool)
        self._redis_error: type[Exception] = redis.RedisError
        self._response_error: type[Exception] = redis.ResponseError

    # -- helpers ---------------------------------------------------------------------------

    def _name(self, key: ObjectKey) -> str:
        return self._prefix + object_name(key)

    def _check_open(self) -> None:
        if self._closed:
            raise L2Unavailable(f"redis L2 adapter {self.endpoint} is closed", reason="L2_CLOSED")

    def _unavailable(self, what: str, exc: Exception) -> L2Unavailable:
        return L2Unavailable(f"redis L2 {self.endpoint}: {what} failed: {exc}")

    def _run_pipeline(self, commands: list[tuple[str, tuple[Any, ...]]], what: str) -> list[Any]:
        """Run commands in non-transactional pipelines; per-command results or exceptions."""
        results: list[Any] = []
        try:
            for start in range(0, len(commands), _PIPELINE_KEYS):
                pipe = self._client.pipeline(transaction=False)
                for name, args in commands[start : start + _PIPELINE_KEYS]:
                    pipe.execute_command(name, *args)
                results.extend(pipe.execute(raise_on_error=False))
        except self._redis_error as exc:
            raise self._unavailable(what, exc) from exc
        # A connection-level failure inside a pipeline comes back as a result object.
        for result in results:
            if isinstance(result, self._redis_error) and not isinstance(
                result, self._response_error
            ):
                raise self._unavailable(what, result)
        return results

    # -- the L2Adapter contract ------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[ObjectKey, memoryview]]) -> list[bool]:
        """SET each object (atomic per key), pipelined; False where the server refused one."""
        views = check_put_items(items)
        self._check_open()
        results: list[bool] = []
        batch: list[tuple[str, tuple[Any, ...]]] = []
        batch_bytes = 0
        for (key, _), view in zip(items, views, strict=True):
            args: tuple[Any, ...] = (self._name(key), view)
            if self._ttl_ms is not None:
                args = (*args, "PX", self._ttl_ms)
            batch.append(("SET", args))
            batch_bytes += view.nbytes
            if batch_bytes >= _PIPELINE_BYTES:
                results.extend(self._put_batch(batch))
                batch, batch_bytes = [], 0
        if batch:
            results.extend(self._put_batch(batch))
        return results

    def _put_batch(self, batch: list[tuple[str, tuple[Any, ...]]]) -> list[bool]:
        out: list[bool] = []
        for (_, args), result in zip(batch, self._run_pipeline(batch, "SET"), strict=True):
            if isinstance(result, Exception):
                logger.warning("redis L2 %s refused SET %s: %s", self.endpoint, args[0], result)
                out.append(False)
            else:
                out.append(bool(result))
        return out

    def get_into(self, keys: Sequence[ObjectKey], outs: Sequence[memoryview]) -> list[bool]:
        """GET each object; copy it when its length equals the buffer's."""
        views = check_get_args(keys, outs)
        self._check_open()
        results: list[bool] = []
        # Bound a pipeline's reply bytes by the buffers' total, like puts.
        start = 0
        while start < len(keys):
            end, total = start, 0
            while end < len(keys) and (
                end == start or total + views[end].nbytes <= _PIPELINE_BYTES
            ):
                total += views[end].nbytes
                end += 1
            commands = [("GET", (self._name(k),)) for k in keys[start:end]]
            values = self._run_pipeline(commands, "GET")
            for key, view, value in zip(keys[start:end], views[start:end], values, strict=True):
                if value is None:
                    results.append(False)
                elif isinstance(value, Exception):
                    logger.warning("redis L2 %s: GET %s failed: %s", self.endpoint, key, value)
                    results.append(False)
                elif len(value) != view.nbytes:
                    logger.debug(
                        "redis L2 %s: %s holds %d bytes, buffer is %d",
                        self.endpoint,
                        key.describe(),
                        len(value),
                        view.nbytes,
                    )
                    results.append(False)
                else:
                    view[:] = value
                    results.append(True)
            start = end
        return results

    def contains(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Pipelined EXISTS per key."""
        self._check_open()
        results = self._run_pipeline([("EXISTS", (self._name(k),)) for k in keys], "EXISTS")
        return [not isinstance(r, Exception) and int(r) > 0 for r in results]

    def delete_many(self, keys: Sequence[ObjectKey]) -> int:
        """UNLINK in batches (freed in the server's background); returns the count removed."""
        self._check_open()
        names = [self._name(k) for k in keys]
        commands = [("UNLINK", tuple(names[i : i + 1000])) for i in range(0, len(names), 1000)]
        removed = 0
        for result in self._run_pipeline(commands, "UNLINK"):
            if isinstance(result, Exception):
                raise self._unavailable("UNLINK", result)
            removed += int(result)
        return removed

    def _scan_names(self) -> Iterator[list[bytes]]:
        pattern = _GLOB_SPECIAL.sub(r"\\\1", self._prefix) + "*"
        cursor: int | bytes = 0
        try:
            while True:
                cursor, names = self._client.scan(cursor=cursor, match=pattern, count=1000)
                if names:
                    yield list(names)
                if int(cursor) == 0:
                    return
        except self._redis_error as exc:
            raise self._unavailable("SCAN", exc) from exc

    def _scan_entries(self) -> Iterator[L2Entry]:
        skip = len(self._prefix)
        for names in self._scan_names():
            keys: list[ObjectKey] = []
            raw: list[bytes] = []
            for name in names:
                try:
                    keys.append(parse_object_name(name[skip:].decode()))
                except (InvalidArgument, UnicodeDecodeError):
                    # Not ours: another application, or another prefix that
                    # this prefix happens to start.
                    continue
                raw.append(name)
            # EXISTS beside STRLEN: STRLEN alone cannot tell a deleted key from
            # a 0-byte object.
            commands: list[tuple[str, tuple[Any, ...]]] = []
            for n in raw:
                commands += [("EXISTS", (n,)), ("STRLEN", (n,))]
            replies = self._run_pipeline(commands, "STRLEN")
            for i, key in enumerate(keys):
                exists, size = replies[2 * i], replies[2 * i + 1]
                if isinstance(exists, Exception) or isinstance(size, Exception):
                    continue  # not a string value: not ours
                if int(exists):
                    yield L2Entry(key, int(size))

    def iter_entries(self) -> Iterator[L2Entry]:
        """SCAN the prefix; each entry's size from STRLEN. O(objects) round trips / 1000."""
        self._check_open()
        return self._scan_entries()

    def usage(self) -> L2Usage:
        """Bytes and objects under the prefix (a full SCAN) and the declared capacity."""
        return usage_of(self.iter_entries(), self.capacity_bytes)

    def close(self) -> None:
        """Close the pool's connections; the server keeps the objects."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._pool.disconnect()
