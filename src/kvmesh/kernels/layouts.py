"""Engine KV layouts and the validated view of one engine's paged KV cache.

The engine (vLLM) keeps one paged tensor per layer:

- ``FLASH_ATTN``: ``[2, num_blocks, block_size, kv_heads, head_dim]``
- ``FLASHINFER``: ``[num_blocks, 2, block_size, kv_heads, head_dim]``
- ``MLA``:        ``[num_blocks, block_size, head_dim]``
- ``VLLM_CPU``:   ``[num_blocks, kv_heads, block_size, 2 * head_dim]``; inside one
  (block, head) K comes first, transposed (``[head_dim][block_size]``), then V
  (``[block_size][head_dim]``). vLLM's CPU attention backend ("vec" ISA).
- ``VLLM_CPU_AMX``: the same shape, vLLM's CPU backend on x86 with AMX ("amx"
  ISA): K in 16-token tiles ``[head_dim / 2][16][2]``, then V in 16-dim tiles
  ``[block_size / 2][16][2]`` (offsets in :func:`kvmesh.kernels.vllm_cpu.head_offsets`).

The L1 chunk object of ``num_tokens`` tokens is
``[kv_size, num_layers, num_tokens, kv_heads * head_dim]`` (token-major,
heads flattened; ``kv_size`` is 2, or 1 for MLA), contiguous, of the KV dtype
(docs/kernels.md, "The L1 chunk object").

:class:`PagedKVCache` validates the per-layer tensors once and precomputes
what every copy needs, so the per-call cost of the ops stays small.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvmesh.common.errors import InvalidArgument
from kvmesh.kernels.kinds import KVLayoutKind

logger = logging.getLogger(__name__)


#: dtypes the kernels (and the transfer engine) accept. Copies move raw bytes,
#: so any fixed-width dtype would work; the list is what engines actually use
#: for KV caches (vLLM stores fp8 caches either as float8 or as uint8).
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint8,
    }
)


@dataclass(frozen=True)
class _RowGeometry:
    """Element strides of one layer's K/V plane and block dimensions (0 for MLA's one plane)."""

    kv_stride: int
    block_stride: int


class PagedKVCache:
    """A validated, read-mostly view of one engine's per-layer paged KV tensors.

    All layers must share shape, dtype and device and be contiguous. When every
    layer lives in one storage (one shared-memory file, or slices of one
    stacked tensor) at offsets that are whole multiples of a block, the ops copy
    a whole chunk with one indexed call over that storage instead of one call
    per layer and plane; otherwise they loop over layers.
    """

    def __init__(self, layers: Sequence[torch.Tensor], kind: KVLayoutKind) -> None:
        if not isinstance(kind, KVLayoutKind):
            raise InvalidArgument(
                f"kind must be a KVLayoutKind, got {type(kind).__name__}", field="kind"
            )
        if isinstance(layers, torch.Tensor) or len(layers) == 0:
            raise InvalidArgument(
                "layers must be a non-empty sequence of per-layer tensors", field="layers"
            )
        first = layers[0]
        if not isinstance(first, torch.Tensor):
            raise InvalidArgument("layers[0] is not a tensor", field="layers")
        expected_rank = 3 if kind is KVLayoutKind.MLA else 4 if kind.is_vllm_cpu else 5
        if first.dim() != expected_rank:
            raise InvalidArgument(
                f"{kind.name} layers must have rank {expected_rank}, got shape "
                f"{tuple(first.shape)}",
                field="layers",
            )
        if first.dtype not in SUPPORTED_DTYPES:
            raise InvalidArgument(f"unsupported KV dtype {first.dtype}", field="layers")
        shape = tuple(first.shape)
        if any(d <= 0 for d in shape):
            raise InvalidArgument(f"layer shape {shape} has an empty dimension", field="layers")
        if kind is KVLayoutKind.FLASH_ATTN:
            if shape[0] != 2:
                raise InvalidArgument(
                    f"FLASH_ATTN layers are [2, num_blocks, block_size, kv_heads, head_dim], "
                    f"got {shape}",
                    field="layers",
                )
            num_blocks, block_size, kv_heads, head_dim = shape[1], shape[2], shape[3], shape[4]
        elif kind is KVLayoutKind.FLASHINFER:
            if shape[1] != 2:
                raise InvalidArgument(
                    f"FLASHINFER layers are [num_blocks, 2, block_size, kv_heads, head_dim], "
                    f"got {shape}",
                    field="layers",
                )
            num_blocks, block_size, kv_heads, head_dim = shape[0], shape[2], shape[3], shape[4]
        elif kind.is_vllm_cpu:
            if shape[3] % 2:
                raise InvalidArgument(
                    f"{kind.name} layers are [num_blocks, kv_heads, block_size, 2 * head_dim], "
                    f"got {shape} (odd last dimension)",
                    field="layers",
                )
            num_blocks, kv_heads, block_size, head_dim = shape[0], shape[1], shape[2], shape[3] // 2
            if kind is KVLayoutKind.VLLM_CPU_AMX and (block_size % 16 or head_dim % 16):
                raise InvalidArgument(
                    f"VLLM_CPU_AMX tiles 16 tokens and 16 dims: block_size {block_size} and "
                    f"head_dim {head_dim} must be multiples of 16",
                    field="layers",
                )
        else:
            num_blocks, block_size, head_dim = shape
            kv_heads = 1
        for i, layer in enumerate(layers):
            if not isinstance(layer, torch.Tensor):
                raise InvalidArgument(f"layers[{i}] is not a tensor", field="layers")
            if tuple(layer.shape) != shape or layer.dtype != first.dtype:
                raise InvalidArgument(
                    f"layers[{i}] is {tuple(layer.shape)} {layer.dtype}, layer 0 is "
                    f"{shape} {first.dtype}; all layers must match",
                    field="layers",
                )
            if layer.device != first.device:
                raise InvalidArgument(
                    f"layers[{i}] is on {layer.device}, layer 0 on {first.device}",
                    field="layers",
                )
            if not layer.is_contiguous():
                raise InvalidArgument(f"layers[{i}] is not contiguous", field="layers")

        self.kind = kind
        self.layers: tuple[torch.Tensor, ...] = tuple(layers)
        self.num_layers = len(layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.hidden = kv_heads * head_dim
        self.kv_size = kind.kv_size
        self.dtype = first.dtype
        self.device = first.device
        self.itemsize = first.element_size()
        strides = first.stride()
        if kind is KVLayoutKind.FLASH_ATTN:
            self._geometry = _RowGeometry(kv_stride=strides[0], block_stride=strides[1])
        elif kind is KVLayoutKind.FLASHINFER:
            self._geometry = _RowGeometry(kv_stride=strides[1], block_stride=strides[0])
        elif kind.is_vllm_cpu:
            # Not row-copyable (K is transposed or tiled): kernels.vllm_cpu moves them.
            self._geometry = _RowGeometry(kv_stride=0, block_stride=strides[0])
        else:
            self._geometry = _RowGeometry(kv_stride=0, block_stride=strides[0])

        # One storage for all layers lets a whole chunk move in one indexed call.
        block_elems = block_size * self.hidden
        storage_ptrs = {layer.untyped_storage().data_ptr() for layer in layers}
        offsets = [int(layer.storage_offset()) for layer in layers]
        base = min(offsets)
        self._fused = len(storage_ptrs) == 1 and all((o - base) % block_elems == 0 for o in offsets)
        self._base_offset = base
        self._layer_offsets = tuple(o - base for o in offsets)
        self._storage_elems = first.untyped_storage().nbytes() // self.itemsize
        self._row_views: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._row_views_lock = threading.Lock()
        self._void_views: dict[tuple[int | str, int], npt.NDArray[Any]] = {}
        self._sub_caches: dict[tuple[int, int], PagedKVCache] = {}
        logger.debug(
            "paged KV cache %s: %d layers x %s %s on %s (fused=%s)",
            kind.name,
            self.num_layers,
            shape,
            self.dtype,
            self.device,
            self._fused,
        )

    def sub_layers(self, start: int, end: int) -> PagedKVCache:
        """The cache of layers ``[start, end)`` only (their tensors shared; made once per range).

        The caller checks the range (:func:`kvmesh.kernels.layer_range.check_layer_range`).
        """
        if (start, end) == (0, self.num_layers):
            return self
        sub = self._sub_caches.get((start, end))
        if sub is None:
            sub = PagedKVCache(self.layers[start:end], self.kind)
            self._sub_caches[(start, end)] = sub  # a benign race: equal caches, last one wins
        return sub

    @property
    def fused(self) -> bool:
        """True when all layers share one storage at block-aligned offsets (one call per chunk)."""
        return self._fused

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """Shape of the L1 chunk object holding ``num_tokens`` tokens of this cache."""
        return (self.kv_size, self.num_layers, num_tokens, self.hidden)

    def chunk_nbytes(self, num_tokens: int) -> int:
        """Bytes of the L1 chunk object holding ``num_tokens`` tokens."""
        return self.kv_size * self.num_layers * num_tokens * self.hidden * self.itemsize

    # The helpers below are used by the ops; they are not part of the public API.

    def _row_elems(self, rows_per_block: int) -> int:
        """Elements in one row when a block is cut into ``rows_per_block`` rows."""
        return self.block_size * self.hidden // rows_per_block

    def _paged_byte_offsets(self) -> list[int]:
        """Byte offsets the row views start at (one for a fused cache, else one per layer)."""
        if self._fused:
            return [self._base_offset * self.itemsize]
        return [int(layer.storage_offset()) * self.itemsize for layer in self.layers]

    def _fused_rows(self, rows_per_block: int, row_dtype: torch.dtype) -> torch.Tensor:
        """The storage from the lowest layer offset on, as rows of ``row_dtype``.

        Only valid when :attr:`fused`. Cached per (row size, dtype); the cache is
        filled under a lock because several threads may copy at once.
        """
        key = (rows_per_block, row_dtype)
        view = self._row_views.get(key)
        if view is not None:
            return view
        with self._row_views_lock:
            view = self._row_views.get(key)
            if view is None:
                row_elems = self._row_elems(rows_per_block)
                num_rows = (self._storage_elems - self._base_offset) // row_elems
                flat = self.layers[0].as_strided(
                    (num_rows, row_elems), (row_elems, 1), self._base_offset
                )
                view = flat.view(row_dtype)
                self._row_views[key] = view
        return view

    def _layer_rows(self, layer: int, rows_per_block: int, row_dtype: torch.dtype) -> torch.Tensor:
        """One layer as rows of ``row_dtype`` (the per-layer path)."""
        return self.layers[layer].view(-1, self._row_elems(rows_per_block)).view(row_dtype)

    def _fused_void_rows(self, rows_per_block: int) -> npt.NDArray[Any]:
        """:meth:`_fused_rows` as a NumPy array of one opaque ``void`` item per row (CPU only)."""
        key = ("fused", rows_per_block)
        view = self._void_views.get(key)
        if view is None:
            view = _as_void_rows(self._fused_rows(rows_per_block, torch.uint8))
            self._void_views[key] = view  # a benign race: equal views, last one wins
        return view

    def _layer_void_rows(self, layer: int, rows_per_block: int) -> npt.NDArray[Any]:
        """One layer's rows as a NumPy array of ``void`` items (CPU only)."""
        key = (layer, rows_per_block)
        view = self._void_views.get(key)
        if view is None:
            view = _as_void_rows(self._layer_rows(layer, rows_per_block, torch.uint8))
            self._void_views[key] = view
        return view

    def _row_strides(self, rows_per_block: int) -> tuple[int, int]:
        """(K/V plane stride, block stride) of one layer, in rows."""
        row_elems = self._row_elems(rows_per_block)
        return (
            self._geometry.kv_stride // row_elems,
            self._geometry.block_stride // row_elems,
        )

    def _layer_row_bases(self, rows_per_block: int) -> list[int]:
        """Row index of each layer's first element inside :meth:`_fused_rows`."""
        row_elems = self._row_elems(rows_per_block)
        return [o // row_elems for o in self._layer_offsets]


def _as_void_rows(rows: torch.Tensor) -> npt.NDArray[Any]:
    """Byte rows ``[R, row_bytes]`` as a NumPy array of ``R`` opaque items sharing their memory."""
    arr = rows.numpy()
    return arr.view(np.dtype((np.void, arr.shape[-1])))[:, 0]
