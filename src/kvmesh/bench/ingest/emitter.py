"""The emitter processes of ``kvmesh bench ingest``.

Each pre-serializes its STORE batches, then streams them to
``EventIngestService.StreamEvents`` with ``grpc.aio``, at most ``window`` batches
in flight, grouped as the storage node's link groups them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from typing import Any

import grpc

from kvmesh.api.coordinator.v1 import ingest_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.bench.coordinator_core import Emitter
from kvmesh.common.convert import batch_to_proto
from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey, worker_kv_rank
from kvmesh.coordinator.servicers.ingest import BATCH_GROUPS_METADATA

from .params import MODEL, SALT, START_TIMEOUT_S

STREAM_METHOD = "/kvmesh.coordinator.v1.EventIngestService/StreamEvents"

#: Keys each emitter hands back for the lookup phase.
_SAMPLE_PER_EMITTER = 512


@dataclass(frozen=True)
class EmitterJob:
    """What one emitter process streams."""

    index: int
    target: str
    batches: int
    batch_entries: int
    window: int
    group: int
    l1_share: int
    tokens: bool
    seed: int


@dataclass
class EmitterResult:
    """Send and ack times (monotonic ns) of one emitter's batches, in seq order."""

    index: int
    send_ns: array[int]
    ack_ns: array[int]
    admitted: int
    sample: list[ObjectKey]
    cpu_s: float
    messages: int
    error: str = ""


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Wire tags (field << 3 | 2) of StreamEventsRequest.batch, StreamEventsRequest.batches
# and BatchGroup.batches: a request is built from serialized batches by joining bytes.
_BATCH_TAG = b"\x12"
_GROUP_TAG = b"\x22"
_GROUP_ITEM_TAG = b"\x0a"


def _group_request(items: Sequence[bytes]) -> bytes:
    """A ``StreamEventsRequest{batches}`` from batches as ``_GROUP_ITEM_TAG len batch`` each."""
    body = b"".join(items)
    return _GROUP_TAG + _varint(len(body)) + body


