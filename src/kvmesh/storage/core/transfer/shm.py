"""Engines' KV memory in shared-memory files: the handle, and opening it safely.

A :class:`SharedMemoryHandle` names one layer's paged tensor as a region of a
file under the allowed shared-memory directory (on CPU hosts and in tests).
:class:`SharedMemoryOpener` checks everything the engine says before memory
is touched: the path must resolve inside the allowed directory (no ``..``, no
symlink escape, checked again on the opened descriptor), the file must be a
regular file large enough for the region, each region must be exactly one
layer of the layout and aligned to the dtype, and layers must not overlap.
Each file is mapped once; the mappings live until their last view goes
(:func:`tensor_over`, :func:`close_mappings`).

A handle may also name an engine's open descriptor, ``/proc/<pid>/fd/<n>``:
vLLM's connector keeps its KV file nameless (``O_TMPFILE``), so no file in
``/dev/shm`` can outlive the two processes that map it (see
``docs/architecture.md``, "Engine memory"). Such a path is accepted when the
descriptor's file lies in the allowed directory, and storage needs the rights
to read the engine's ``/proc`` entry (same user and PID namespace).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import re
import stat
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.pages import populate
from kvmesh.storage.core.transfer.layout import KVLayout

if TYPE_CHECKING:  # loaded by the first registration (tensor_over)
    import torch

logger = logging.getLogger(__name__)

DEFAULT_ALLOWED_SHM_DIR = "/dev/shm"
#: An engine's open descriptor of a KV file (see the module docstring).
_PROC_FD = re.compile(r"^/proc/[1-9][0-9]*/fd/[0-9]+$")
_DELETED = " (deleted)"


@dataclass(frozen=True)
class SharedMemoryHandle:
    """One layer's paged tensor as a region of a shared-memory file.

    ``path`` is absolute, or a bare name taken relative to the allowed
    directory (so POSIX shm names work as-is).
    """

    path: str
    offset_bytes: int
    size_bytes: int


class SharedMemoryOpener:
    """Opens shared-memory handles that lie inside one allowed directory."""

    def __init__(self, allowed_shm_dir: str | os.PathLike[str] = DEFAULT_ALLOWED_SHM_DIR) -> None:
        real = os.path.realpath(allowed_shm_dir)
        if not os.path.isdir(real):
            raise InvalidArgument(
                f"allowed shared-memory directory {str(allowed_shm_dir)!r} is not a directory",
                field="allowed_shm_dir",
            )
        self._allowed_dir = real

    @property
    def allowed_dir(self) -> str:
        """The resolved directory every shared-memory handle must lie in."""
        return self._allowed_dir

    def open(
        self, layout: KVLayout, handles: tuple[SharedMemoryHandle, ...]
    ) -> tuple[list[torch.Tensor], list[mmap.mmap]]:
        """Validate every handle, map each file once, and return per-layer views."""
        itemsize = layout.itemsize
        resolved: list[str] = []
        for i, h in enumerate(handles):
            f = f"handles[{i}]"
            resolved.append(self._resolve_shm_path(h.path, f"{f}.path"))
            for name, value in (("offset_bytes", h.offset_bytes), ("size_bytes", h.size_bytes)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidArgument(f"{f}.{name} must be an int >= 0", field=f"{f}.{name}")
            if h.size_bytes != layout.layer_nbytes:
                raise InvalidArgument(
                    f"{f}.size_bytes is {h.size_bytes}, one {layout.kind.name} layer of this "
                    f"layout is {layout.layer_nbytes} bytes",
                    field=f"{f}.size_bytes",
                )
            if h.offset_bytes % itemsize:
                raise InvalidArgument(
                    f"{f}.offset_bytes {h.offset_bytes} is not aligned to {layout.dtype} "
                    f"({itemsize} bytes)",
                    field=f"{f}.offset_bytes",
                )
        _check_no_overlap(resolved, handles)

        mappings: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        try:
            for i, (real, h) in enumerate(zip(resolved, handles, strict=True)):
                if real not in mappings:
                    mappings[real] = self._map_file(real, f"handles[{i}].path")
                mapping = mappings[real][0]
                if h.offset_bytes + h.size_bytes > len(mapping):
                    raise InvalidArgument(
                        f"handles[{i}] region [{h.offset_bytes}, {h.offset_bytes + h.size_bytes}) "
                        f"lies beyond the end of {real} ({len(mapping)} bytes)",
                        field=f"handles[{i}].size_bytes",
                    )
            layers = [
                mappings[real][1][h.offset_bytes : h.offset_bytes + h.size_bytes]
                .view(layout.dtype)
                .view(layout.layer_shape)
                for real, h in zip(resolved, handles, strict=True)
            ]
        except BaseException:
            opened = [m for m, _ in mappings.values()]
            mappings.clear()  # drops the tensors over them, so they can close now
            close_mappings(opened)
            raise
        return layers, [m for m, _ in mappings.values()]

    def _map_file(self, real: str, field_name: str) -> tuple[mmap.mmap, torch.Tensor]:
        flags = os.O_RDWR | os.O_CLOEXEC
        if not _PROC_FD.match(real):  # /proc/<pid>/fd/<n> is a link by nature
            flags |= getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(real, flags)
        except FileNotFoundError:
            raise InvalidArgument(
                f"shared-memory file {real} does not exist", field=field_name
            ) from None
        except OSError as exc:
            raise InvalidArgument(
                f"cannot open shared-memory file {real}: {exc.strerror}", field=field_name
            ) from None
        try:
            # Re-check what was actually opened: the path may have been swapped
            # for a symlink or renamed between the check and the open.
            opened = _fd_path(fd)
            if opened is not None and not self._inside_allowed_dir(opened):
                raise InvalidArgument(
                    f"shared-memory file {real} resolved outside {self._allowed_dir} when opened",
                    field=field_name,
                    reason="SHM_PATH_OUTSIDE_ALLOWED_DIR",
                )
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(f"{real} is not a regular file", field=field_name)
            if st.st_size == 0:
                raise InvalidArgument(f"shared-memory file {real} is empty", field=field_name)
            mapping = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return mapping, tensor_over(mapping)

    def _resolve_shm_path(self, path: object, field_name: str) -> str:
        if not isinstance(path, str) or not path or "\x00" in path:
            raise InvalidArgument("shared-memory path must be a non-empty string", field=field_name)
        if _PROC_FD.match(path):
            return self._resolve_engine_fd(path, field_name)
        if ".." in path.split(os.sep):
            raise InvalidArgument(f"shared-memory path {path!r} contains '..'", field=field_name)
        candidate = path if os.path.isabs(path) else os.path.join(self._allowed_dir, path)
        real = os.path.realpath(candidate)
        if not self._inside_allowed_dir(real):
            raise InvalidArgument(
                f"shared-memory path {path!r} resolves outside {self._allowed_dir}",
                field=field_name,
                reason="SHM_PATH_OUTSIDE_ALLOWED_DIR",
            )
        return real

    def _resolve_engine_fd(self, path: str, field_name: str) -> str:
        """An engine's descriptor ``/proc/<pid>/fd/<n>``: kept as is, once its file is checked."""
        try:
            target = os.readlink(path)
        except OSError as exc:
            raise InvalidArgument(
                f"cannot read the engine's descriptor {path} ({exc.strerror}): the engine is "
                "gone, or storage runs as another user or in another PID namespace",
                field=field_name,
            ) from None
        if not self._inside_allowed_dir(_real_target(target)):
            raise InvalidArgument(
                f"shared-memory descriptor {path} names {target!r}, outside {self._allowed_dir}",
                field=field_name,
                reason="SHM_PATH_OUTSIDE_ALLOWED_DIR",
            )
        return path

    def _inside_allowed_dir(self, real: str) -> bool:
        return real != self._allowed_dir and (
            os.path.commonpath([real, self._allowed_dir]) == self._allowed_dir
        )


