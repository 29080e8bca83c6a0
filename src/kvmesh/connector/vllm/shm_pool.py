"""Allocate vLLM's KV cache inside a shared-memory file the storage node can map.

vLLM (``Worker.initialize_from_config``) allocates the whole KV cache as one
``torch.zeros(n, dtype=int8)`` inside the connector's
``get_mem_pool_context()``. :class:`SharedMemoryPool` is that context: a torch
function mode that turns the first large int8 ``zeros`` on the CPU into a
tensor mapped (``MAP_SHARED``) from a fresh file under ``/dev/shm``. Every
layer is then a view into that file, and storage copies blocks in and out of
it directly: no copy through the connector, no bytes over gRPC.

The file has no name (``O_TMPFILE``): storage maps it through vLLM's open
descriptor, ``/proc/<pid>/fd/<n>``, so the kernel frees the memory with the
last mapping, however vLLM stops (SIGKILL included) — nothing is left in
``/dev/shm``. That needs storage to see vLLM's ``/proc`` (same user and PID
namespace: the usual ``kvmesh node`` beside ``vllm serve``; in containers,
a shared PID namespace). Where that cannot be, ``named_kv_file`` keeps the
older way: a file named ``kvmesh-vllm-<pid>-<n>-<random>``, deleted on
:meth:`close`. Its owner holds an ``flock`` on it for life, so a file whose
process died without closing (SIGKILL) is found unlocked and removed by the
next pool created in the same folder, even from another PID namespace
(where pids repeat and say nothing about the file's owner).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import re
import secrets
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvmesh.common.pages import populate
from kvmesh.common.procs import pid_alive

logger = logging.getLogger(__name__)

#: Named files: ``kvmesh-vllm-<pid>-<n>-<random>``; their owner holds an flock on them.
_NAME = re.compile(r"^kvmesh-vllm-(\d+)-\d+-[0-9a-f]{8}$")
#: Files an older kvmesh named without the random part and without a lock: the pid decides.
_OLD_NAME = re.compile(r"^kvmesh-vllm-(\d+)-\d+$")
_counter = itertools.count()
#: Smaller allocations inside the context are left to torch (vLLM allocates nothing else
#: there today; the bound keeps a stray small tensor out of the file).
MIN_BYTES = 1 << 20


def reclaim_stale(folder: Path) -> list[Path]:
    """Delete named KV files in ``folder`` whose owner is gone; the paths removed.

    An owner holds an exclusive ``flock`` on its file for as long as it lives
    (the kernel drops it when the process dies, however it dies), so a file
    nobody holds a lock on is stale. A pid would not do: engines in other
    PID namespaces (containers sharing a ``/dev/shm``) reuse each other's
    pids, and a restarted container's vLLM often gets its predecessor's.
    """
    removed = []
    for path in folder.glob("kvmesh-vllm-*"):
        if _NAME.match(path.name):
            stale = not _locked(path)
        else:
            old = _OLD_NAME.match(path.name)
            stale = old is not None and not pid_alive(int(old.group(1)))
        if not stale:
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
        logger.info("removed %s, left by a vLLM process that no longer runs", path)
    return removed


def _locked(path: Path) -> bool:
    """Whether a live process holds the file's lock (a file that cannot be opened: yes)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the lock just taken
    return False


class SharedMemoryPool(TorchFunctionMode):
    """Context under which vLLM's KV-cache allocation lands in a shared-memory file."""

    def __init__(self, folder: str | Path = "/dev/shm", *, named: bool = False) -> None:
        super().__init__()
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"shared-memory folder {self.folder} does not exist")
        reclaim_stale(self.folder)
        self.named = named
        #: Where storage opens the file: its name, or (nameless) vLLM's descriptor of it.
        # A random part: another PID namespace may run a vLLM with this pid.
        self.path = (
            self.folder / f"kvmesh-vllm-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
        )
        self._fd: int | None = None
        self.buffer: torch.Tensor | None = None

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self.buffer is None:
            nbytes = self._int8_cpu_size(args, kwargs)
            if nbytes is not None and nbytes >= MIN_BYTES:
                self.buffer = self._map(nbytes)
                if self.buffer is not None:
                    return self.buffer
        return func(*args, **kwargs)

    @staticmethod
    def _int8_cpu_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        if kwargs.get("dtype") is not torch.int8:
            return None
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return None
        size: Any = args if len(args) != 1 else args[0]
        if "size" in kwargs:
            size = kwargs["size"]
        if isinstance(size, int):
            return size
        if isinstance(size, (tuple, list, torch.Size)) and len(size) == 1:
            return int(size[0])
        return None

    def _open(self) -> int:
        """A new file: nameless unless ``named`` (or the folder cannot hold nameless files)."""
        if not self.named:
            try:
                fd = os.open(self.folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                logger.warning(
                    "kvmesh: %s cannot hold a nameless file (%s); vLLM's KV cache gets a named "
                    "file, removed when vLLM stops (or by the next engine if it is killed)",
                    self.folder,
                    exc.strerror,
                )
                self.named = True
            else:
                self.path = Path(f"/proc/{os.getpid()}/fd/{fd}")
                return fd
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for life: see reclaim_stale
        return fd

    def _map(self, nbytes: int) -> torch.Tensor | None:
        """The file, its pages allocated and mapped here; None (torch allocates) when
        ``/dev/shm`` cannot hold it."""
        fd = self._open()
        try:
            # Allocate every page now, as torch.zeros would by writing them: a full
            # /dev/shm is an error here rather than a SIGBUS in the middle of a
            # forward pass, and storage's copies never pay for a page's first
            # allocation (16 MiB of fresh pages: 15 ms of faults on these machines).
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            if self.named:
                self.path.unlink(missing_ok=True)
            logger.warning(
                "kvmesh: cannot allocate vLLM's KV cache (%d bytes) in %s (%s); vLLM keeps it "
                "in its own memory and kvmesh stays off for this engine",
                nbytes,
                self.folder,
                exc.strerror,
            )
            return None
        buffer = torch.from_file(str(self.path), shared=True, size=nbytes, dtype=torch.int8)
        # Kept open until close(): storage opens a nameless file through it, and a named
        # file's lock says its owner lives.
        self._fd = fd
        logger.info(
            "vLLM's KV cache (%d bytes) lives in %s%s",
            nbytes,
            self.path,
            "" if self.named else f" (a nameless file in {self.folder})",
        )
        # Map every page here too: vLLM's first reads of a block storage wrote fault nothing.
        populate(buffer.data_ptr(), buffer.numel())
        return buffer

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Byte offset of ``tensor`` in the file, or None when it is not inside it."""
        if self.buffer is None:
            return None
        base = self.buffer.untyped_storage().data_ptr()
        start = tensor.data_ptr() - base
        end = start + tensor.numel() * tensor.element_size()
        if start < 0 or end > self.buffer.numel():
            return None
        return start

    def close(self) -> None:
        """Delete the file, or close the nameless one's descriptor (the mapping stays
        valid while vLLM holds the tensor)."""
        if self.named:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
