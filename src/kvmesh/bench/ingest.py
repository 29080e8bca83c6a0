"""``kvmesh bench ingest``: cache-event ingest and directory lookups through a real coordinator.

DESIGN §7: LMCache 0.5.6 ingests 15–20k entries/s (64-entry store batches, 4
emitters) with ack p99 4.7–9.1 ms and stalls up to 0.75 s (full garbage
collections that grow with the directory); a 16-key directory lookup takes
about 1 ms. Targets: at least 10x its entries/s, p99 at most 5 ms and no
stall over 50 ms.

What runs, as deployed:

* the coordinator is a ``kvmesh coordinator`` subprocess on a loopback port
  (timers that do not matter here are off: health sweep, eviction loop);
* ``--emitters`` emitter processes (separate processes, so their Python
  work never competes with the coordinator for one GIL) each open one
  ``EventIngestService.StreamEvents`` call and stream ``--batch-entries``
  -entry STORE batches of fresh keys, at most ``--window`` batches in flight
  (sent, not yet acked). Window 1 is what LMCache's figures were measured
  with (its HTTP sink posts one flush at a time and waits for the answer).
  With a larger window an emitter sends the batches the window lets out at
  once as one ``batches`` group (at most ``--group`` per message, default
  the window; 1 never groups), as the storage node's link does with
  batches already waiting: one message and one AckGroup per group instead
  of one per batch, which is where gRPC's per-message cost goes. Batches
  stay ``--batch-entries`` entries each and every batch's ack latency is
  still measured on its own; the window adds queueing to every ack
  (Little's law). ``--window`` takes several values to run one
  configuration after another, each against a fresh coordinator. The
  default runs first what a storage node runs (window
  ``DEFAULT_MAX_IN_FLIGHT_BATCHES`` of ``kvmesh.storage.events.emitter``, 2,
  with groups: the headline figures), then window 1 without groups
  (LMCache's synchronous flush, for the comparison). Every
  request is serialized before the clock starts (the stream sends the
  bytes as they are; a group is the batches' bytes joined) and each emitter
  streams with ``grpc.aio`` (a write and a read per message on its own event
  loop, no request thread to hand each message to), so the client side,
  which shares this machine's cores with the coordinator, costs little;
* all emitters start together; each batch's send and ack times are taken
  with the system-wide monotonic clock, so the emitters' timelines merge.

Figures:

* ``entries_per_s``: entries acked / (last ack − first send);
* ``ack_p50_ms`` / ``ack_p99_ms`` / ``ack_max_ms``: send → ack of each batch;
* ``max_stall_ms``: the longest gap between consecutive acks of the whole
  fleet (all emitters merged) while traffic flows — a coordinator pause
  shows here; ``max_stall_per_emitter_ms`` is the same per stream (it also
  counts an emitter process that was descheduled);
* ``lookup16_p50_ms`` / ``lookup16_p99_ms``: ``DirectoryService.Lookup`` of
  16 stored keys over the loaded directory, one call at a time;
* ``bytes_per_key``: growth of the coordinator's VmRSS (``/proc/<pid>/status``)
  from before ingest to after it, divided by ``num_keys`` from ``GetStats``;
* ``coordinator_cpu_s`` and ``entries_per_coordinator_cpu_s``: the
  coordinator's user+system CPU time during ingest, steadier than wall time
  on a shared machine; ``emitters_cpu_s``: what the emitter processes used
  meanwhile (on a 2-core machine they share the second core);
* ``batches_per_message``: batches per StreamEvents message actually sent
  (1.0 without groups).

Memory: about 60 MB of pre-serialized batches per million keys across the
emitters, plus the coordinator's directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import json
import logging
import multiprocessing as mp
import os
import queue
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.coordinator.v1 import directory_pb2, directory_pb2_grpc, ingest_pb2
from kvmesh.api.events.v1 import events_pb2
from kvmesh.bench.coordinator_core import Emitter
from kvmesh.common.convert import batch_to_proto, key_to_proto
from kvmesh.common.events import Tier
from kvmesh.common.keys import ObjectKey, worker_kv_rank
from kvmesh.coordinator.servicers.ingest import BATCH_GROUPS_METADATA
from kvmesh.storage.events.config import DEFAULT_MAX_IN_FLIGHT_BATCHES

logger = logging.getLogger(__name__)

STREAM_METHOD = "/kvmesh.coordinator.v1.EventIngestService/StreamEvents"
INGEST_SERVICE = "kvmesh.coordinator.v1.EventIngestService"
MODEL = "meta-llama/Llama-3.1-8B"
SALT = "tenant-a"
#: Keys each emitter hands back for the lookup phase.
_SAMPLE_PER_EMITTER = 512
_START_TIMEOUT_S = 60.0

#: DESIGN §7, measured on this machine kind.
LMCACHE_ENTRIES_PER_S = (15_000, 20_000)
LMCACHE_REFERENCE: dict[str, Any] = {
    "entries_per_s": LMCACHE_ENTRIES_PER_S,
    "ack_p99_ms": (4.7, 9.1),
    "max_stall_ms": 750.0,
    "lookup16_p50_ms": 1.0,
}
TARGETS = {"entries_per_s": 200_000, "ack_p99_ms": 5.0, "max_stall_ms": 50.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmesh bench ingest``."""
    parser.add_argument("--emitters", type=int, default=4, help="emitter processes (streams)")
    parser.add_argument("--batch-entries", type=int, default=64, help="entries per STORE batch")
    parser.add_argument(
        "--keys", type=int, default=1_000_000, help="keys ingested in all (split over emitters)"
    )
    parser.add_argument(
        "--window",
        type=int,
        nargs="+",
        default=[DEFAULT_MAX_IN_FLIGHT_BATCHES, 1],
        help="batches in flight (sent, not acked) per emitter; 1 is LMCache's synchronous flush."
        f" Several values: one run each (default: {DEFAULT_MAX_IN_FLIGHT_BATCHES}, the storage"
        " node's window, then 1)",
    )
    parser.add_argument(
        "--group",
        type=int,
        default=0,
        help="batches per StreamEvents message at most when the window lets out several"
        " (default 0: the window; 1: never group)",
    )
    parser.add_argument(
        "--l1-share",
        type=int,
        default=4,
        help="every n-th batch reports L1 (dram), the others L2 (fs); 0: L2 only",
    )
    parser.add_argument(
        "--tokens", action="store_true", help="stamp 256 token ids on every entry (bigger batches)"
    )
    parser.add_argument("--lookups", type=int, default=2000, help="16-key lookups timed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--coordinator-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the coordinator process (repeatable)",
    )


