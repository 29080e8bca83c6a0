"""Engines' KV memory on a GPU: the CUDA IPC handle, and opening it in this process.

A :class:`CudaIpcHandle` carries the fields of torch's ``_share_cuda_()`` for
one layer's paged tensor (on GPU hosts). :func:`open_cuda_ipc` checks each
handle against the layout (shape, contiguous stride, the layer fitting its
storage, one device for all layers) before it maps the storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.common.errors import FailedPrecondition, InvalidArgument
from kvmesh.storage.core.transfer.layout import KVLayout

if TYPE_CHECKING:  # loaded by the functions that touch a device
    import torch


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
        import torch

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


def _cuda_device_for(handle: CudaIpcHandle, field_name: str) -> int:
    import torch

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


def open_cuda_ipc(layout: KVLayout, handles: tuple[CudaIpcHandle, ...]) -> list[torch.Tensor]:
    """Open each layer's CUDA IPC handle as a tensor (the storage is mapped once per handle)."""
    import torch

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
