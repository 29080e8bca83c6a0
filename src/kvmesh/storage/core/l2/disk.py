"""L2 on a local directory: one self-describing file per object, written atomically.

The file format is in :mod:`kvmesh.storage.core.l2.disk_format`.

No torn object is ever served: a put writes a temp file (``.tmp-*``) in the
object's own directory, fsyncs it, renames it over the final name and
fsyncs the directory, so the final name only ever points at a complete
file. A crash leaves at most a temp file, which the next adapter deletes
when it scans the directory at start; the scan also deletes every object
file that fails validation, so a reopened adapter serves only whole objects.

Objects are spread over 256 sub-directories (first byte of the chunk hash)
so no directory grows huge. A name too long for the filesystem (model names
may be 512 characters) is replaced by a digest of it; the real name is in
the header either way. One adapter owns a directory at a time (an exclusive
``flock`` on ``.lock``), because the start-up scan deletes other writers'
temp files.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import uuid
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey, object_name
from kvmesh.storage.core.l2.base import (
    L2Entry,
    L2Unavailable,
    L2Usage,
    check_get_args,
    check_put_items,
)
from kvmesh.storage.core.l2.disk_format import (
    FLAG_PAYLOAD_CRC,
    LOCK_FILE,
    OBJECT_SUFFIX,
    PAYLOAD_OFFSET,
    TEMP_PREFIX,
    InvalidObjectFileError,
    ObjectHeader,
    encode_header,
    encode_trailer,
    file_name_for,
    read_header,
)

logger = logging.getLogger(__name__)

# Write errors that mean "this object does not fit" rather than "the disk is gone".
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data)
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view = view[written:]
        offset += written


class DiskL2Adapter:
    """L2 objects as files under ``base_path``; see the module docstring for the format.

    ``capacity_bytes`` > 0 bounds the payload bytes stored: a put that would
    exceed it fails for that item (returns False). ``fsync=False`` trades
    durability across power loss for speed; atomicity against process
    crashes holds either way (rename is atomic, and the size/trailer checks
    reject anything a power loss could have torn).
    """

    backend = "disk"

    def __init__(
        self,
        base_path: str | os.PathLike[str],
        capacity_bytes: int = 0,
        fsync: bool = True,
        *,
        verify_checksum: bool = True,
        shared: bool = False,
    ) -> None:
        if capacity_bytes < 0:
            raise InvalidArgument("capacity_bytes must be >= 0", field="capacity_bytes")
        self.shared = shared
        #: The lock on the directory makes this adapter its only writer (unless shared).
        self.sole_writer = not shared
        self.capacity_bytes = capacity_bytes
        self.base_path = Path(base_path)
        self._fsync = fsync
        self._verify_checksum = verify_checksum
        self._mutex = threading.Lock()
        self._index: dict[ObjectKey, int] = {}
        self._used_bytes = 0
        self._reserved_bytes = 0
        self._known_dirs: set[str] = set()
        self._closed = False
        try:
            self.base_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise L2Unavailable(f"cannot create L2 directory {self.base_path}: {exc}") from exc
        self._lock_fd = self._lock_directory()
        try:
            self._rebuild_index()
        except BaseException:
            os.close(self._lock_fd)
            raise

    # -- start-up --------------------------------------------------------------------------

    def _lock_directory(self) -> int:
        path = self.base_path / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise L2Unavailable(
                f"L2 directory {self.base_path} is in use by another adapter",
                reason="L2_PATH_LOCKED",
            ) from exc
        return fd

    def _rebuild_index(self) -> None:
        """Index every valid object; delete temp files and objects that fail validation."""
        removed_tmp = removed_bad = 0
        for sub in os.scandir(self.base_path):
            if not sub.is_dir(follow_symlinks=False) or not _is_fanout_name(sub.name):
                continue
            self._known_dirs.add(sub.name)
            for entry in os.scandir(sub.path):
                if entry.name.startswith(TEMP_PREFIX):
                    _unlink_quietly(entry.path)
                    removed_tmp += 1
                    continue
                if not entry.name.endswith(OBJECT_SUFFIX):
                    logger.debug("ignoring foreign file %s", entry.path)
                    continue
                try:
                    header = self._inspect(entry.path)
                    if self._path_for(header.key) != Path(entry.path):
                        raise InvalidObjectFileError(
                            "file name does not match the key in its header"
                        )
                except InvalidObjectFileError as exc:
                    logger.warning("deleting invalid L2 object file %s: %s", entry.path, exc)
                    _unlink_quietly(entry.path)
                    removed_bad += 1
                    continue
                self._index[header.key] = header.payload_len
                self._used_bytes += header.payload_len
        if removed_tmp or removed_bad:
            self._sync_dirs(set(self._known_dirs))
        logger.info(
            "disk L2 at %s: %d objects, %d bytes; removed %d temp and %d invalid files",
            self.base_path,
            len(self._index),
            self._used_bytes,
            removed_tmp,
            removed_bad,
        )

    def _inspect(self, path: str) -> ObjectHeader:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidObjectFileError(f"cannot open: {exc}") from exc
        try:
            return read_header(fd)
        except OSError as exc:
            raise InvalidObjectFileError(f"cannot read: {exc}") from exc
        finally:
            os.close(fd)

    # -- paths -----------------------------------------------------------------------------

    def _path_for(self, key: ObjectKey) -> Path:
        return self.base_path / key.chunk_hash[:1].hex() / file_name_for(object_name(key))

    def _ensure_dir(self, sub: str) -> None:
        if sub in self._known_dirs:
            return
        path = self.base_path / sub
        path.mkdir(exist_ok=True)
        if self._fsync:
            _fsync_dir(self.base_path)
        self._known_dirs.add(sub)

    def _sync_dirs(self, subs: set[str]) -> None:
        if not self._fsync:
            return
        for sub in subs:
            _fsync_dir(self.base_path / sub)

    def _check_open(self) -> None:
        if self._closed:
            raise L2Unavailable(
                f"disk L2 adapter at {self.base_path} is closed", reason="L2_CLOSED"
            )

    # -- payload I/O (the NIXL adapter overrides these two) --------------------------------

    def _write_payload(self, fd: int, offset: int, payload: memoryview) -> None:
        _write_all(fd, payload, offset)

    def _read_payload(self, fd: int, offset: int, out: memoryview) -> None:
        view = out
        while view.nbytes:
            got = os.preadv(fd, [view], offset)
            if got <= 0:
                raise InvalidObjectFileError("payload ended early")
            view = view[got:]
            offset += got

    # -- the L2Adapter contract ------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[ObjectKey, memoryview]]) -> list[bool]:
        """Write each object to a temp file, fsync it, rename it into place; fsync the dirs."""
        views = check_put_items(items)
        self._check_open()
        results: list[bool] = []
        touched: set[str] = set()
        for (key, _), payload in zip(items, views, strict=True):
            grow = self._reserve(key, payload.nbytes)
            if grow is None:
                results.append(False)
                continue
            try:
                results.append(self._put_one(key, payload, touched))
            finally:
                with self._mutex:
                    self._reserved_bytes -= grow
        try:
            self._sync_dirs(touched)
        except OSError as exc:
            raise L2Unavailable(f"disk L2 at {self.base_path}: cannot fsync: {exc}") from exc
        return results

    def _reserve(self, key: ObjectKey, size: int) -> int | None:
        """Reserve capacity for a put; the bytes reserved, or None when it does not fit."""
        with self._mutex:
            grow = max(size - self._index.get(key, 0), 0)
            if (
                self.capacity_bytes
                and self._used_bytes + self._reserved_bytes + grow > self.capacity_bytes
            ):
                return None
            self._reserved_bytes += grow
            return grow

    def _put_one(self, key: ObjectKey, payload: memoryview, touched: set[str]) -> bool:
        name = object_name(key)
        final = self._path_for(key)
        sub = final.parent.name
        tmp = final.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        try:
            self._ensure_dir(sub)
            header = encode_header(name.encode(), payload.nbytes, zlib.crc32(payload))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, header, 0)
                self._write_payload(fd, PAYLOAD_OFFSET, payload)
                _write_all(fd, encode_trailer(payload.nbytes), PAYLOAD_OFFSET + payload.nbytes)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._mutex:
                # Rename and index change together, so a concurrent delete of the
                # same key sees the file and the index agree.
                os.replace(tmp, final)
                old = self._index.get(key)
                self._index[key] = payload.nbytes
                self._used_bytes += payload.nbytes - (old or 0)
            touched.add(sub)
            return True
        except BaseException as exc:
            _unlink_quietly(tmp)
            if not isinstance(exc, OSError):
                raise
            if exc.errno in _FULL_ERRNOS:
                logger.warning("disk L2 at %s is full: %s", self.base_path, exc)
                return False
            raise L2Unavailable(f"disk L2 at {self.base_path}: write failed: {exc}") from exc

    def get_into(self, keys: Sequence[ObjectKey], outs: Sequence[memoryview]) -> list[bool]:
        """Read each object into its buffer when it exists, validates and has the buffer's size."""
        views = check_get_args(keys, outs)
        self._check_open()
        results: list[bool] = []
        for key, out in zip(keys, views, strict=True):
            with self._mutex:
                size = self._index.get(key)
            if size is None or size != out.nbytes:
                results.append(False)
                continue
            results.append(self._get_one(key, out))
        return results

    def _get_one(self, key: ObjectKey, out: memoryview) -> bool:
        path = self._path_for(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            # Removed behind our back; the index follows the directory.
            self._forget(key, path, None)
            return False
        except OSError as exc:
            raise L2Unavailable(f"disk L2 at {self.base_path}: cannot open: {exc}") from exc
        try:
            header = read_header(fd)
            if header.name != object_name(key):
                raise InvalidObjectFileError("file holds another key")
            if header.payload_len != out.nbytes:
                return False
            self._read_payload(fd, PAYLOAD_OFFSET, out)
            if (
                self._verify_checksum
                and header.flags & FLAG_PAYLOAD_CRC
                and zlib.crc32(out) != header.payload_crc
            ):
                raise InvalidObjectFileError("payload checksum mismatch")
            return True
        except InvalidObjectFileError as exc:
            logger.warning("removing invalid L2 object %s: %s", path, exc)
            self._forget(key, path, os.fstat(fd).st_ino)
            return False
        except OSError as exc:
            raise L2Unavailable(f"disk L2 at {self.base_path}: read failed: {exc}") from exc
        finally:
            os.close(fd)

    def _forget(self, key: ObjectKey, path: Path, inode: int | None) -> None:
        """Drop ``key`` from the index and, when ``inode`` is given, unlink that file."""
        with self._mutex:
            if inode is not None:
                try:
                    # Only the file that failed: a concurrent put may have renamed a
                    # good one over it since.
                    if os.stat(path).st_ino != inode:
                        return
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            size = self._index.pop(key, None)
            if size is not None:
                self._used_bytes -= size

    def contains(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Per-key presence, from the index."""
        self._check_open()
        with self._mutex:
            return [key in self._index for key in keys]

    def delete_many(self, keys: Sequence[ObjectKey]) -> int:
        """Unlink the objects that exist; returns how many were removed."""
        self._check_open()
        removed = 0
        with self._mutex:
            for key in keys:
                size = self._index.pop(key, None)
                if size is None:
                    continue
                self._used_bytes -= size
                removed += 1
                try:
                    os.unlink(self._path_for(key))
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise L2Unavailable(
                        f"disk L2 at {self.base_path}: delete failed: {exc}"
                    ) from exc
        return removed

    def iter_entries(self) -> Iterator[L2Entry]:
        """A snapshot of the index."""
        self._check_open()
        with self._mutex:
            snapshot = [L2Entry(key, size) for key, size in self._index.items()]
        return iter(snapshot)

    def usage(self) -> L2Usage:
        """Payload bytes and object count from the index."""
        self._check_open()
        with self._mutex:
            return L2Usage(
                used_bytes=self._used_bytes,
                capacity_bytes=self.capacity_bytes,
                object_count=len(self._index),
            )

    def close(self) -> None:
        """Release the directory lock; the files stay."""
        if self._closed:
            return
        self._closed = True
        os.close(self._lock_fd)


def _is_fanout_name(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _unlink_quietly(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove %s: %s", path, exc)
