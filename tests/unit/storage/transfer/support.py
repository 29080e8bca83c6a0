"""Helpers of the TransferEngine tests: layouts, KV caches in files, chunks, mappings.

Engine KV caches live in shared-memory files with guard bytes around every
layer; the process's mappings are read from /proc.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvmesh.kernels import KVLayoutKind, PagedKVCache
from kvmesh.storage.core.transfer.cuda_ipc import CudaIpcHandle
from kvmesh.storage.core.transfer.layout import KVLayout, chunk_shape
from kvmesh.storage.core.transfer.shm import SharedMemoryHandle

LAYOUTS = list(KVLayoutKind)

HEADER = 4096  # bytes before the first layer and between layers, never to be touched
TRAILER = 100


def make_layout(
    kind: KVLayoutKind = KVLayoutKind.FLASH_ATTN,
    dtype: torch.dtype | str = torch.bfloat16,
    *,
    num_layers: int = 2,
    num_blocks: int = 8,
    block_size: int = 16,
) -> KVLayout:
    kv_heads = 1 if kind is KVLayoutKind.MLA else 2
    head_dim = 16 if kind is KVLayoutKind.VLLM_CPU_AMX else 8  # AMX tiles 16 dims
    return KVLayout(kind, num_layers, num_blocks, block_size, kv_heads, head_dim, dtype)


@dataclass
class ShmKV:
    """Shared-memory files holding a layout's layers, with guard bytes around every layer."""

    layout: KVLayout
    handles: list[SharedMemoryHandle]

    def file_bytes(self) -> dict[str, bytes]:
        return {h.path: Path(h.path).read_bytes() for h in self.handles}

    def private_copy(self) -> PagedKVCache:
        """The layers as ordinary tensors, read from the files (not mapped)."""
        layers = []
        for h in self.handles:
            raw = Path(h.path).read_bytes()[h.offset_bytes : h.offset_bytes + h.size_bytes]
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            layers.append(t.view(self.layout.dtype).view(self.layout.layer_shape))
        return PagedKVCache(layers, self.layout.kind)

    def layers_from_files(self) -> list[torch.Tensor]:
        return list(self.private_copy().layers)


def make_shm_kv(directory: Path, layout: KVLayout, split: str = "one_file", seed: int = 0) -> ShmKV:
    rng = np.random.default_rng(seed)
    size = layout.layer_nbytes
    handles = []
    if split == "one_file":
        path = directory / "kv_cache"
        total = HEADER + layout.num_layers * (size + HEADER) + TRAILER
        path.write_bytes(_random_kv_bytes(rng, total, layout.dtype))
        handles = [
            SharedMemoryHandle(str(path), HEADER + i * (size + HEADER), size)
            for i in range(layout.num_layers)
        ]
    else:
        for i in range(layout.num_layers):
            path = directory / f"kv_layer_{i}"
            path.write_bytes(_random_kv_bytes(rng, HEADER + size + TRAILER, layout.dtype))
            handles.append(SharedMemoryHandle(str(path), HEADER, size))
    return ShmKV(layout, handles)


def _random_kv_bytes(rng: np.random.Generator, nbytes: int, dtype: torch.dtype) -> bytes:
    # Finite values of the dtype, so torch.equal comparisons mean byte equality.
    itemsize = torch.empty(0, dtype=dtype).element_size()
    values = torch.from_numpy(rng.standard_normal(nbytes // itemsize).astype(np.float32))
    return values.to(dtype).view(torch.uint8).numpy().tobytes() + b"\x00" * (nbytes % itemsize)


def random_chunk(layout: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(chunk_shape(layout, num_tokens), generator=gen).to(layout.dtype)


def cuda_handle() -> CudaIpcHandle:
    layout = make_layout()
    numel = 1
    for d in layout.layer_shape:
        numel *= d
    stride = torch.empty(layout.layer_shape, device="meta").stride()
    return CudaIpcHandle(
        device_index=0,
        ipc_handle=b"\x01" * 64,
        storage_size_bytes=numel * 2,
        storage_offset_bytes=0,
        ref_counter_handle=b"ref",
        ref_counter_offset=0,
        event_handle=b"",
        event_sync_required=False,
        shape=layout.layer_shape,
        stride=tuple(stride),
        tensor_offset=0,
    )


def _maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return f.read().splitlines()


def mapped_paths(root: Path) -> list[str]:
    """Distinct files under ``root`` this process has mapped (Linux /proc)."""
    prefix = str(root)
    paths = {line.split(maxsplit=5)[-1] for line in _maps() if prefix in line}
    return sorted(p for p in paths if p.startswith(prefix))


def mapping_count(path: str) -> int:
    return sum(1 for line in _maps() if line.endswith(path))
