"""L2 in an S3 (or S3-compatible) bucket: one S3 object per L2 object, via boto3.

Object keys are ``<prefix><object_name(key)>``. A batch is spread over a
small thread pool (boto3 clients are thread-safe) so N objects cost about
one round trip per ``io_threads``, not N.

No torn object: an S3 PUT is atomic (readers see the whole old object, the
whole new one, or none), boto3 sends a CRC32 of the body that the server
checks, and a load compares ``ContentLength`` with the buffer before
reading and the bytes actually read with it afterwards; a short read is a
miss, never a load.

Timeouts: connect and read timeouts bound every attempt and
``max_attempts`` bounds the attempts (standard retry mode, jittered backoff
under a second for the second attempt), so a dead endpoint raises
:class:`L2Unavailable` within about ``max_attempts * connect_timeout_s`` (a
refused connection: well under a second per attempt).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import boto3
import botocore.exceptions
from botocore.config import Config

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

_T = TypeVar("_T")
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_DELETE_BATCH = 1000  # the S3 DeleteObjects limit
_LIST_PAGE_SIZE = 1000  # the S3 ListObjectsV2 maximum
_SESSION_LOCK = threading.Lock()
_SESSION: boto3.session.Session | None = None


def _shared_session() -> boto3.session.Session:
    global _SESSION  # noqa: PLW0603 - one lazily built session per process
    if _SESSION is None:
        _SESSION = boto3.session.Session()
    return _SESSION


class S3L2Adapter:
    """Blocking, thread-safe client of one bucket (see the module docstring).

    ``capacity_bytes`` is declared, not enforced: a bucket has no natural
    bound, and a shared one is bounded by the coordinator's fleet eviction.
    ``create_bucket=True`` creates a missing bucket at construction (handy
    with a local MinIO or moto; leave it off against real AWS).
    """

    backend = "s3"

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        prefix: str = "",
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 10.0,
        max_attempts: int = 2,
        max_pool_connections: int = 16,
        io_threads: int = 8,
        addressing_style: str | None = None,
        capacity_bytes: int = 0,
        create_bucket: bool = False,
        shared: bool = False,
    ) -> None:
        if not bucket:
            raise InvalidArgument("bucket must not be empty", field="bucket")
        if connect_timeout_s <= 0 or read_timeout_s <= 0:
            raise InvalidArgument("timeouts must be > 0", field="read_timeout_s")
        if max_attempts < 1:
            raise InvalidArgument("max_attempts must be >= 1", field="max_attempts")
        if max_pool_connections < 1 or io_threads < 1:
            raise InvalidArgument(
                "max_pool_connections and io_threads must be >= 1", field="io_threads"
            )
        if capacity_bytes < 0:
            raise InvalidArgument("capacity_bytes must be >= 0", field="capacity_bytes")
        if addressing_style not in (None, "auto", "path", "virtual"):
            raise InvalidArgument(
                "addressing_style must be auto, path or virtual", field="addressing_style"
            )
        self.shared = shared
        self.capacity_bytes = capacity_bytes
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint = endpoint_url or f"s3.{region}"
        # A custom endpoint (MinIO, moto, Ceph) rarely has wildcard DNS for
        # virtual-hosted buckets; path style works everywhere.
        style = addressing_style or ("path" if endpoint_url else "auto")
        config = Config(
            region_name=region,
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            max_pool_connections=max(max_pool_connections, io_threads),
            s3={"addressing_style": style},
        )
        with _SESSION_LOCK:
            # One shared session: it caches the parsed service models, which
            # makes a second client cheap; client creation is not thread-safe.
            self._client: Any = _shared_session().client(
                "s3",
                endpoint_url=endpoint_url,
                aws_access_key_id=access_key_id,
                aws_secret_access_key=secret_access_key,
                aws_session_token=session_token,
                config=config,
            )
        self._client_error: type[Exception] = botocore.exceptions.ClientError
        self._botocore_error: type[Exception] = botocore.exceptions.BotoCoreError
        self._executor = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvmesh-s3")
        self._closed = False
        self._close_lock = threading.Lock()
        if create_bucket:
            self._create_bucket(region)

    # -- helpers ---------------------------------------------------------------------------

    def _create_bucket(self, region: str) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except self._client_error as exc:
            if _error_code(exc) not in _MISSING_CODES | {"NoSuchBucket"}:
                raise self._unavailable("head_bucket", exc) from exc
        except self._botocore_error as exc:
            raise self._unavailable("head_bucket", exc) from exc
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        self._call("create_bucket", lambda: self._client.create_bucket(**kwargs))

    def _name(self, key: ObjectKey) -> str:
        return self.prefix + object_name(key)

    def _check_open(self) -> None:
        if self._closed:
            raise L2Unavailable(f"s3 L2 adapter {self.bucket} is closed", reason="L2_CLOSED")

    def _unavailable(self, what: str, exc: Exception) -> L2Unavailable:
        return L2Unavailable(f"s3 L2 {self.endpoint}/{self.bucket}: {what} failed: {exc}")

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run one boto3 call, turning transport and server failures into L2Unavailable."""
        try:
            return fn()
        except self._client_error as exc:
            raise self._unavailable(what, exc) from exc
        except self._botocore_error as exc:
            raise self._unavailable(what, exc) from exc

    def _map(self, fn: Callable[[int], _T], count: int) -> list[_T]:
        """Run ``fn(i)`` for each item on the pool; the first L2Unavailable wins after all end."""
        if count <= 1:
            return [fn(i) for i in range(count)]
        futures = [self._executor.submit(fn, i) for i in range(count)]
        results: list[_T] = []
        error: BaseException | None = None
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:  # collected, re-raised once every worker is done
                error = error or exc
        if error is not None:
            raise error
        return results

    # -- the L2Adapter contract ------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[ObjectKey, memoryview]]) -> list[bool]:
        """PUT each object (atomic per object) on the I/O pool."""
        views = check_put_items(items)
        self._check_open()

        def put(i: int) -> bool:
            key, view = items[i][0], views[i]
            # botocore wants bytes (it may rewind the body to retry or checksum it).
            body = view.tobytes()
            try:
                self._client.put_object(Bucket=self.bucket, Key=self._name(key), Body=body)
            except self._client_error as exc:
                status = _http_status(exc)
                if 400 <= status < 500 and status not in (401, 403, 404):
                    # This object was refused (too large, bad request): a per-item
                    # failure. Auth, a missing bucket and 5xx mean the pool is unusable.
                    logger.warning("s3 L2: put of %s refused: %s", key.describe(), exc)
                    return False
                raise self._unavailable("put_object", exc) from exc
            except self._botocore_error as exc:
                raise self._unavailable("put_object", exc) from exc
            return True

        return self._map(put, len(items))

    def get_into(self, keys: Sequence[ObjectKey], outs: Sequence[memoryview]) -> list[bool]:
        """GET each object straight into its buffer when ContentLength matches."""
        views = check_get_args(keys, outs)
        self._check_open()

        def get(i: int) -> bool:
            return self._get_one(keys[i], views[i])

        return self._map(get, len(keys))

    def _get_one(self, key: ObjectKey, out: memoryview) -> bool:
        name = self._name(key)
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=name)
        except self._client_error as exc:
            if _error_code(exc) in _MISSING_CODES:
                return False
            raise self._unavailable("get_object", exc) from exc
        except self._botocore_error as exc:
            raise self._unavailable("get_object", exc) from exc
        body = response["Body"]
        try:
            if int(response["ContentLength"]) != out.nbytes:
                logger.debug(
                    "s3 L2: %s holds %s bytes, buffer is %d",
                    name,
                    response["ContentLength"],
                    out.nbytes,
                )
                return False
            filled = 0
            while filled < out.nbytes:
                got = body.readinto(out[filled:])
                if not got:
                    break
                filled += got
            if filled != out.nbytes or body.read(1):
                logger.warning("s3 L2: %s: read %d of %d bytes", name, filled, out.nbytes)
                return False
            return True
        except self._botocore_error as exc:
            raise self._unavailable("get_object body", exc) from exc
        finally:
            body.close()

    def _head(self, key: ObjectKey) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._name(key))
            return True
        except self._client_error as exc:
            if _error_code(exc) in _MISSING_CODES:
                return False
            raise self._unavailable("head_object", exc) from exc
        except self._botocore_error as exc:
            raise self._unavailable("head_object", exc) from exc

    def contains(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """HEAD each key on the I/O pool."""
        self._check_open()
        return self._map(lambda i: self._head(keys[i]), len(keys))

    def delete_many(self, keys: Sequence[ObjectKey]) -> int:
        """Delete the keys that exist (DeleteObjects, ≤1000 a request); returns the count.

        S3 reports a delete of a missing key as a success, so presence is
        checked first to count only what was really removed.
        """
        present = [k for k, there in zip(keys, self.contains(keys), strict=True) if there]
        removed = 0
        for start in range(0, len(present), _DELETE_BATCH):
            names = [self._name(k) for k in present[start : start + _DELETE_BATCH]]
            request = functools.partial(
                self._client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": n} for n in names], "Quiet": True},
            )
            response = self._call("delete_objects", request)
            errors = response.get("Errors", [])
            for error in errors:
                logger.warning("s3 L2: delete of %s failed: %s", error.get("Key"), error)
            removed += len(names) - len(errors)
        return removed

    def _list(self) -> Iterator[L2Entry]:
        paginator = self._client.get_paginator("list_objects_v2")
        skip = len(self.prefix)
        try:
            for page in paginator.paginate(
                Bucket=self.bucket,
                Prefix=self.prefix,
                PaginationConfig={"PageSize": _LIST_PAGE_SIZE},
            ):
                for obj in page.get("Contents", []):
                    try:
                        key = parse_object_name(obj["Key"][skip:])
                    except InvalidArgument:
                        continue  # not ours
                    yield L2Entry(key, int(obj["Size"]))
        except self._client_error as exc:
            raise self._unavailable("list_objects_v2", exc) from exc
        except self._botocore_error as exc:
            raise self._unavailable("list_objects_v2", exc) from exc

    def iter_entries(self) -> Iterator[L2Entry]:
        """Every object under the prefix (list_objects_v2, paginated)."""
        self._check_open()
        return self._list()

    def usage(self) -> L2Usage:
        """Bytes and objects under the prefix (a full listing) and the declared capacity."""
        return usage_of(self.iter_entries(), self.capacity_bytes)

    def close(self) -> None:
        """Stop the I/O pool and close the client's connections; the objects stay."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        self._client.close()


def _error_code(exc: Exception) -> str:
    response: Any = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _http_status(exc: Exception) -> int:
    response: Any = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
