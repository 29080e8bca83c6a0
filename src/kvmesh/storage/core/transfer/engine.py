"""The transfer engine: opens an engine's paged KV memory and moves chunks to and from L1.

An inference engine registers its KV cache once per instance: a
:class:`~kvmesh.storage.core.transfer.layout.KVLayout` and one handle per
layer, either a :class:`~kvmesh.storage.core.transfer.shm.SharedMemoryHandle`
(a region of a file under the allowed shared-memory directory, on CPU hosts
and in tests) or a :class:`~kvmesh.storage.core.transfer.cuda_ipc.CudaIpcHandle`
(the fields of torch's ``_share_cuda_()``, on GPU hosts). The engine then
names chunks only by block ids; :class:`TransferEngine` copies between its
memory and L1 chunk objects with :mod:`kernels`, and the engine process does
no copy work (DESIGN §3).

Everything the engine says is checked before memory is touched (the handles
by :mod:`~kvmesh.storage.core.transfer.shm` and
:mod:`~kvmesh.storage.core.transfer.cuda_ipc`; block ids, token counts and
chunk buffers here). Copies are bounded to the registered regions by
construction (block ids are range-checked by the kernels).

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
from typing import Any, TypeAlias

import numpy as np
import torch

from kvmesh.common.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmesh.kernels import (
    BlockIds,
    PagedKVCache,
    blocks_for_tokens,
    gather_chunks,
    scatter_chunks,
)
from kvmesh.storage.core.transfer.cuda_ipc import CudaIpcHandle, open_cuda_ipc
from kvmesh.storage.core.transfer.layout import (
    KVLayout,
    check_num_tokens,
    chunk_nbytes,
    chunk_shape,
)
from kvmesh.storage.core.transfer.shm import (
    DEFAULT_ALLOWED_SHM_DIR,
    SharedMemoryHandle,
    SharedMemoryOpener,
    close_mappings,
    populate_views,
    tensor_over,
)

logger = logging.getLogger(__name__)

KVHandle: TypeAlias = SharedMemoryHandle | CudaIpcHandle

#: A chunk buffer: a tensor of the layout's dtype (chunk-shaped or flat), a
#: flat uint8 tensor of the chunk's bytes, or any C-contiguous buffer-protocol
#: object (bytearray, memoryview, mmap, numpy array) of exactly those bytes.
ChunkBuffer: TypeAlias = torch.Tensor | bytearray | memoryview | mmap.mmap | np.ndarray[Any, Any]
#: A scatter source: any :data:`ChunkBuffer`, or read-only ``bytes``.
ChunkSource: TypeAlias = ChunkBuffer | bytes


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

        if all(isinstance(h, SharedMemoryHandle) for h in handles):
            layers, mappings = self._shm.open(layout, handles)  # type: ignore[arg-type]
        elif all(isinstance(h, CudaIpcHandle) for h in handles):
            layers, mappings = open_cuda_ipc(layout, handles), []  # type: ignore[arg-type]
        else:
            raise InvalidArgument(
                "handles must all be SharedMemoryHandle or all CudaIpcHandle", field="handles"
            )
        instance = _Instance(layout, handles, PagedKVCache(layers, layout.kind), mappings)
        del layers
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
        _check_buffer_list(outs, "outs")
        ids, tokens = _per_chunk_ids(block_ids, num_tokens, len(outs), instance.layout)
        chunks = [
            _as_chunk(buf, instance.layout, n, f"outs[{i}]", writable=True)
            for i, (buf, n) in enumerate(zip(outs, tokens, strict=True))
        ]
        _wait_for_producer(instance.kv, producer_event)
        gather_chunks(instance.kv, ids, chunks)
        _wait_for_device(instance.kv)

    def scatter_chunks(
        self,
        instance_id: str,
        block_ids: Sequence[BlockIds] | BlockIds,
        num_tokens: Sequence[int],
        srcs: Sequence[ChunkSource],
        skip_first_n_tokens: int = 0,
        producer_event: bytes = b"",
    ) -> None:
        """Copy ``srcs`` into the instance's paged KV cache (retrieve direction).

        Same arguments as :meth:`gather_chunks`; the first
        ``skip_first_n_tokens // block_size`` blocks of the batch's range are
        not written (LMCache's rounding). Read-only buffers (``bytes``) are
        fine as sources. ``producer_event`` (CUDA only): the copies wait for it
        (the engine's work that last used those blocks).
        """
        instance = self._instance(instance_id)
        _check_buffer_list(srcs, "srcs")
        ids, tokens = _per_chunk_ids(block_ids, num_tokens, len(srcs), instance.layout)
        chunks = [
            _as_chunk(buf, instance.layout, n, f"srcs[{i}]", writable=False)
            for i, (buf, n) in enumerate(zip(srcs, tokens, strict=True))
        ]
        _wait_for_producer(instance.kv, producer_event)
        scatter_chunks(instance.kv, ids, chunks, skip_first_n_tokens=skip_first_n_tokens)
        _wait_for_device(instance.kv)

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


#: Bytes of a ``cudaIpcEventHandle_t``.
CUDA_IPC_EVENT_BYTES = 64


def _wait_for_producer(kv: PagedKVCache, handle: bytes) -> None:
    """Order this process's copies after the engine's event (reference §7.6).

    The engine records an interprocess event on its stream after the forward
    that wrote (or last read) the blocks and sends its IPC handle; the copy
    stream waits for it on the device, so neither side blocks a CPU thread on
    the other's work.
    """
    if not handle:
        return
    if kv.device.type != "cuda":
        raise InvalidArgument(
            "producer_event_handle is for KV memory on a CUDA device; this engine's KV cache "
            "is in shared memory (send none)",
            field="producer_event_handle",
        )
    if len(handle) != CUDA_IPC_EVENT_BYTES:
        raise InvalidArgument(
            f"producer_event_handle must be a {CUDA_IPC_EVENT_BYTES}-byte cudaIpcEventHandle_t, "
            f"got {len(handle)} bytes",
            field="producer_event_handle",
        )
    try:
        event = torch.cuda.Event.from_ipc_handle(kv.device, handle)  # type: ignore[no-untyped-call]
    except RuntimeError as exc:
        raise InvalidArgument(
            f"producer_event_handle does not open as a CUDA IPC event: {exc}",
            field="producer_event_handle",
        ) from None
    torch.cuda.current_stream(kv.device).wait_event(event)


def _wait_for_device(kv: PagedKVCache) -> None:
    """Return only when the copies are done: the engine reads (or frees) the memory next.

    CUDA ops are stream-ordered and return early. The reply is sent after the
    copies finished on the device, so an engine may use its blocks as soon as
    the RPC returns and needs no completion event (``completion_event_handle``
    stays empty).
    """
    if kv.device.type == "cuda":
        torch.cuda.synchronize(kv.device)


def _check_instance_id(instance_id: object) -> None:
    if not isinstance(instance_id, str) or not instance_id:
        raise InvalidArgument("instance_id must be a non-empty string", field="instance_id")


def _check_buffer_list(buffers: object, field_name: str) -> None:
    if isinstance(buffers, (str, bytes, bytearray, torch.Tensor)) or not isinstance(
        buffers, Sequence
    ):
        raise InvalidArgument(
            f"{field_name} must be a sequence of chunk buffers, one per chunk", field=field_name
        )


def _per_chunk_ids(
    block_ids: Sequence[BlockIds] | BlockIds,
    num_tokens: Sequence[int],
    num_buffers: int,
    layout: KVLayout,
) -> tuple[list[BlockIds], list[int]]:
    """Normalize the flat or per-chunk block-id forms into one id list per chunk."""
    if isinstance(num_tokens, (str, bytes)) or not isinstance(num_tokens, Sequence):
        raise InvalidArgument("num_tokens must be a sequence of ints", field="num_tokens")
    tokens = [check_num_tokens(n, f"num_tokens[{i}]") for i, n in enumerate(num_tokens)]
    if len(tokens) != num_buffers:
        raise InvalidArgument(
            f"num_tokens has {len(tokens)} entries for {num_buffers} chunk buffers",
            field="num_tokens",
        )
    flat: list[int] | None = None
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() == 1:
            flat = block_ids.tolist()
    elif isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
        raise InvalidArgument("block_ids must be a sequence", field="block_ids")
    elif len(block_ids) > 0 and all(
        isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in block_ids
    ):
        flat = [int(b) for b in block_ids]  # type: ignore[arg-type]
    if flat is None:
        per_chunk = list(block_ids)
        if len(per_chunk) != len(tokens):
            raise InvalidArgument(
                f"block_ids has {len(per_chunk)} per-chunk lists for {len(tokens)} chunks",
                field="block_ids",
            )
        return per_chunk, tokens
    need = sum(blocks_for_tokens(n, layout.block_size) for n in tokens)
    if len(flat) < need:
        raise InvalidArgument(
            f"too few block ids: {sum(tokens)} tokens in {len(tokens)} chunks at block_size "
            f"{layout.block_size} need {need}, got {len(flat)}",
            field="block_ids",
            reason="TOO_FEW_BLOCK_IDS",
        )
    out: list[BlockIds] = []
    start = 0
    for n in tokens:
        count = blocks_for_tokens(n, layout.block_size)
        out.append(flat[start : start + count])
        start += count
    return out, tokens


def _as_chunk(
    buf: object, layout: KVLayout, num_tokens: int, field_name: str, *, writable: bool
) -> torch.Tensor:
    """``buf`` as a chunk-shaped tensor of the layout's dtype, sharing its memory."""
    shape = chunk_shape(layout, num_tokens)
    nbytes = chunk_nbytes(layout, num_tokens)
    if isinstance(buf, torch.Tensor):
        if buf.dtype == layout.dtype:
            if tuple(buf.shape) == shape:
                return buf  # the kernels check contiguity and device
            if buf.dim() == 1 and buf.numel() * layout.itemsize == nbytes:
                return _view_chunk(buf, shape, field_name)
        elif buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() == nbytes:
            return _view_chunk(buf, shape, field_name, layout.dtype)
        raise InvalidArgument(
            f"{field_name} is a {buf.dtype} tensor of shape {tuple(buf.shape)}; expected "
            f"{layout.dtype} {shape}, flat {layout.dtype}, or {nbytes} raw uint8 bytes",
            field=field_name,
        )
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(
            f"{field_name} must be a tensor or a buffer, got {type(buf).__name__}",
            field=field_name,
        ) from None
    with view:
        if not view.c_contiguous:
            raise InvalidArgument(f"{field_name} must be C-contiguous", field=field_name)
        if writable and view.readonly:
            raise InvalidArgument(f"{field_name} is read-only", field=field_name)
        if view.nbytes != nbytes:
            raise InvalidArgument(
                f"{field_name} holds {view.nbytes} bytes, a {num_tokens}-token chunk is {nbytes}",
                field=field_name,
            )
    return _view_chunk(tensor_over(buf), shape, field_name, layout.dtype)


def _view_chunk(
    flat: torch.Tensor,
    shape: tuple[int, int, int, int],
    field_name: str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if not flat.is_contiguous():
        raise InvalidArgument(f"{field_name} must be contiguous", field=field_name)
    try:
        typed = flat if dtype is None else flat.view(dtype)
        return typed.view(shape)
    except RuntimeError as exc:
        raise InvalidArgument(
            f"{field_name} cannot be viewed as a chunk: {exc}", field=field_name
        ) from None
