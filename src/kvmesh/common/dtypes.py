"""The KV dtypes kvmesh moves: one table from the contract's ``DType`` to name and size.

Every place that turns a ``kvmesh.common.v1.DType`` into something else (an
element size for validation, a torch dtype for a copy, a short name for a
benchmark flag) reads this table, so adding a dtype is one line here. torch is
not imported: callers that need a ``torch.dtype`` ask :func:`torch_dtype`,
which looks it up by name when it is called (the client side never loads
torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.api.common.v1 import common_pb2

if TYPE_CHECKING:  # torch is a type here only; see torch_dtype()
    import torch


@dataclass(frozen=True)
class KVDType:
    """One dtype of the contract: its enum value, torch attribute name, size and short name."""

    proto: int
    torch_name: str
    itemsize: int
    short: str


KV_DTYPES: tuple[KVDType, ...] = (
    KVDType(common_pb2.DTYPE_FLOAT16, "float16", 2, "fp16"),
    KVDType(common_pb2.DTYPE_BFLOAT16, "bfloat16", 2, "bf16"),
    KVDType(common_pb2.DTYPE_FLOAT32, "float32", 4, "fp32"),
    KVDType(common_pb2.DTYPE_FLOAT8_E4M3FN, "float8_e4m3fn", 1, "fp8_e4m3"),
    KVDType(common_pb2.DTYPE_FLOAT8_E5M2, "float8_e5m2", 1, "fp8_e5m2"),
    KVDType(common_pb2.DTYPE_UINT8, "uint8", 1, "u8"),
)
BY_PROTO: dict[int, KVDType] = {d.proto: d for d in KV_DTYPES}
BY_SHORT: dict[str, KVDType] = {d.short: d for d in KV_DTYPES}
BY_TORCH_NAME: dict[str, KVDType] = {d.torch_name: d for d in KV_DTYPES}


def itemsize(proto: int) -> int | None:
    """Bytes per element of a contract dtype, or None when the value is not one kvmesh moves."""
    found = BY_PROTO.get(proto)
    return None if found is None else found.itemsize


def torch_dtype(proto: int) -> torch.dtype | None:
    """The torch dtype of a contract dtype (None when unknown); imports torch on first use."""
    found = BY_PROTO.get(proto)
    if found is None:
        return None
    import torch

    dtype: torch.dtype = getattr(torch, found.torch_name)
    return dtype


def proto_of_torch(dtype: torch.dtype) -> int | None:
    """The contract dtype of a torch dtype, or None when kvmesh does not move it."""
    found = BY_TORCH_NAME.get(str(dtype).removeprefix("torch."))
    return None if found is None else found.proto
