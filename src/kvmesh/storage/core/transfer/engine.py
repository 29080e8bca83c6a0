"""The transfer engine: opens an engine's paged KV memory and moves chunks to and from L1.

An inference engine registers its KV cache once per instance: a
:class:`~kvmesh.storage.core.transfer.layout.KVLayout` and one handle per
layer, either a :class:`~kvmesh.storage.core.transfer.shm.SharedMemoryHandle`
(a region of a file under the allowed shared-memory directory, on CPU hosts
and in tests) or a :class:`~kvmesh.storage.core.transfer.cuda_ipc.CudaIpcHandle`
(the fields of torch's ``_share_cuda_()``, on GPU hosts). The engine then
names chunks only by block ids; :class:`TransferEngine` copies between its
memory and L1 chunk objects with :mod:`kernels`, and the engine process does
no copy work (docs/architecture.md, "Engine memory"). This module is the
registry and loads no torch; the copies and the opening of memory
(:mod:`~kvmesh.storage.core.transfer.chunks`) load with the first
registration.

Everything the engine says is checked before memory is touched (the handles
by :mod:`~kvmesh.storage.core.transfer.shm` and
:mod:`~kvmesh.storage.core.transfer.cuda_ipc`; block ids, token counts and
chunk buffers in :mod:`~kvmesh.storage.core.transfer.chunks`). Copies are
bounded to the registered regions by construction (block ids are
range-checked by the kernels).

Re-registration: registering an instance again with an equal layout and equal
handles is a no-op (an engine may retry a register whose reply it lost). A
register of a known instance with a different layout or different memory is
refused with ``FailedPrecondition``: the request is valid on its own but
conflicts with the node's state, and silently remapping would pull memory out
from under in-flight copies. Unregister first.

Unregister drops the instance at once; a copy already running holds its own
reference to the mapping, so the memory is unmapped when that copy finishes,
never under it.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from kvmesh.common.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmesh.storage.core.transfer.cuda_ipc import CudaIpcHandle
from kvmesh.storage.core.transfer.layout import KVLayout
from kvmesh.storage.core.transfer.shm import (
    DEFAULT_ALLOWED_SHM_DIR,
    SharedMemoryHandle,
    SharedMemoryOpener,
    close_mappings,
    populate_views,
)

if TYPE_CHECKING:
    from kvmesh.kernels import BlockIds, PagedKVCache
    from kvmesh.storage.core.transfer.chunks import ChunkBuffer, ChunkSource

logger = logging.getLogger(__name__)

KVHandle: TypeAlias = SharedMemoryHandle | CudaIpcHandle


def load_copy_half() -> None:
    """Import the copies' half (:mod:`~kvmesh.storage.core.transfer.chunks`) and torch.

    A storage node starts serving without torch (about 0.9 s of CPU at each
    start). :meth:`TransferEngine.register` imports it at the first
    registration; a caller on an event loop runs this in a thread first, so
    that load does not stall the loop's other RPCs.
    """
    from kvmesh.storage.core.transfer import chunks  # noqa: F401


@dataclass
class _Instance:
    layout: KVLayout
    handles: tuple[KVHandle, ...]
    kv: PagedKVCache
    mappings: list[mmap.mmap] = field(default_factory=list)


class TransferEngine:
    """Registry of engines' KV memory, and the copies between it and L1 chunk objects.

    Thread-safe: copies for different (or the same) instances may run
    concurrently; register/unregister are serialized against the registry.
    """

    def __init__(self, allowed_shm_dir: str | os.PathLike[str] = DEFAULT_ALLOWED_SHM_DIR) -> None:
        self._shm = SharedMemoryOpener(allowed_shm_dir)
        self._lock = threading.Lock()
        self._instances: dict[str, _Instance] = {}

    @property
    def allowed_shm_dir(self) -> str:
        """The resolved directory every shared-memory handle must lie in."""
        return self._shm.allowed_dir

    # ---- registration ------------------------------------------------------------------------

    def register(self, instance_id: str, layout: KVLayout, handles: Sequence[KVHandle]) -> None:
        """Open ``handles`` (one per layer) as ``instance_id``'s paged KV cache.

        Raises :class:`InvalidArgument` for a bad id, layout or handle (naming
        the field, e.g. ``handles[3].path``), and :class:`FailedPrecondition`
        when ``instance_id`` is registered already with another layout or other
        memory (an identical re-register is a no-op), or for CUDA handles on a
        node without CUDA.
        """
        _check_instance_id(instance_id)
        if not isinstance(layout, KVLayout):
            raise InvalidArgument("layout must be a KVLayout", field="layout")
        if isinstance(handles, (str, bytes)) or not isinstance(handles, Sequence):
            raise InvalidArgument("handles must be a sequence, one per layer", field="handles")
        handles = tuple(handles)
        if len(handles) != layout.num_layers:
            raise InvalidArgument(
                f"{len(handles)} handles for {layout.num_layers} layers", field="handles"
            )
        with self._lock:
            existing = self._instances.get(instance_id)
        if existing is not None:
            self._check_same_registration(instance_id, existing, layout, handles)
            return

        from kvmesh.storage.core.transfer import chunks  # torch: see load_copy_half

        kv, mappings = chunks.open_memory(self._shm, layout, handles)
        instance = _Instance(layout, handles, kv, mappings)
        del kv
        with self._lock:
            existing = self._instances.get(instance_id)
            if existing is None:
                self._instances[instance_id] = instance
        if existing is not None:  # lost a race with a concurrent register of the same id
            mappings = instance.mappings
            del instance  # the last reference to its views: the mappings can close
            close_mappings(mappings)
            self._check_same_registration(instance_id, existing, layout, handles)
            return
        logger.info(
            "registered KV cache of instance %s: %s, %d layers x %d blocks x %d tokens, %s, "
            "one-call copies=%s",
            instance_id,
            layout.kind.name,
            layout.num_layers,
            layout.num_blocks,
            layout.block_size,
            layout.dtype,
            instance.kv.fused,
        )

    def prefault(self, instance_id: str) -> int:
        """Map every page of a shared-memory instance into this process; bytes covered.

        Takes up front the page faults its first copies would pay (see
        :mod:`kvmesh.common.pages`). Blocks for about
        0.3 s per GiB: run it off the event loop. CUDA instances and unknown
        ids cover nothing (0). Safe beside copies and an unregister: the views
        it holds keep the mapping alive until it returns.
        """
        with self._lock:
            instance = self._instances.get(instance_id)
        if instance is None or not instance.mappings:
            return 0
        started = time.perf_counter()
        covered = populate_views(instance.kv.layers)
        logger.info(
            "mapped %d MiB of instance %s's KV memory in %.0f ms",
            covered >> 20,
            instance_id,
            (time.perf_counter() - started) * 1e3,
        )
        return covered

    def unregister(self, instance_id: str) -> None:
        """Forget ``instance_id`` and unmap its memory. Unknown ids raise :class:`NotFound`."""
        with self._lock:
            instance = self._instances.pop(instance_id, None)
        if instance is None:
            raise NotFound(f"KV cache instance {instance_id!r} is not registered")
        mappings = instance.mappings
        del instance  # the last reference to its views (unless a copy is in flight)
        close_mappings(mappings)
        logger.info("unregistered KV cache of instance %s", instance_id)

    def is_registered(self, instance_id: str) -> bool:
        """Whether ``instance_id`` has a registered KV cache."""
        with self._lock:
            return instance_id in self._instances

    def instance_ids(self) -> list[str]:
        """Ids of all registered instances."""
        with self._lock:
            return list(self._instances)

    def layout(self, instance_id: str) -> KVLayout:
        """The registered layout of ``instance_id`` (:class:`NotFound` when unknown)."""
        with self._lock:
            instance = self._instances.get(instance_id)
        if instance is None:
            raise NotFound(f"KV cache instance {instance_id!r} is not registered")
        return instance.layout

    def close(self) -> None:
        """Unregister every instance."""
        with self._lock:
            mappings = [m for instance in self._instances.values() for m in instance.mappings]
            self._instances.clear()
        close_mappings(mappings)

    # ---- copies ------------------------------------------------------------------------------

    def gather_chunks(
        self,
        instance_id: str,
        block_ids: Sequence[BlockIds] | BlockIds,
        num_tokens: Sequence[int],
        outs: Sequence[ChunkBuffer],
        producer_event: bytes = b"",
    ) -> None:
        """Copy chunks from the instance's paged KV cache into ``outs`` (store direction).

        ``block_ids`` is either one id list per chunk, or one flat list for the
        whole batch in which chunk ``i`` takes the next
        ``ceil(num_tokens[i] / block_size)`` ids. ``outs[i]`` must hold exactly
        ``chunk_nbytes(layout, num_tokens[i])`` bytes (see :data:`ChunkBuffer`).
        Raises :class:`FailedPrecondition` for an unregistered instance and
        :class:`InvalidArgument` (naming the field, before any copy) otherwise.
        ``producer_event`` (CUDA only): the IPC handle of an event the engine
        recorded after writing the blocks; the copies wait for it on the device.
        """
        instance = self._instance(instance_id)
        from kvmesh.storage.core.transfer import chunks  # loaded by the registration

        chunks.gather(instance.kv, instance.layout, block_ids, num_tokens, outs, producer_event)

    def scatter_chunks(
        self,
        instance_id: str,
        block_ids: Sequence[BlockIds] | BlockIds,
        num_tokens: Sequence[int],
        srcs: Sequence[ChunkSource],
        skip_first_n_tokens: int = 0,
        producer_event: bytes = b"",
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Copy ``srcs`` into the instance's paged KV cache (retrieve direction).

        Same arguments as :meth:`gather_chunks`; the first
        ``skip_first_n_tokens // block_size`` blocks of the batch's range are
        not written (LMCache's rounding). Read-only buffers (``bytes``) are
        fine as sources. ``producer_event`` (CUDA only): the copies wait for it
        (the engine's work that last used those blocks). ``layers``: only
        layers ``[start, end)`` are written (one part of a load by layers).
        """
        instance = self._instance(instance_id)
        from kvmesh.storage.core.transfer import chunks  # loaded by the registration

        chunks.scatter(
            instance.kv,
            instance.layout,
            block_ids,
            num_tokens,
            srcs,
            skip_first_n_tokens,
            producer_event,
            layers,
        )

    def gather_segment(
        self,
        instance_id: str,
        block_table: Sequence[int],
        start_token: int,
        num_tokens: int,
        out: ChunkBuffer,
    ) -> None:
        """Copy tokens ``[start_token, start_token + num_tokens)`` of a request (whose
        blocks are ``block_table``) into the segment object ``out``, keys rotated to 0..
        with the instance's registered RoPE parameters (docs/blend.md).

        Raises :class:`FailedPrecondition` for an unregistered instance or one
        registered without RoPE parameters, :class:`InvalidArgument` (before any copy)
        otherwise.
        """
        instance = self._instance(instance_id)
        from kvmesh.storage.core.transfer import chunks  # loaded by the registration

        chunks.gather_segment(
            instance.kv, instance.layout, block_table, start_token, num_tokens, out
        )

    def scatter_segment(
        self,
        instance_id: str,
        block_table: Sequence[int],
        start_token: int,
        num_tokens: int,
        src: ChunkSource,
    ) -> None:
        """Copy the segment object ``src`` into tokens ``[start_token, ...)`` of a request,
        keys rotated from 0.. to ``start_token..``; errors as :meth:`gather_segment`."""
        instance = self._instance(instance_id)
        from kvmesh.storage.core.transfer import chunks  # loaded by the registration

        chunks.scatter_segment(
            instance.kv, instance.layout, block_table, start_token, num_tokens, src
        )

    # ---- internals ---------------------------------------------------------------------------

    def _instance(self, instance_id: str) -> _Instance:
        with self._lock:
            instance = self._instances.get(instance_id)
        if instance is None:
            raise FailedPrecondition(
                f"KV cache instance {instance_id!r} is not registered (register before store or "
                "retrieve)",
                reason="INSTANCE_NOT_REGISTERED",
            )
        return instance

    @staticmethod
    def _check_same_registration(
        instance_id: str, existing: _Instance, layout: KVLayout, handles: tuple[KVHandle, ...]
    ) -> None:
        if existing.layout != layout:
            raise FailedPrecondition(
                f"instance {instance_id!r} is registered with another layout "
                f"({existing.layout}); unregister it first",
                reason="INSTANCE_LAYOUT_MISMATCH",
            )
        if existing.handles != handles:
            raise FailedPrecondition(
                f"instance {instance_id!r} is registered with other KV memory; unregister it first",
                reason="INSTANCE_MEMORY_MISMATCH",
            )
        logger.debug("re-register of instance %s with the same layout: no-op", instance_id)


def _check_instance_id(instance_id: object) -> None:
    if not isinstance(instance_id, str) or not instance_id:
        raise InvalidArgument("instance_id must be a non-empty string", field="instance_id")
