"""The engine's paged KV cache in one shared-memory file, and its block allocator.

Layout: exactly vLLM's flash-attention layout, one tensor per layer::

    [2, num_blocks, block_size, kv_heads, head_dim]      # plane 0 = K, plane 1 = V

All layers live in ONE file under ``/dev/shm``, layer ``i`` at byte offset
``i * layer_bytes``, so a kvmesh storage node can map the very same memory
(one ``SharedMemoryHandle`` per layer: path, offset, size) and copy blocks in
and out without the engine doing any copy work (docs/architecture.md, "Engine memory").

Token ``p`` of a request with block table ``block_ids`` lives in block
``block_ids[p // block_size]`` at row ``p % block_size`` (vLLM's slot mapping).
Block 0 is reserved as the null block, as in vLLM, and never handed out.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: vLLM reserves block 0 as a placeholder ("null block"); so do we.
NULL_BLOCK_ID = 0


class NoFreeBlocksError(RuntimeError):
    """The allocator cannot satisfy a request for blocks."""


class BlockAllocator:
    """Hands out KV blocks; free blocks are reused oldest-freed first (vLLM's free queue)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self._free: collections.deque[int] = collections.deque(range(1, num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now."""
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks; raises :class:`NoFreeBlocksError` (taking none) if too few."""
        if count < 0:
            raise ValueError("count must be >= 0")
        if count > len(self._free):
            raise NoFreeBlocksError(
                f"{count} blocks requested, {len(self._free)} free of {self.num_blocks}"
            )
        blocks = [self._free.popleft() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks; freeing a block that is not allocated raises ``ValueError``."""
        ids = list(block_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate block ids in free: {ids}")
        unknown = [b for b in ids if b not in self._used]
        if unknown:
            raise ValueError(f"blocks not allocated: {unknown}")
        for b in ids:
            self._used.remove(b)
            self._free.append(b)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class LayerRegion:
    """Where one layer's tensor lives in the shared-memory file."""

    path: str
    offset_bytes: int
    size_bytes: int


class SharedKVCache:
    """Per-layer paged KV tensors backed by one file in a shared-memory directory.

    The file is created here (exclusively, mode 0600) and unlinked by
    :meth:`close`; use the object as a context manager so it never outlives
    the engine.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        shm_dir: str | os.PathLike[str] = "/dev/shm",
        name: str | None = None,
    ) -> None:
        for label, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{label} must be >= 1")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.layer_shape = (2, num_blocks, block_size, kv_heads, head_dim)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.layer_numel = 2 * num_blocks * block_size * kv_heads * head_dim
        self.layer_bytes = self.layer_numel * itemsize
        self.path = str(Path(shm_dir) / (name or f"kvmesh-engine-{uuid.uuid4().hex[:12]}-kv"))
        total = self.layer_bytes * num_layers
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, total)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        try:
            # MAP_SHARED mapping of the file: what storage writes is what the model reads.
            self._storage = torch.from_file(
                self.path, shared=True, size=self.layer_numel * num_layers, dtype=dtype
            )
        except BaseException:
            os.unlink(self.path)
            raise
        self.layers: list[torch.Tensor] = [
            self._storage[i * self.layer_numel : (i + 1) * self.layer_numel].view(self.layer_shape)
            for i in range(num_layers)
        ]
        self._closed = False
        logger.debug(
            "KV cache %s: %d layers x %s, %.1f MiB",
            self.path,
            num_layers,
            self.layer_shape,
            total / 2**20,
        )

    def region(self, layer: int) -> LayerRegion:
        """The shared-memory region of one layer (what RegisterKVCache sends)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(layer)
        return LayerRegion(self.path, layer * self.layer_bytes, self.layer_bytes)

    def regions(self) -> list[LayerRegion]:
        """Every layer's region, in layer order."""
        return [self.region(i) for i in range(self.num_layers)]

    def named_layers(self, prefix: str = "model.layers") -> dict[str, torch.Tensor]:
        """``{layer name: tensor}`` as vLLM hands them to ``register_kv_caches``."""
        return {f"{prefix}.{i}.self_attn": t for i, t in enumerate(self.layers)}

    def copy_blocks(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        """Copy whole blocks (every layer, K and V): what a cache hit amounts to."""
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError("src and dst block lists differ in length")
        src = torch.tensor(list(src_block_ids), dtype=torch.long)
        dst = torch.tensor(list(dst_block_ids), dtype=torch.long)
        for layer in self.layers:
            layer.index_copy_(1, dst, layer.index_select(1, src))

    def close(self) -> None:
        """Drop the mapping and unlink the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.layers = []
        del self._storage
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> SharedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