def _check_no_overlap(resolved: list[str], handles: tuple[SharedMemoryHandle, ...]) -> None:
    regions = sorted(
        (real, h.offset_bytes, h.offset_bytes + h.size_bytes, i)
        for i, (real, h) in enumerate(zip(resolved, handles, strict=True))
    )
    for (path_a, _, end_a, i), (path_b, start_b, _, j) in itertools.pairwise(regions):
        if path_a == path_b and start_b < end_a:
            raise InvalidArgument(
                f"handles[{i}] and handles[{j}] overlap in {path_a}",
                field=f"handles[{j}].offset_bytes",
            )


def _real_target(target: str) -> str:
    """The resolved path of a descriptor's target; a removed (or nameless) file keeps its
    folder, which is what the allowed-directory check needs."""
    if target.endswith(_DELETED):
        head, tail = os.path.split(target.removesuffix(_DELETED))
        return os.path.join(os.path.realpath(head), tail)
    return os.path.realpath(target)


def _fd_path(fd: int) -> str | None:
    try:
        return _real_target(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # no /proc (not Linux): the realpath check before open stands alone
        return None


def close_mappings(mappings: list[mmap.mmap]) -> None:
    """Unmap ``mappings`` now, or (while a tensor over one lives) when its last view goes."""
    for mapping in mappings:
        try:
            mapping.close()
        except BufferError:
            # A tensor over the mapping is still alive (a copy in flight): the
            # mapping is unmapped when the last view goes.
            logger.debug("mapping still in use; it is unmapped when its last view is freed")


def tensor_over(buf: Any) -> torch.Tensor:
    """A uint8 tensor over ``buf``'s memory that holds a buffer export while it lives.

    ``torch.frombuffer`` keeps the object but releases its buffer export, so
    ``mmap.close()`` would unmap memory under live tensors. NumPy keeps the
    export: closing a mapping with live views raises ``BufferError`` instead,
    and the mapping goes when its last view does.
    """
    import torch

    with warnings.catch_warnings():
        # torch warns that read-only buffers give writable tensors; sources are only read.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))


def populate_views(views: Sequence[torch.Tensor]) -> int:
    """Map every page under ``views`` into this process now; the bytes it covered.

    An engine's KV file is mapped lazily, so the first copy into a block pays
    a fault per page (and the page's allocation where the engine never
    touched it): see :mod:`kvmesh.common.pages`. 0 where the kernel cannot.
    """
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in views if t.numel()
    )
    covered = 0
    for start, end in _merge(spans):
        if not populate(start, end - start):
            break
        covered += end - start
    return covered


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