def _build_payloads(job: EmitterJob) -> tuple[bytes, list[bytes], list[bytes], list[ObjectKey]]:
    """The serialized ``open`` message, every batch as a request and as a group item, a sample.

    ``payloads[i]`` is ``StreamEventsRequest{batch}``; ``items[i]`` the same
    batch as one element of ``BatchGroup.batches`` (see :func:`_group_request`).
    """
    rng = random.Random(job.seed * 1000 + job.index)
    rank = worker_kv_rank(1, 0)
    emitter = Emitter(f"bench-node-{job.index}", incarnation=1)
    tokens = tuple(range(1000, 1256)) if job.tokens else ()
    opening = ingest_pb2.StreamEventsRequest(
        open=ingest_pb2.StreamOpen(instance_id=emitter.instance_id, incarnation=1)
    ).SerializeToString()
    payloads: list[bytes] = []
    items: list[bytes] = []
    sample: list[ObjectKey] = []
    every = max(1, job.batches * job.batch_entries // _SAMPLE_PER_EMITTER)
    n = 0
    for i in range(job.batches):
        keys = [
            ObjectKey(rng.randbytes(32), MODEL, rank, 0, SALT) for _ in range(job.batch_entries)
        ]
        for k in keys:
            if n % every == 0 and len(sample) < _SAMPLE_PER_EMITTER:
                sample.append(k)
            n += 1
        tier = Tier.L1 if job.l1_share and i % job.l1_share == 0 else Tier.L2
        wire = batch_to_proto(emitter.batch(keys, tier, tokens=tokens)).SerializeToString()
        framed = _varint(len(wire)) + wire
        payloads.append(_BATCH_TAG + framed)
        items.append(_GROUP_ITEM_TAG + framed)
    # The hand-made framing must be the real one.
    parse = ingest_pb2.StreamEventsRequest.FromString
    if (
        parse(payloads[0]).batch.seq != 1
        or [b.seq for b in parse(_group_request(items[:2])).batches.batches] != [1, 2][: len(items)]
    ):
        raise RuntimeError("bench framing of StreamEventsRequest is wrong")
    return opening, payloads, items, sample


def emitter_main(job: EmitterJob, ready: Any, go: EventType, results: Any) -> None:
    """One emitter process: prepare, report ready, wait for go, stream, report times."""
    try:
        prepared = _build_payloads(job)
    except Exception as exc:
        ready.put((job.index, f"{type(exc).__name__}: {exc}"))
        return
    asyncio.run(_emit(job, *prepared, ready, go, results))


async def _emit(
    job: EmitterJob,
    opening: bytes,
    payloads: list[bytes],
    items: list[bytes],
    sample: list[ObjectKey],
    ready: Any,
    go: EventType,
    results: Any,
) -> None:
    """Stream every batch over one ``StreamEvents`` call and report the times.

    ``grpc.aio``: a write and a read are one completion each on this
    process's event loop, with no hand-off to a request thread per message
    (the synchronous API's request iterator costs a thread switch per batch),
    so the emitters take as little as possible of the CPU the coordinator
    shares with them.
    """
    try:
        channel = grpc.aio.insecure_channel(
            job.target, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)]
        )
        await asyncio.wait_for(channel.channel_ready(), START_TIMEOUT_S)
        stream: grpc.aio.StreamStreamMultiCallable[bytes, ingest_pb2.StreamEventsResponse]
        stream = channel.stream_stream(
            STREAM_METHOD,
            request_serializer=None,  # the requests are bytes already
            response_deserializer=ingest_pb2.StreamEventsResponse.FromString,
        )
    except Exception as exc:
        ready.put((job.index, f"{type(exc).__name__}: {exc}"))
        return
    ready.put((job.index, ""))
    go.wait()  # nothing else runs on this loop yet: blocking here is fine
    n = len(payloads)
    send_ns = array("q", bytes(8 * n))
    ack_ns = array("q", bytes(8 * n))
    clock = time.monotonic_ns
    room = job.window  # batches the window lets out now
    room_freed = asyncio.Event()
    messages = admitted = acked = 0
    error = ""
    cpu0 = time.process_time()
    call = stream()

    async def send() -> None:
        nonlocal room, messages
        await call.write(opening)
        # Groups only once the coordinator announced them (ingest.proto). The
        # first batch waits for the announcement: batches sent singly come back
        # with single acks, which free the window one batch at a time and would
        # keep later messages single too.
        group_limit = 1
        for key, value in await call.initial_metadata() or ():
            if key == BATCH_GROUPS_METADATA:
                group_limit = max(1, min(job.group, int(value)))
        i = 0
        while i < n:
            while room == 0:
                room_freed.clear()
                await room_freed.wait()
            # Every batch the window lets out now goes in this message.
            k = min(room, group_limit, n - i)
            room -= k
            now = clock()
            for j in range(i, i + k):
                send_ns[j] = now
            messages += 1
            await call.write(payloads[i] if k == 1 else _group_request(items[i : i + k]))
            i += k
        await call.done_writing()  # half-close: the coordinator ends the call

    sender = asyncio.create_task(send())
    try:
        async for response in call:
            kind = response.WhichOneof("kind")
            if kind == "ack":
                acks: Sequence[ingest_pb2.BatchAck] = (response.ack,)
            elif kind == "acks":
                acks = response.acks.acks
            else:
                continue  # e.g. the resync the coordinator asks of a new emitter
            now = clock()
            for ack in acks:
                ack_ns[ack.seq - 1] = now
                acked += 1
                if ack.result == events_pb2.INGEST_RESULT_ADMITTED:
                    admitted += 1
            # All at once, so the sender sees the whole group's room.
            room += len(acks)
            room_freed.set()
        await sender
    except grpc.RpcError as exc:
        error = f"stream failed after {acked} acks: {exc.code().name}: {exc.details()}"
    finally:
        sender.cancel()
        # Its own failure (a write on a broken stream) is the one reported above.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sender
        await channel.close()
    if acked != n and not error:
        error = f"stream ended after {acked} of {n} acks"
    cpu_s = time.process_time() - cpu0
    results.put(EmitterResult(job.index, send_ns, ack_ns, admitted, sample, cpu_s, messages, error))