# --------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


try:
    # Loaded up front: the preexec hook runs between fork and exec, no place to load a library.
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc Linux: children are still stopped in ``finally``
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel SIGKILLs the
    # coordinator if this process dies, so a killed bench leaves nothing behind.
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _rss_bytes(pid: int) -> int:
    """VmRSS of ``pid`` in bytes."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (all threads)."""
    with open(f"/proc/{pid}/stat") as fh:
        # The command name may hold spaces: fields count from the closing parenthesis.
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


@dataclass
class CoordinatorProcess:
    """A ``kvmesh coordinator`` subprocess."""

    proc: subprocess.Popen[bytes]
    target: str
    log_path: Path

    def log_tail(self, limit: int = 3000) -> str:
        """The end of its log, for error messages."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""


@contextlib.contextmanager
def coordinator_process(workdir: Path, extra: Sequence[str] = ()) -> Iterator[CoordinatorProcess]:
    """Start ``kvmesh coordinator`` on a free port; SIGTERM (then SIGKILL) it on exit."""
    port = _free_port()
    log_path = workdir / "coordinator.log"
    args = [
        sys.executable,
        "-m",
        "kvmesh.cli",
        "coordinator",
        "--port",
        str(port),
        "--metrics-port",
        "-1",
        "--log-level",
        "WARNING",
        "--health-check-interval-seconds",
        "0",
        "--eviction-check-interval-seconds",
        "0",
        *extra,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Safe here: no gRPC channel exists in this process yet (a fork while
            # gRPC threads run would run gRPC's fork handlers in the child).
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )
    handle = CoordinatorProcess(proc, f"127.0.0.1:{port}", log_path)
    try:
        _wait_serving(handle)
        yield handle
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_serving(handle: CoordinatorProcess) -> None:
    """Poll the health service until ingest is SERVING; fail fast if the process died."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    with grpc.insecure_channel(handle.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            if handle.proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited at start:\n{handle.log_tail()}")
            try:
                reply = health.Check(
                    health_pb2.HealthCheckRequest(service=INGEST_SERVICE),
                    timeout=0.5,
                    wait_for_ready=True,
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start:\n{handle.log_tail()}")


# ----------------------------------------------------------------------------- emitters


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


def _emitter_main(job: EmitterJob, ready: Any, go: EventType, results: Any) -> None:
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
        await asyncio.wait_for(channel.channel_ready(), _START_TIMEOUT_S)
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


# ------------------------------------------------------------------------------- figures


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _max_gap_ms(times_ns: Sequence[int]) -> float:
    s = sorted(times_ns)
    return max((b - a for a, b in itertools.pairwise(s)), default=0) / 1e6


def _stream(jobs: Sequence[EmitterJob], coordinator: CoordinatorProcess) -> list[EmitterResult]:
    """Run every emitter process to completion; their results by index."""
    ctx = mp.get_context("spawn")  # no fork of a process that holds gRPC state
    ready = ctx.Queue()
    results = ctx.Queue()
    go = ctx.Event()
    procs = [
        ctx.Process(target=_emitter_main, args=(job, ready, go, results), daemon=True)
        for job in jobs
    ]
    try:
        for p in procs:
            p.start()
        for _ in jobs:
            index, error = ready.get(timeout=300)
            if error:
                raise RuntimeError(f"emitter {index} could not start: {error}")
        go.set()
        out: list[EmitterResult] = []
        while len(out) < len(jobs):
            try:
                out.append(results.get(timeout=1.0))
            except queue.Empty:
                if coordinator.proc.poll() is not None:
                    raise RuntimeError(
                        f"the coordinator died during ingest:\n{coordinator.log_tail()}"
                    ) from None
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("an emitter process failed") from None
        for p in procs:
            p.join(timeout=30)
        errors = [r.error for r in out if r.error]
        if errors:
            raise RuntimeError("; ".join(errors))
        return sorted(out, key=lambda r: r.index)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _lookups(target: str, sample: Sequence[ObjectKey], n: int, seed: int) -> list[float]:
    """Latencies (s) of ``n`` 16-key lookups of stored keys; every key must have a placement."""
    rng = random.Random(seed)
    requests = [
        directory_pb2.LookupRequest(
            keys=directory_pb2.KeyList(keys=[key_to_proto(k) for k in rng.sample(sample, 16)])
        )
        for _ in range(n)
    ]
    latencies: list[float] = []
    with grpc.insecure_channel(target) as channel:
        stub = directory_pb2_grpc.DirectoryServiceStub(channel)
        stub.Lookup(requests[0], timeout=10, wait_for_ready=True)  # connect first
        perf = time.perf_counter
        for request in requests:
            t0 = perf()
            response = stub.Lookup(request, timeout=2)
            latencies.append(perf() - t0)
            if not all(r.placements for r in response.results):
                raise RuntimeError("a stored key has no placement in the directory")
    return latencies


def _stats(target: str) -> directory_pb2.GetStatsResponse:
    with grpc.insecure_channel(target) as channel:
        stub = directory_pb2_grpc.DirectoryServiceStub(channel)
        response: directory_pb2.GetStatsResponse = stub.GetStats(
            directory_pb2.GetStatsRequest(), timeout=10, wait_for_ready=True
        )
        return response


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One run per ``--window`` value.

    The top level holds the first run's figures (``entries_per_s``,
    ``ack_p50_ms``, ``ack_p99_ms``, ``max_stall_ms``, ``lookup16_p50_ms``,
    ``lookup16_p99_ms``, ``bytes_per_key`` and the parameters); with several
    windows, ``runs`` lists every run's figures, the first one included.
    """
    windows = list(args.window)
    if (
        args.emitters < 1
        or args.batch_entries < 1
        or not windows
        or min(windows) < 1
        or args.keys < 1
        or args.group < 0
    ):
        raise ValueError(
            "--emitters, --batch-entries, --window and --keys must be >= 1, --group >= 0"
        )
    runs = [_run_one(args, window) for window in windows]
    if len(runs) == 1:
        return runs[0]
    return {**runs[0], "runs": runs}


def _run_one(args: argparse.Namespace, window: int) -> dict[str, Any]:
    """Start the coordinator and the emitters, measure, stop everything; the figures."""
    # Groups never exceed what the window lets out at once.
    group = min(window, args.group or window)
    per_emitter = max(1, args.keys // (args.emitters * args.batch_entries))
    with (
        tempfile.TemporaryDirectory(prefix="kvmesh-bench-ingest-") as tmp,
        coordinator_process(Path(tmp), args.coordinator_arg) as coordinator,
    ):
        pid = coordinator.proc.pid
        _stats(coordinator.target)  # the server has answered once: its baseline is warm
        rss0 = _rss_bytes(pid)
        jobs = [
            EmitterJob(
                i,
                coordinator.target,
                per_emitter,
                args.batch_entries,
                window,
                group,
                args.l1_share,
                args.tokens,
                args.seed,
            )
            for i in range(args.emitters)
        ]
        cpu0 = _cpu_seconds(pid)
        results = _stream(jobs, coordinator)
        cpu1 = _cpu_seconds(pid)
        stats = _stats(coordinator.target)
        rss1 = _rss_bytes(pid)
        sample = [k for r in results for k in r.sample]
        lookups = _lookups(coordinator.target, sample, args.lookups, args.seed)
    first = min(r.send_ns[0] for r in results)
    last = max(max(r.ack_ns) for r in results)
    latencies_ms = [
        (a - s) / 1e6 for r in results for s, a in zip(r.send_ns, r.ack_ns, strict=True)
    ]
    entries = sum(len(r.ack_ns) for r in results) * args.batch_entries
    seconds = (last - first) / 1e9
    lookup_ms = [x * 1e3 for x in lookups]
    cpu_s = cpu1 - cpu0
    result: dict[str, Any] = {
        "entries_per_s": entries / seconds,
        "ack_p50_ms": _pct(latencies_ms, 0.50),
        "ack_p99_ms": _pct(latencies_ms, 0.99),
        "ack_max_ms": max(latencies_ms),
        "ack_mean_ms": statistics.fmean(latencies_ms),
        "max_stall_ms": _max_gap_ms([t for r in results for t in r.ack_ns]),
        "max_stall_per_emitter_ms": max(_max_gap_ms(r.ack_ns) for r in results),
        "lookup16_p50_ms": _pct(lookup_ms, 0.50),
        "lookup16_p99_ms": _pct(lookup_ms, 0.99),
        "bytes_per_key": (rss1 - rss0) / max(1, stats.num_keys),
        "num_keys": stats.num_keys,
        "coordinator_rss_mb": rss1 / 1e6,
        "coordinator_cpu_s": cpu_s,
        "entries_per_coordinator_cpu_s": entries / cpu_s if cpu_s > 0 else 0.0,
        "emitters_cpu_s": sum(r.cpu_s for r in results),
        "ingest_seconds": seconds,
        "batches_admitted": sum(r.admitted for r in results),
        "batches_sent": sum(len(r.ack_ns) for r in results),
        "messages_sent": sum(r.messages for r in results),
        "batches_per_message": sum(len(r.ack_ns) for r in results)
        / max(1, sum(r.messages for r in results)),
        "emitters": args.emitters,
        "batch_entries": args.batch_entries,
        "keys": entries,
        "window": window,
        "group": group,
        "parameters": {
            "emitters": args.emitters,
            "batch_entries": args.batch_entries,
            "keys": entries,
            "window": window,
            "group": group,
            "l1_share": args.l1_share,
            "tokens": args.tokens,
            "lookups": args.lookups,
            "cpus": os.cpu_count(),
        },
        "lmcache_reference": LMCACHE_REFERENCE,
        "targets": TARGETS,
    }
    result["speedup_vs_lmcache"] = result["entries_per_s"] / LMCACHE_ENTRIES_PER_S[1]
    result["targets_met"] = {
        "entries_per_s": result["entries_per_s"] >= TARGETS["entries_per_s"],
        "ack_p99_ms": result["ack_p99_ms"] <= TARGETS["ack_p99_ms"],
        "max_stall_ms": result["max_stall_ms"] <= TARGETS["max_stall_ms"],
    }
    return result


def format_table(result: dict[str, Any]) -> str:
    """The figures as a readable table (one per run, then a one-line comparison)."""
    runs: list[dict[str, Any]] = result.get("runs", [result])
    tables = [_format_run(r) for r in runs]
    if len(runs) > 1:
        tables.append(
            "\n".join(
                f"window {r['window']:>3}, groups <= {r['group']:>3}: "
                f"{r['entries_per_s']:>10,.0f} entries/s, ack p99 {r['ack_p99_ms']:.2f} ms, "
                f"max stall {r['max_stall_ms']:.2f} ms"
                for r in runs
            )
        )
    return "\n\n".join(tables)


def _grouping(result: dict[str, Any]) -> str:
    if result["group"] <= 1:
        return "no groups"
    return (
        f"groups of <= {result['group']} batches "
        f"({result['batches_per_message']:.2f} batches per message)"
    )


def _format_run(result: dict[str, Any]) -> str:
    p = result["parameters"]
    ref = result["lmcache_reference"]
    t = result["targets"]
    met = result["targets_met"]

    def mark(name: str) -> str:
        return "ok" if met[name] else "MISSED"

    lines = [
        f"ingest: {p['emitters']} emitters x {p['batch_entries']}-entry STORE batches, "
        f"{p['keys']} keys, window {p['window']}, {_grouping(result)}, {p['cpus']} CPUs",
        "",
        f"{'entries/s':24} {result['entries_per_s']:>12,.0f}   target >= {t['entries_per_s']:,} "
        f"({mark('entries_per_s')}); LMCache {ref['entries_per_s'][0]:,}-"
        f"{ref['entries_per_s'][1]:,} -> x{result['speedup_vs_lmcache']:.1f}",
        f"{'ack p50 / p99 / max ms':24} {result['ack_p50_ms']:>6.2f} / {result['ack_p99_ms']:.2f}"
        f" / {result['ack_max_ms']:.2f}   p99 target <= {t['ack_p99_ms']} "
        f"({mark('ack_p99_ms')}); LMCache p99 {ref['ack_p99_ms'][0]}-{ref['ack_p99_ms'][1]}",
        f"{'max stall ms':24} {result['max_stall_ms']:>12.2f}   target <= {t['max_stall_ms']} "
        f"({mark('max_stall_ms')}); LMCache {ref['max_stall_ms']}; per emitter "
        f"{result['max_stall_per_emitter_ms']:.2f}",
        f"{'lookup16 p50 / p99 ms':24} {result['lookup16_p50_ms']:>6.3f} / "
        f"{result['lookup16_p99_ms']:.3f}   LMCache p50 {ref['lookup16_p50_ms']}",
        f"{'bytes per key':24} {result['bytes_per_key']:>12.0f}   ({result['num_keys']:,} keys, "
        f"RSS {result['coordinator_rss_mb']:.0f} MB)",
        f"{'coordinator CPU s':24} {result['coordinator_cpu_s']:>12.2f}   "
        f"({result['entries_per_coordinator_cpu_s']:,.0f} entries per CPU second); "
        f"emitters {result['emitters_cpu_s']:.2f} s over {result['ingest_seconds']:.2f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvmesh.bench.ingest [--json]``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_table(result))


if __name__ == "__main__":
    main()
