"""Documents' K/V kept in a kvmesh storage node under keys of their tokens alone.

Prefix caching keys a chunk by the chained hash of every token before it, so
a document's K/V is found only after the same prefix. A blending engine needs
it after any prefix (docs/blend.md, "Segments in storage"): here a segment
(one document) is one L1 object whose key is a blake3 digest of the model's
name and the segment's tokens, nothing else. Its keys are stored rotated to
position 0 (:func:`kvmesh.kernels.rope.rerope`), so a reader moves them to
wherever the segment now sits without knowing where it was computed.

The object is ``[2, layers, tokens, kv_heads, head_dim]`` (keys, then values)
in the K/V's dtype, written into and read from the node's shared-memory L1
through its engine-driven calls (PrepareStore/CommitStore,
PrepareRetrieve/CommitRetrieve), so the engine must run on the node's host.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import blake3
import grpc
import torch

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.storage.v1 import storage_pb2, storage_pb2_grpc
from kvmesh.engine.llama import SequenceKV
from kvmesh.kernels.rope import RopeParams, rerope

_DOMAIN = b"kvmesh-blend-segment/v1\0"


def segment_key(model_name: str, tokens: Sequence[int]) -> bytes:
    """The 32-byte key of a segment: its model and its tokens, not its position or prefix."""
    digest = blake3.blake3(_DOMAIN + model_name.encode() + b"\0")
    digest.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().astype("<u4").tobytes())
    return digest.digest()


@contextmanager
def _mapped(region: common_pb2.SharedMemoryHandle, write: bool) -> Iterator[memoryview]:
    """A view of a slot's bytes in the node's shared-memory segment file."""
    start = region.offset_bytes - region.offset_bytes % mmap.ALLOCATIONGRANULARITY
    length = region.offset_bytes + region.size_bytes - start
    fd = os.open(region.path, os.O_RDWR if write else os.O_RDONLY)
    try:
        access = mmap.ACCESS_WRITE if write else mmap.ACCESS_READ
        mapping = mmap.mmap(fd, length, access=access, offset=start)
    finally:
        os.close(fd)
    at = region.offset_bytes - start
    view = memoryview(mapping)[at : at + region.size_bytes]
    try:
        yield view
    finally:
        view.release()
        mapping.close()


class SegmentStore:
    """Put and get segments' K/V in the storage node at ``target`` (``host:port``)."""

    def __init__(
        self,
        target: str,
        model_name: str,
        rope: RopeParams,
        *,
        num_layers: int,
        kv_heads: int,
        dtype: torch.dtype = torch.float32,
        cache_salt: str = "",
        timeout_s: float = 10.0,
    ) -> None:
        self.model_name = model_name
        self.rope = rope
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.dtype = dtype
        self.cache_salt = cache_salt
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(target)
        self._stub = storage_pb2_grpc.StorageServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SegmentStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keys(self, tokens: Sequence[int]) -> common_pb2.ChunkKeys:
        return common_pb2.ChunkKeys(
            model_name=self.model_name,
            cache_salt=self.cache_salt,
            chunk_hashes=[segment_key(self.model_name, tokens)],
        )

    def _shape(self, rows: int) -> tuple[int, ...]:
        return (2, self.num_layers, rows, self.kv_heads, self.rope.head_dim)

    def _nbytes(self, rows: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return torch.Size(self._shape(rows)).numel() * element

    def put(self, tokens: Sequence[int], kv: SequenceKV, source_start: int) -> bool:
        """Store ``tokens``' K/V (keys roped at ``source_start``..); False when it was there.

        Raises ``ValueError`` for K/V of another shape and ``grpc.RpcError`` when the
        node refuses (RESOURCE_EXHAUSTED: it does not fit in L1).
        """
        rows = len(tokens)
        if len(kv) != rows or len(kv.keys) != self.num_layers:
            raise ValueError(
                f"K/V of {len(kv.keys)} layers x {len(kv)} rows for {rows} tokens of a "
                f"{self.num_layers}-layer model"
            )
        request = storage_pb2.PrepareStoreRequest(
            keys=self._keys(tokens), chunk_bytes=self._nbytes(rows)
        )
        prepared = self._stub.PrepareStore(request, timeout=self.timeout_s)
        if not prepared.slots:
            return False
        src = torch.arange(source_start, source_start + rows)
        at_zero = torch.arange(rows)  # the segment as if it started the prompt
        with _mapped(prepared.slots[0].region, write=True) as view:
            out = torch.frombuffer(view, dtype=self.dtype).view(self._shape(rows))
            for layer in range(self.num_layers):
                keys = kv.keys[layer].to(self.dtype)
                out[0, layer] = rerope(keys, src, at_zero, self.rope)
                out[1, layer] = kv.values[layer].to(self.dtype)
            del out
        self._stub.CommitStore(
            storage_pb2.CommitStoreRequest(transaction_id=prepared.transaction_id),
            timeout=self.timeout_s,
        )
        return True

    def get(self, tokens: Sequence[int]) -> SequenceKV | None:
        """``tokens``' K/V with keys at positions 0.. (a copy), or None when not resident."""
        rows = len(tokens)
        prepared = self._stub.PrepareRetrieve(
            storage_pb2.PrepareRetrieveRequest(
                keys=self._keys(tokens), chunk_bytes=self._nbytes(rows)
            ),
            timeout=self.timeout_s,
        )
        if not prepared.slots:
            return None
        try:
            with _mapped(prepared.slots[0].region, write=False) as view:
                # A read-only mapping: torch warns about (never does) writes through it.
                data = torch.frombuffer(bytearray(view), dtype=self.dtype).view(self._shape(rows))
        finally:
            self._stub.CommitRetrieve(
                storage_pb2.CommitRetrieveRequest(transaction_id=prepared.transaction_id),
                timeout=self.timeout_s,
            )
        return SequenceKV(list(data[0].unbind(0)), list(data[1].unbind(0)))
