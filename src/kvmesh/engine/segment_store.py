"""Documents' K/V kept in a kvmesh node, found again by their tokens alone.

Prefix caching keys a chunk by the chained hash of every token before it, so
a document's K/V is found only after the same prefix. A blending engine needs
it after any prefix: here a segment (one document) is one L1 object, keyed by
the model, the salt and the segment's tokens (docs/blend.md, "Segments in
storage"). Its keys are stored rotated to positions ``0..``
(:func:`kvmesh.kernels.rope.rerope`), so a reader moves them to wherever the
segment now sits without knowing where it was computed.

The store talks to the node's gateway like any engine: it registers an
engine-driven context (its model's K/V geometry), and each segment's object,
``[2, layers, tokens, kv_heads, head_dim]`` (keys, then values) in the K/V's
dtype, is written into or read from the node's shared-memory L1 through
``PrepareSegmentStore``/``CommitStore`` and ``PrepareSegmentRetrieve``/
``CommitRetrieve``, so the engine runs on the node's host. A gateway that
forgot the context (it restarted, or reaped it) gets it again on the next call.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import grpc
import torch

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.common.dtypes import proto_of_torch
from kvmesh.engine.blend import Segment
from kvmesh.engine.llama import SequenceKV
from kvmesh.gateway.client import GatewayClient
from kvmesh.kernels.rope import RopeParams, rerope

_Resp = TypeVar("_Resp")


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
    """Put and get segments' K/V through the gateway at ``target`` (``host:port`` or a lane)."""

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
        proto_dtype = proto_of_torch(dtype)
        if proto_dtype is None:
            raise ValueError(f"kvmesh does not store {dtype} K/V")
        self.model_name = model_name
        self.rope = rope
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.dtype = dtype
        self.cache_salt = cache_salt
        self.timeout_s = timeout_s
        self.engine_id = f"kvmesh-blend-{uuid.uuid4().hex[:12]}"
        self._registration = gateway_pb2.RegisterEngineContextRequest(
            engine_id=self.engine_id,
            model_name=model_name,
            world_size=1,
            worker_id=0,
            layout=gateway_pb2.EngineContextLayout(
                num_layers=num_layers,
                block_size=1,
                kv_heads=kv_heads,
                head_dim=rope.head_dim,
                dtype=proto_dtype,  # type: ignore[arg-type]
            ),
        )
        self._client = GatewayClient(target)
        try:
            self._register()
        except BaseException:
            self._client.close()
            raise

    def close(self) -> None:
        """Forget the context on the gateway (best effort) and close the channel."""
        try:
            self._client.unregister_engine_context(
                gateway_pb2.UnregisterEngineContextRequest(engine_id=self.engine_id),
                timeout=self.timeout_s,
            )
        except grpc.RpcError:
            pass  # the gateway is gone: it has forgotten the context already
        finally:
            self._client.close()

    def __enter__(self) -> SegmentStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _register(self) -> None:
        # Waits (within the timeout) for a gateway that is not accepting yet rather than
        # failing at the first refused connection: this runs right after a node starts
        # (bench blend), and once again after a gateway restarted.
        self._client.register_engine_context(
            self._registration, timeout=self.timeout_s, wait_for_ready=True
        )

    def _call(self, call: Callable[[], _Resp]) -> _Resp:
        """``call()``, registering the context again once if the gateway forgot it."""
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
        self._register()
        return call()

    def _shape(self, rows: int) -> tuple[int, ...]:
        return (2, self.num_layers, rows, self.kv_heads, self.rope.head_dim)

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
        request = gateway_pb2.PrepareSegmentStoreRequest(
            engine_id=self.engine_id, cache_salt=self.cache_salt, token_ids=list(tokens)
        )
        prepared = self._call(
            lambda: self._client.prepare_segment_store(request, timeout=self.timeout_s)
        )
        if not prepared.transaction_id:
            return False
        src = torch.arange(source_start, source_start + rows)
        at_zero = torch.arange(rows)  # the segment as if it started the prompt
        with _mapped(prepared.region, write=True) as view:
            out = torch.frombuffer(view, dtype=self.dtype).view(self._shape(rows))
            for layer in range(self.num_layers):
                keys = kv.keys[layer].to(self.dtype)
                out[0, layer] = rerope(keys, src, at_zero, self.rope)
                out[1, layer] = kv.values[layer].to(self.dtype)
            del out
        self._client.commit_store(
            gateway_pb2.CommitStoreRequest(
                engine_id=self.engine_id, transaction_id=prepared.transaction_id
            ),
            timeout=self.timeout_s,
        )
        return True

    def get(self, tokens: Sequence[int]) -> SequenceKV | None:
        """``tokens``' K/V with keys at positions 0.. (a copy), or None when not resident."""
        rows = len(tokens)
        request = gateway_pb2.PrepareSegmentRetrieveRequest(
            engine_id=self.engine_id, cache_salt=self.cache_salt, token_ids=list(tokens)
        )
        prepared = self._call(
            lambda: self._client.prepare_segment_retrieve(request, timeout=self.timeout_s)
        )
        if not prepared.transaction_id:
            return None
        try:
            with _mapped(prepared.region, write=False) as view:
                data = torch.frombuffer(bytearray(view), dtype=self.dtype).view(self._shape(rows))
        finally:
            protected = self._commit_retrieve(prepared.transaction_id)
        if not protected:
            return None  # what the copy read may be another segment's bytes: computed
        return SequenceKV(list(data[0].unbind(0)), list(data[1].unbind(0)))

    def _commit_retrieve(self, transaction_id: str) -> bool:
        """Release a prepared retrieve; False when its locks did not last to the commit.

        ABORTED: they lapsed before it; NOT_FOUND: the node's sweep forgot the
        transaction when they lapsed (or the node restarted). Either way the
        copy was not protected to its end.
        """
        try:
            self._client.commit_retrieve(
                gateway_pb2.CommitRetrieveRequest(
                    engine_id=self.engine_id, transaction_id=transaction_id
                ),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND):
                raise
            return False
        return True

    def find(self, tokens: Sequence[int], stride: int = 1) -> list[tuple[int, int]]:
        """Stored segments inside the prompt ``tokens``: (start, length) in prompt order.

        Found by the gateway's fingerprint index (``LookupSegments``): segments of at
        least 16 tokens starting at a multiple of ``stride``.
        """
        request = gateway_pb2.LookupSegmentsRequest(
            engine_id=self.engine_id,
            cache_salt=self.cache_salt,
            token_ids=list(tokens),
            stride=stride,
        )
        found = self._call(lambda: self._client.lookup_segments(request, timeout=self.timeout_s))
        return [(m.start_token, m.num_tokens) for m in found.matches]

    def segments(self, tokens: Sequence[int], stride: int = 1) -> list[Segment]:
        """The prompt as blend segments: each stored one found in it with its K/V, the
        tokens between them without (docs/blend.md, "Finding segments in a prompt")."""
        out: list[Segment] = []
        at = 0
        for start, length in self.find(tokens, stride):
            kv = self.get(tokens[start : start + length])
            if kv is None:  # evicted since the lookup: computed instead
                continue
            if start > at:
                out.append(Segment(tokens[at:start]))
            out.append(Segment(tokens[start : start + length], kv, source_start=0))
            at = start + length
        if at < len(tokens):
            out.append(Segment(tokens[at:]))
        return out
