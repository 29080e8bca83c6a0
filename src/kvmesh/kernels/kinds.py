"""The engine KV layout kinds and their paged shapes: what a layout is, without torch.

:mod:`kvmesh.kernels.layouts` describes each kind's memory; this module holds
only the names and shapes, so a storage node can validate a registration's
geometry (and start serving) before it loads torch.
"""

from __future__ import annotations

import enum


class KVLayoutKind(enum.Enum):
    """Per-layer paged KV formats kvmesh moves (docs/kernels.md, "Layout kinds")."""

    FLASH_ATTN = "flash_attn"
    FLASHINFER = "flashinfer"
    MLA = "mla"
    VLLM_CPU = "vllm_cpu"
    VLLM_CPU_AMX = "vllm_cpu_amx"

    @property
    def is_vllm_cpu(self) -> bool:
        """vLLM's CPU layouts: ``[num_blocks, kv_heads, block_size, 2 * head_dim]``."""
        return self in (KVLayoutKind.VLLM_CPU, KVLayoutKind.VLLM_CPU_AMX)

    @property
    def kv_size(self) -> int:
        """Number of K/V planes a chunk object holds (1 for MLA's single latent plane)."""
        return 1 if self is KVLayoutKind.MLA else 2


def paged_layer_shape(
    kind: KVLayoutKind, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of one layer's paged tensor for ``kind`` (MLA ignores ``kv_heads``)."""
    if kind is KVLayoutKind.FLASH_ATTN:
        return (2, num_blocks, block_size, kv_heads, head_dim)
    if kind is KVLayoutKind.FLASHINFER:
        return (num_blocks, 2, block_size, kv_heads, head_dim)
    if kind.is_vllm_cpu:
        return (num_blocks, kv_heads, block_size, 2 * head_dim)
    return (num_blocks, block_size, head_dim)
