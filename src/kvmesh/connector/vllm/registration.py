"""vLLM's KV tensors → the registration kvmesh's storage maps (layout + one handle per layer).

On CPU the tensors are views into the connector's shared-memory file
(:mod:`.shm_pool`); on GPU each layer gets a CUDA IPC handle (:mod:`.cuda`).
A configuration kvmesh cannot move (a KV layout it has no kernel for, layers
that differ, an unsupported dtype) raises :class:`UnsupportedConfig`, whose
message is the one line the operator reads: vLLM stops at start rather than
run for weeks without the cache it was configured with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.api.common.v1 import common_pb2
from kvmesh.common.dtypes import proto_of_torch
from kvmesh.connector.vllm.cuda import gpu_layout_kind, ipc_handle, layout_fields
from kvmesh.connector.vllm.layouts import cpu_layout
from kvmesh.connector.vllm.shm_pool import SharedMemoryPool

if TYPE_CHECKING:
    import torch


class UnsupportedConfig(ValueError):
    """vLLM runs a configuration the connector does not serve (the message names it)."""


Registration = tuple[common_pb2.KVLayout, list[common_pb2.MemoryHandle]]


def distinct_layers(kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The KV tensors in layer order; layers that share one tensor appear once."""
    layers: list[torch.Tensor] = []
    seen: set[int] = set()
    for tensor in kv_caches.values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            layers.append(tensor)
    return layers


def layer_indices(kv_caches: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each layer name's index among :func:`distinct_layers` (shared tensors share one)."""
    index: dict[int, int] = {}
    names = {}
    for name, tensor in kv_caches.items():
        names[name] = index.setdefault(tensor.data_ptr(), len(index))
    return names


def _check_uniform(layers: list[torch.Tensor]) -> int:
    first = layers[0]
    if any(
        t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous() for t in layers
    ):
        raise UnsupportedConfig(
            "kvmesh: vLLM's KV layers differ in shape or dtype, or are not contiguous"
        )
    dtype = proto_of_torch(first.dtype)
    if dtype is None:
        raise UnsupportedConfig(f"kvmesh: KV cache dtype {first.dtype} is not supported")
    return dtype


def describe_cpu(
    layers: list[torch.Tensor], pool: SharedMemoryPool, block_size: int
) -> Registration:
    """CPU: the layout vLLM's CPU attention uses, and each layer's region of the pool's file."""
    first = layers[0]
    kind, problem = cpu_layout(first, vllm_block_size=block_size)
    if problem is not None:
        raise UnsupportedConfig(f"kvmesh cannot serve this engine: {problem}")
    dtype = _check_uniform(layers)
    offsets = [pool.offset_of(t) for t in layers]
    if any(o is None for o in offsets):
        raise UnsupportedConfig("kvmesh: a KV layer lies outside the connector's shared memory")
    num_blocks, kv_heads, block, width = first.shape
    layout = common_pb2.KVLayout(
        kind=kind,
        num_layers=len(layers),
        num_blocks=num_blocks,
        block_size=block,
        kv_heads=kv_heads,
        head_dim=width // 2,
        dtype=dtype,  # type: ignore[arg-type]
    )
    size = first.numel() * first.element_size()
    handles = [
        common_pb2.MemoryHandle(
            shared_memory=common_pb2.SharedMemoryHandle(
                path=str(pool.path), offset_bytes=offset or 0, size_bytes=size
            )
        )
        for offset in offsets
    ]
    return layout, handles


def describe_cuda(layers: list[torch.Tensor], block_size: int) -> Registration:
    """GPU: the layout, and one CUDA IPC handle per layer (storage opens them)."""
    first = layers[0]
    kind, problem = gpu_layout_kind(first, block_size=block_size)
    if problem is not None:
        raise UnsupportedConfig(f"kvmesh cannot serve this engine: {problem}")
    dtype = _check_uniform(layers)
    layout = common_pb2.KVLayout(
        kind=kind,
        num_layers=len(layers),
        dtype=dtype,  # type: ignore[arg-type]
        **layout_fields(kind, tuple(first.shape)),
    )
    return layout, [ipc_handle(t) for t in layers]
