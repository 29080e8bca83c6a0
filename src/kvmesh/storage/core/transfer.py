"""The transfer engine: opens an engine's paged KV memory and moves chunks to and from L1.

An inference engine registers its KV cache once per instance: a :class:`KVLayout`
and one handle per layer, either a :class:`SharedMemoryHandle` (a region of a
file under the allowed shared-memory directory, on CPU hosts and in tests) or
a :class:`CudaIpcHandle` (the fields of torch's ``_share_cuda_()``, on GPU
hosts). The engine then names chunks only by block ids; :class:`TransferEngine`
copies between its memory and L1 chunk objects with :mod:`kernels`, and the
engine process does no copy work (DESIGN §3).

Everything the engine says is checked before memory is touched: the shm path
must resolve inside the allowed directory (no ``..``, no symlink escape, checked
again on the opened descriptor), the file must be a regular file large enough
for the region, each region must be exactly one layer of the layout and
aligned to the dtype, and layers must not overlap. Copies are bounded to the
registered regions by construction (block ids are range-checked by the
kernels).

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

import itertools
import logging
import mmap
import os
import stat
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import torch

from kvmesh.common.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmesh.kernels import (
    SUPPORTED_DTYPES,
    BlockIds,
    KVLayoutKind,
    PagedKVCache,
    blocks_for_tokens,
    gather_chunks,
    paged_layer_shape,
    scatter_chunks,
)

logger = logging.getLogger(__name__)

DEFAULT_ALLOWED_SHM_DIR = "/dev/shm"

# Bounds that no real model reaches; they keep a hostile layout from asking for
# absurd mappings or index arithmetic (the region size check does the rest).
_MAX_LAYERS = 4096
_MAX_BLOCK_SIZE = 1 << 16
_MAX_KV_HEADS = 4096
_MAX_HEAD_DIM = 1 << 16
_MAX_NUM_BLOCKS = 1 << 31
_MAX_LAYER_BYTES = 1 << 44

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,  # vLLM's kv_cache_dtype "fp8" is e4m3
    "float8_e5m2": torch.float8_e5m2,
    "fp8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


def parse_dtype(value: torch.dtype | str) -> torch.dtype:
    """A KV dtype from a torch dtype or a name such as ``"bfloat16"`` or ``"fp8_e4m3"``.

    Raises :class:`InvalidArgument` for unknown or unsupported dtypes.
    """
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise InvalidArgument(f"unknown KV dtype {value!r}", field="layout.dtype")
        dtype = _DTYPE_NAMES[name]
    else:
        raise InvalidArgument(
            f"dtype must be a torch.dtype or a name, got {type(value).__name__}",
            field="layout.dtype",
        )
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidArgument(f"unsupported KV dtype {dtype}", field="layout.dtype")
    return dtype


@dataclass(frozen=True, init=False)
class KVLayout:
    """Geometry of one engine instance's paged KV cache (one entry per layer, all alike).

    ``kind`` and ``dtype`` may be given by name; they are normalized on
    construction, and every field is validated (raising
    :class:`InvalidArgument` naming ``layout.<field>``). MLA caches have one
    latent plane of ``head_dim`` per token, so ``kv_heads`` must be 1.
    """

    kind: KVLayoutKind
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __init__(
        self,
        kind: KVLayoutKind | str,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
    ) -> None:
        if isinstance(kind, str):
            try:
                kind = KVLayoutKind[kind.strip().upper()]
            except KeyError:
                raise InvalidArgument(
                    f"unknown KV layout kind {kind!r}", field="layout.kind"
                ) from None
        if not isinstance(kind, KVLayoutKind):
            raise InvalidArgument(f"unknown KV layout kind {kind!r}", field="layout.kind")
        limits = {
            "num_layers": (num_layers, _MAX_LAYERS),
            "num_blocks": (num_blocks, _MAX_NUM_BLOCKS),
            "block_size": (block_size, _MAX_BLOCK_SIZE),
            "kv_heads": (kv_heads, _MAX_KV_HEADS),
            "head_dim": (head_dim, _MAX_HEAD_DIM),
        }
        for name, (value, limit) in limits.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(
                    f"layout.{name} must be an int, got {type(value).__name__}",
                    field=f"layout.{name}",
                )
            if not 0 < value <= limit:
                raise InvalidArgument(
                    f"layout.{name} must be in [1, {limit}], got {value}", field=f"layout.{name}"
                )
        if kind is KVLayoutKind.MLA and kv_heads != 1:
            raise InvalidArgument(
                f"MLA caches have one latent plane per token: kv_heads must be 1, got {kv_heads}",
                field="layout.kv_heads",
            )
        torch_dtype = parse_dtype(dtype)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "num_layers", num_layers)
        object.__setattr__(self, "num_blocks", num_blocks)
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "kv_heads", kv_heads)
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "dtype", torch_dtype)
        if self.layer_nbytes > _MAX_LAYER_BYTES:
            raise InvalidArgument(
                f"one layer would be {self.layer_nbytes} bytes, more than {_MAX_LAYER_BYTES}",
                field="layout",
            )

    @property
    def kv_size(self) -> int:
        """K/V planes per chunk object: 2, or 1 for MLA."""
        return self.kind.kv_size

    @property
    def hidden(self) -> int:
        """Elements per token per plane (``kv_heads * head_dim``)."""
        return self.kv_heads * self.head_dim

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Shape of one layer's paged tensor."""
        return paged_layer_shape(
            self.kind, self.num_blocks, self.block_size, self.kv_heads, self.head_dim
        )

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's paged tensor (what each handle's region must measure)."""
        n = self.itemsize
        for d in self.layer_shape:
            n *= d
        return n


def chunk_shape(layout: KVLayout, num_tokens: int) -> tuple[int, int, int, int]:
    """Shape ``[kv_size, num_layers, num_tokens, kv_heads*head_dim]`` of an L1 chunk object."""
    _check_num_tokens(num_tokens, "num_tokens")
    return (layout.kv_size, layout.num_layers, num_tokens, layout.hidden)


def chunk_nbytes(layout: KVLayout, num_tokens: int) -> int:
    """Bytes of the L1 chunk object for ``num_tokens`` tokens of ``layout``."""
    kv_size, num_layers, tokens, hidden = chunk_shape(layout, num_tokens)
    return kv_size * num_layers * tokens * hidden * layout.itemsize


@dataclass(frozen=True)
class SharedMemoryHandle:
    """One layer's paged tensor as a region of a shared-memory file.

    ``path`` is absolute, or a bare name taken relative to the allowed
    directory (so POSIX shm names work as-is).
    """

    path: str
    offset_bytes: int
    size_bytes: int


@dataclass(frozen=True)
class CudaIpcHandle:
    """One layer's paged tensor exported with torch's CUDA storage sharing.

    The first eight fields are, in order, what ``UntypedStorage._share_cuda_()``
    returns; the rest describe the tensor view inside that storage. A
    ``device_uuid`` (as ``str(torch.cuda.get_device_properties(i).uuid)``) is
    preferred over ``device_index``: ordinals differ between processes that
    see different ``CUDA_VISIBLE_DEVICES``.
    """

    device_index: int
    ipc_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    tensor_offset: int
    device_uuid: str = ""

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> CudaIpcHandle:
        """Export ``tensor`` (engine side); the exporter keeps it alive while it is registered."""
        if tensor.device.type != "cuda":
            raise InvalidArgument("only CUDA tensors can be exported over CUDA IPC")
        (
            device,
            handle,
            size_bytes,
            offset_bytes,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = tensor.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
        return cls(
            device_index=int(device),
            ipc_handle=bytes(handle),
            storage_size_bytes=int(size_bytes),
            storage_offset_bytes=int(offset_bytes),
            ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset),
            event_handle=bytes(event_handle) if event_handle else b"",
            event_sync_required=bool(event_sync),
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            tensor_offset=int(tensor.storage_offset()),
            device_uuid=str(torch.cuda.get_device_properties(device).uuid),
        )


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
        real = os.path.realpath(allowed_shm_dir)
        if not os.path.isdir(real):
            raise InvalidArgument(
                f"allowed shared-memory directory {str(allowed_shm_dir)!r} is not a directory",
                field="allowed_shm_dir",
            )
        self._allowed_dir = real
        self._lock = threading.Lock()
        self._instances: dict[str, _Instance] = {}

    @property
    def allowed_shm_dir(self) -> str:
        """The resolved directory every shared-memory handle must lie in."""
        return self._allowed_dir

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
            layers, mappings = self._open_shared_memory(layout, handles)  # type: ignore[arg-type]
        elif all(isinstance(h, CudaIpcHandle) for h in handles):
            layers, mappings = _open_cuda_ipc(layout, handles), []  # type: ignore[arg-type]
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
            _close_mappings(mappings)
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

    def unregister(self, instance_id: str) -> None:
        """Forget ``instance_id`` and unmap its memory. Unknown ids raise :class:`NotFound`."""
        with self._lock:
            instance = self._instances.pop(instance_id, None)
        if instance is None:
            raise NotFound(f"KV cache instance {instance_id!r} is not registered")
        mappings = instance.mappings
        del instance  # the last reference to its views (unless a copy is in flight)
        _close_mappings(mappings)
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
        _close_mappings(mappings)

    # ---- copies ------------------------------------------------------------------------------

    def gather_chunks(
        self,
        instance_id: str,
        block_ids: Sequence[BlockIds] | BlockIds,
        num_tokens: Sequence[int],
        outs: Sequence[ChunkBuffer],
    ) -> None:
        """Copy chunks from the instance's paged KV cache into ``outs`` (store direction).

        ``block_ids`` is either one id list per chunk, or one flat list for the
        whole batch in which chunk ``i`` takes the next
        ``ceil(num_tokens[i] / block_size)`` ids. ``outs[i]`` must hold exactly
        ``chunk_nbytes(layout, num_tokens[i])`` bytes (see :data:`ChunkBuffer`).
        Raises :class:`FailedPrecondition` for an unregistered instance and
        :class:`InvalidArgument` (naming the field, before any copy) otherwise.
        """
        instance = self._instance(instance_id)
        _check_buffer_list(outs, "outs")
        ids, tokens = _per_chunk_ids(block_ids, num_tokens, len(outs), instance.layout)
        chunks = [
            _as_chunk(buf, instance.layout, n, f"outs[{i}]", writable=True)
            for i, (buf, n) in enumerate(zip(outs, tokens, strict=True))
        ]
        gather_chunks(instance.kv, ids, chunks)
        _wait_for_device(instance.kv)

    def scatter_chunks(
        self,
        instance_id: str,
        block_ids: Sequence[BlockIds] | BlockIds,
        num_tokens: Sequence[int],
        srcs: Sequence[ChunkSource],
        skip_first_n_tokens: int = 0,
    ) -> None:
        """Copy ``srcs`` into the instance's paged KV cache (retrieve direction).

        Same arguments as :meth:`gather_chunks`; the first
        ``skip_first_n_tokens // block_size`` blocks of the batch's range are
        not written (LMCache's rounding). Read-only buffers (``bytes``) are
        fine as sources.
        """
        instance = self._instance(instance_id)
        _check_buffer_list(srcs, "srcs")
        ids, tokens = _per_chunk_ids(block_ids, num_tokens, len(srcs), instance.layout)
        chunks = [
            _as_chunk(buf, instance.layout, n, f"srcs[{i}]", writable=False)
            for i, (buf, n) in enumerate(zip(srcs, tokens, strict=True))
        ]
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

    def _resolve_shm_path(self, path: object, field_name: str) -> str:
        if not isinstance(path, str) or not path or "\x00" in path:
            raise InvalidArgument("shared-memory path must be a non-empty string", field=field_name)
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

    def _inside_allowed_dir(self, real: str) -> bool:
        return real != self._allowed_dir and (
            os.path.commonpath([real, self._allowed_dir]) == self._allowed_dir
        )

    def _open_shared_memory(
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
            _close_mappings(opened)
            raise
        return layers, [m for m, _ in mappings.values()]

    def _map_file(self, real: str, field_name: str) -> tuple[mmap.mmap, torch.Tensor]:
        flags = os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
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
        return mapping, _tensor_over(mapping)


def _wait_for_device(kv: PagedKVCache) -> None:
    """Return only when the copies are done: the engine reads (or frees) the memory next.

    CUDA ops are stream-ordered and return early; ordering against the engine's
    own streams through IPC events (reference §7.6) is not implemented yet, so
    the call is synchronous on the device.
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


def _check_num_tokens(value: object, field_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgument(f"{field_name} must be an int >= 1, got {value!r}", field=field_name)
    return int(value)


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


def _fd_path(fd: int) -> str | None:
    try:
        return os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # no /proc (not Linux): the realpath check before open stands alone
        return None


def _close_mappings(mappings: list[mmap.mmap]) -> None:
    for mapping in mappings:
        try:
            mapping.close()
        except BufferError:
            # A tensor over the mapping is still alive (a copy in flight): the
            # mapping is unmapped when the last view goes.
            logger.debug("mapping still in use; it is unmapped when its last view is freed")


def _per_chunk_ids(
    block_ids: Sequence[BlockIds] | BlockIds,
    num_tokens: Sequence[int],
    num_buffers: int,
    layout: KVLayout,
) -> tuple[list[BlockIds], list[int]]:
    """Normalize the flat or per-chunk block-id forms into one id list per chunk."""
    if isinstance(num_tokens, (str, bytes)) or not isinstance(num_tokens, Sequence):
        raise InvalidArgument("num_tokens must be a sequence of ints", field="num_tokens")
    tokens = [_check_num_tokens(n, f"num_tokens[{i}]") for i, n in enumerate(num_tokens)]
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
    return _view_chunk(_tensor_over(buf), shape, field_name, layout.dtype)


def _tensor_over(buf: Any) -> torch.Tensor:
    """A uint8 tensor over ``buf``'s memory that holds a buffer export while it lives.

    ``torch.frombuffer`` keeps the object but releases its buffer export, so
    ``mmap.close()`` would unmap memory under live tensors. NumPy keeps the
    export: closing a mapping with live views raises ``BufferError`` instead,
    and the mapping goes when its last view does.
    """
    with warnings.catch_warnings():
        # torch warns that read-only buffers give writable tensors; sources are only read.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))


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


def _cuda_device_for(handle: CudaIpcHandle, field_name: str) -> int:
    count = torch.cuda.device_count()
    if handle.device_uuid:
        for index in range(count):
            if str(torch.cuda.get_device_properties(index).uuid) == handle.device_uuid:
                return index
        raise InvalidArgument(
            f"no local CUDA device has uuid {handle.device_uuid}", field=f"{field_name}.device_uuid"
        )
    if not 0 <= handle.device_index < count:
        raise InvalidArgument(
            f"CUDA device {handle.device_index} does not exist ({count} devices)",
            field=f"{field_name}.device_index",
        )
    return handle.device_index


def _open_cuda_ipc(layout: KVLayout, handles: tuple[CudaIpcHandle, ...]) -> list[torch.Tensor]:
    """Open each layer's CUDA IPC handle as a tensor (the storage is mapped once per handle)."""
    if not torch.cuda.is_available():
        raise FailedPrecondition(
            "CUDA IPC handles need a CUDA device; this storage node has none",
            reason="NO_CUDA_DEVICE",
        )
    shape = layout.layer_shape
    contiguous_stride: list[int] = []
    numel = 1
    for d in reversed(shape):
        contiguous_stride.insert(0, numel)
        numel *= d
    layers: list[torch.Tensor] = []
    devices: set[int] = set()
    for i, h in enumerate(handles):
        f = f"handles[{i}]"
        device = _cuda_device_for(h, f)
        devices.add(device)
        if tuple(h.shape) != shape:
            raise InvalidArgument(
                f"{f}.shape is {tuple(h.shape)}, the layout's layer is {shape}", field=f"{f}.shape"
            )
        if list(h.stride) != contiguous_stride:
            raise InvalidArgument(
                f"{f}.stride {tuple(h.stride)} is not contiguous", field=f"{f}.stride"
            )
        if (
            h.tensor_offset < 0
            or (h.tensor_offset + numel) * layout.itemsize > h.storage_size_bytes
        ):
            raise InvalidArgument(
                f"{f}: the layer does not fit its storage ({h.storage_size_bytes} bytes)",
                field=f"{f}.storage_size_bytes",
            )
        if not h.ipc_handle:
            raise InvalidArgument(f"{f}.ipc_handle is empty", field=f"{f}.ipc_handle")
        try:
            with torch.cuda.device(device):
                storage = torch.UntypedStorage._new_shared_cuda(
                    device,
                    h.ipc_handle,
                    h.storage_size_bytes,
                    h.storage_offset_bytes,
                    h.ref_counter_handle,
                    h.ref_counter_offset,
                    h.event_handle,
                    h.event_sync_required,
                )
        except (RuntimeError, TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"cannot open the CUDA IPC handle of layer {i}: {exc}", field=f"{f}.ipc_handle"
            ) from None
        tensor = torch.empty(0, dtype=layout.dtype, device=f"cuda:{device}")
        tensor.set_(storage, h.tensor_offset, shape, h.stride)
        layers.append(tensor)
    if len(devices) > 1:
        raise InvalidArgument("all layers must live on one CUDA device", field="handles")
    return layers
