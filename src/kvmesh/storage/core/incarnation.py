"""The storage node's incarnation: a number that grows on every start of one instance.

The coordinator's gate fences an emitter's old L1 placements when it sees a
higher incarnation for the same ``instance_id`` and drops batches from a lower
one (docs/coordinator.md, "Event gate"). So the number must grow on *every* start —
even when the wall clock stepped backwards or two starts fall in the same
second, which LMCache's ``int(time.time())`` does not guarantee.

With a state directory the value is a counter persisted in a small file,
floored by the wall clock in nanoseconds: the counter makes it strictly grow
whatever the clock does, and the clock floor keeps it above what a coordinator
has already seen if the state file is lost (a fresh volume), where a bare
counter would restart at 1 and every batch would be rejected as stale.
Without a state directory it is the wall clock in nanoseconds, made strictly
increasing within the process.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvmesh.common.errors import FailedPrecondition

logger = logging.getLogger(__name__)

INCARNATION_FILE = "incarnation"
_LOCK_FILE = "incarnation.lock"
#: Held (``flock``) by the one live process of an instance for its whole life.
INSTANCE_LOCK_FILE = "instance.lock"

_process_lock = threading.Lock()


class _ProcessFloor:
    """The last time-based value this process issued (guarded by ``_process_lock``)."""

    last_issued = 0


def next_incarnation(state_dir: Path | None, *, clock_ns: Callable[[], int] = time.time_ns) -> int:
    """Return this start's incarnation, strictly greater than any earlier one.

    ``state_dir``: where the counter file lives (created if missing); None
    falls back to a time-based value. ``clock_ns`` is the wall clock in
    nanoseconds (injectable for tests). The new value is durable (written to
    a temporary file, fsynced, renamed over the old one, directory fsynced)
    before it is returned, and concurrent starts sharing ``state_dir`` are
    serialised with an advisory file lock, so no two starts get one value.
    """
    if state_dir is not None:
        # The file is the authority; the process lock only keeps two threads
        # of one process from racing on it (the flock covers processes).
        with _process_lock:
            return _advance_persisted_counter(state_dir, clock_ns())
    with _process_lock:
        # Remembered process-wide so two starts in one process (tests, an
        # embedded fleet) grow even when the clock does not move or steps back.
        value = max(clock_ns(), _ProcessFloor.last_issued + 1)
        _ProcessFloor.last_issued = value
        return value


def read_incarnation(state_dir: Path) -> int | None:
    """The last incarnation persisted in ``state_dir``, or None when there is none."""
    path = state_dir / INCARNATION_FILE
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= 0 else None


def _advance_persisted_counter(state_dir: Path, floor: int) -> int:
    state_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(state_dir / _LOCK_FILE):
        path = state_dir / INCARNATION_FILE
        previous = read_incarnation(state_dir)
        if previous is None and path.exists():
            # Unreadable despite atomic writes means someone edited it; the
            # clock floor still most likely beats what the coordinator saw.
            logger.warning("ignoring unreadable incarnation file %s", path)
        value = floor if previous is None else max(previous + 1, floor)
        _write_atomically(path, f"{value}\n".encode("ascii"))
    logger.info("incarnation %d (previous %s, state %s)", value, previous, state_dir)
    return value


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    # The rename is durable only once the directory entry is on disk.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class InstanceLock:
    """One live process per state directory: taken before the incarnation advances.

    A second process given the same state directory (the same instance id or
    ``--data-dir``) fails here, before it touches the running instance's
    incarnation file, with the pid of the process that holds it. The lock is
    an ``flock``, so it dies with its holder: a killed node's successor takes
    it at once. The holder's pid is written into the file for operators.
    """

    def __init__(self, state_dir: Path, instance_id: str) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / INSTANCE_LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise FailedPrecondition(
                f"instance {instance_id}: its state directory {state_dir} is in use by the "
                f"running process {holder}; give each node its own --instance-id or --data-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Let the next process of this instance start. Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
