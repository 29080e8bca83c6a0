"""``kvmesh bench p2p``: node B fetching node A's L1 prefix over the P2P byte stream.

Starts a coordinator and two storage processes (``kvmesh coordinator`` /
``kvmesh storage``, no L2, loopback), fills node A's L1 with ``--chunks``
chunks of ``--chunk-mib`` MiB through the engine-driven path (PrepareStore,
write the slots, CommitStore), waits until the coordinator's directory places
them on A, then times node B's LookupAndLock of the whole prefix: B misses
locally, finds A in the directory, locks the prefix there and streams it into
its own L1. Each round drops B's copies first (DeleteKeys, L1) so every round
fetches again. The bytes B received are checked against A's (a digest per
chunk, read through B's PrepareRetrieve slots).

Reported: ``p2p_gbps`` (bytes of the prefix / the lookup's wall time, best
round), ``prefix_fetch_p50_ms``, and ``loopback_tcp_gbps``: a plain TCP socket
between two processes over loopback copying the same bytes in this run, from
a prefix-sized buffer into a prefix-sized buffer as P2P does (the limit of
this path on this host), with the ratio. ``loopback_tcp_hot_gbps`` sends one
4 MiB block again and again into one 4 MiB sink: bytes that never leave the
CPU caches, a ceiling no prefix copy reaches (its ratio is given too).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import directory_pb2, directory_pb2_grpc
from kvmesh.api.storage.v1 import storage_pb2, storage_pb2_grpc
from kvmesh.bench.common import (
    Progress,
    ServiceProcess,
    service_deaths_named,
    size_text,
    start_service,
)

MIB = 1 << 20
MODEL = "bench/p2p"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmesh bench p2p``."""
    parser.add_argument("--chunk-mib", type=int, default=32, help="chunk size in MiB")
    parser.add_argument("--chunks", type=int, default=32, help="chunks in the prefix")
    parser.add_argument("--rounds", type=int, default=3, help="timed fetches of the prefix")
    parser.add_argument(
        "--frame-kib", type=int, default=1024, help="P2P frame size in KiB (node B's setting)"
    )
    parser.add_argument(
        "--transport",
        choices=("tcp-stream", "grpc-stream"),
        default="tcp-stream",
        help="how node A serves the bytes: its TCP data plane, or gRPC's ReadChunks "
        "(--p2p-data-port -1)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _grid(hashes: list[bytes]) -> common_pb2.KeyGrid:
    return common_pb2.KeyGrid(model_name=MODEL, kv_ranks=[0], chunk_hashes=hashes)


def _row(hashes: list[bytes]) -> common_pb2.ChunkKeys:
    return common_pb2.ChunkKeys(model_name=MODEL, kv_rank=0, chunk_hashes=hashes)


def _slot_view(slot: storage_pb2.Slot, maps: dict[str, mmap.mmap]) -> memoryview:
    region = slot.region
    if region.path not in maps:
        with open(region.path, "r+b") as f:
            maps[region.path] = mmap.mmap(f.fileno(), 0)
    view = memoryview(maps[region.path])
    return view[region.offset_bytes : region.offset_bytes + region.size_bytes]


def _fill_a(stub: Any, hashes: list[bytes], chunk_bytes: int, progress: Progress) -> list[str]:
    """Store the prefix on A (engine-driven); the digest of each chunk."""
    progress.phase(f"filling node A's L1 with {len(hashes)} chunks", len(hashes))
    digests: list[str] = []
    maps: dict[str, mmap.mmap] = {}
    pattern = os.urandom(MIB)
    for i, h in enumerate(hashes):
        prepared = stub.PrepareStore(
            storage_pb2.PrepareStoreRequest(keys=_row([h]), chunk_bytes=chunk_bytes), timeout=60
        )
        view = _slot_view(prepared.slots[0], maps)
        head = i.to_bytes(8, "big")
        for offset in range(0, chunk_bytes, MIB):
            n = min(MIB, chunk_bytes - offset)
            view[offset : offset + n] = pattern[:n]
        view[:8] = head
        digests.append(hashlib.blake2b(view, digest_size=16).hexdigest())
        view.release()
        stub.CommitStore(
            storage_pb2.CommitStoreRequest(transaction_id=prepared.transaction_id), timeout=60
        )
        progress.count(i + 1)
    for m in maps.values():
        m.close()
    return digests


def _digests_on_b(stub: Any, hashes: list[bytes], chunk_bytes: int) -> list[str]:
    prepared = stub.PrepareRetrieve(
        storage_pb2.PrepareRetrieveRequest(keys=_row(hashes), chunk_bytes=chunk_bytes), timeout=60
    )
    maps: dict[str, mmap.mmap] = {}
    out = []
    for slot in prepared.slots:
        view = _slot_view(slot, maps)
        out.append(hashlib.blake2b(view, digest_size=16).hexdigest())
        view.release()
    stub.CommitRetrieve(
        storage_pb2.CommitRetrieveRequest(transaction_id=prepared.transaction_id), timeout=60
    )
    for m in maps.values():
        m.close()
    return out


def _tcp_sender(address: tuple[str, int], total_bytes: int, block: int, hot: bool) -> None:
    """The sending process of :func:`loopback_tcp_gbps`."""
    pattern = os.urandom(block)
    if hot:
        source = memoryview(pattern)
    else:
        memory = mmap.mmap(-1, total_bytes)
        for offset in range(0, total_bytes, block):
            memory[offset : offset + block] = pattern[: min(block, total_bytes - offset)]
        source = memoryview(memory)
    with socket.create_connection(address) as conn:
        for offset in range(0, total_bytes, block):
            n = min(block, total_bytes - offset)
            conn.sendall(source[:n] if hot else source[offset : offset + n])


def loopback_tcp_gbps(total_bytes: int, *, hot: bool = False, block: int = 4 * MIB) -> float:
    """GB/s of a plain TCP socket between two processes copying ``total_bytes`` over loopback.

    As P2P moves a prefix: from a ``total_bytes`` buffer of the sending
    process (resident) into a ``total_bytes`` buffer of the receiving one
    (resident), ``sendall`` and ``recv_into`` in ``block`` pieces. With
    ``hot`` the same ``block`` is sent again and again into one ``block``
    sink: the figure of a socket whose bytes stay in the CPU caches, above
    what moving a prefix through memory can reach.
    """
    sink = mmap.mmap(-1, block if hot else total_bytes)
    zeros = bytes(block)
    for offset in range(0, len(sink), block):
        sink[offset : offset + block] = zeros[: min(block, len(sink) - offset)]
    view = memoryview(sink)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(120)
    context = multiprocessing.get_context("spawn")
    sender = context.Process(
        target=_tcp_sender, args=(server.getsockname(), total_bytes, block, hot), daemon=True
    )
    sender.start()
    try:
        peer, _ = server.accept()
        start = time.perf_counter()
        got = 0
        with peer:
            while got < total_bytes:
                offset = 0 if hot else got
                want = min(block, total_bytes - got) if hot else total_bytes - got
                n = peer.recv_into(view[offset : offset + want] if not hot else view[:want])
                if n == 0:
                    break
                got += n
        elapsed = time.perf_counter() - start
    finally:
        sender.join(30)
        if sender.is_alive():
            sender.kill()
        server.close()
        view.release()
        sink.close()
    return got / elapsed / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; one dict of figures and parameters."""
    with Progress.for_args("p2p", args) as progress:
        progress.say(
            f"{args.chunks} chunks x {args.chunk_mib} MiB, {max(1, args.rounds)} rounds, "
            f"{args.transport}"
        )
        return _run(args, progress)


def _run(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    chunk_bytes = args.chunk_mib * MIB
    l1_bytes = (args.chunks + 2) * chunk_bytes + 64 * MIB
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-bench-p2p-"))
    shm = Path("/dev/shm") / f"kvmesh-bench-p2p-{uuid.uuid4().hex[:8]}"
    procs: list[ServiceProcess] = []
    try:
        with service_deaths_named(procs):
            progress.phase("starting the coordinator")
            coordinator = start_service(
                procs,
                "coordinator",
                ["--port", "0", "--metrics-port", "-1", "--log-level", "WARNING"],
                workdir,
                "coordinator",
            )
            coord_target = coordinator.wait_ready()["grpc"]
            progress.phase(f"starting storage nodes A and B (L1 {size_text(l1_bytes)} each)")
            nodes = []
            for name in ("a", "b"):
                (shm / name).mkdir(parents=True)
                segment = min(l1_bytes, 1024 * MIB)
                segment -= segment % (4 * MIB)
                proc = start_service(
                    procs,
                    "storage",
                    [
                        "--port",
                        "0",
                        "--metrics-port",
                        "-1",
                        "--log-level",
                        "WARNING",
                        "--instance-id",
                        f"bench-p2p-{name}-{uuid.uuid4().hex[:6]}",
                        "--data-dir",
                        str(workdir / name),
                        "--coordinator-target",
                        coord_target,
                        "--l2",
                        "none",
                        "--l1-size-bytes",
                        str(l1_bytes),
                        "--l1-segment-bytes",
                        str(segment),
                        "--l1-prefault-bytes",
                        str(l1_bytes),
                        "--shm-dir",
                        str(shm / name),
                        "--p2p-frame-bytes",
                        str(args.frame_kib * 1024),
                        "--max-message-bytes",
                        str(max(64 * MIB, 2 * args.frame_kib * 1024)),
                        "--event-flush-ms",
                        "5",
                        # The prefix fills L1 on purpose: no watermark eviction of it.
                        "--eviction-watermark",
                        "1.0",
                        "--p2p-data-port",
                        "0" if args.transport == "tcp-stream" else "-1",
                    ],
                    workdir,
                    f"storage-{name}",
                )
                nodes.append(proc)
            targets = [p.wait_ready()["grpc"] for p in nodes]
            channels = [grpc.insecure_channel(t) for t in targets]
            a, b = (storage_pb2_grpc.StorageServiceStub(c) for c in channels)
            a_id = a.GetStatus(storage_pb2.GetStatusRequest(), timeout=10).instance_id
            hashes = [os.urandom(32) for _ in range(args.chunks)]
            digests = _fill_a(a, hashes, chunk_bytes, progress)
            progress.phase("waiting until the directory places the prefix on node A")
            with grpc.insecure_channel(coord_target) as cc:
                directory = directory_pb2_grpc.DirectoryServiceStub(cc)
                keys = [
                    common_pb2.ObjectKey(chunk_hash=h, model_name=MODEL, kv_rank=0) for h in hashes
                ]
                deadline = time.monotonic() + 60
                while True:
                    found = directory.Lookup(
                        directory_pb2.LookupRequest(keys=directory_pb2.KeyList(keys=keys)),
                        timeout=10,
                    )
                    if all(any(p.instance_id == a_id for p in r.placements) for r in found.results):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError("the directory never placed the prefix on node A")
                    time.sleep(0.05)
            # Node B lists the members in the background (at most half a second old).
            deadline = time.monotonic() + 60
            while b.GetStatus(storage_pb2.GetStatusRequest(), timeout=10).p2p.peers < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("node B never listed node A as a peer")
                time.sleep(0.05)
            total = chunk_bytes * args.chunks
            times: list[float] = []
            tcp_rounds: list[float] = []
            hot_rounds: list[float] = []
            rounds = max(1, args.rounds)
            for index in range(1, rounds + 1):
                # The socket's limit is measured between the rounds, so that both see the
                # same moment of a shared (noisy) host.
                progress.phase(
                    f"round {index}/{rounds}: loopback TCP baselines ({size_text(total)}, then "
                    "in cache)"
                )
                tcp_rounds.append(loopback_tcp_gbps(total))
                hot_rounds.append(loopback_tcp_gbps(total, hot=True))
                b.DeleteKeys(
                    storage_pb2.DeleteKeysRequest(keys=keys, tier=common_pb2.TIER_L1, force=True),
                    timeout=30,
                )
                progress.phase(f"round {index}/{rounds}: node B fetches the prefix from node A")
                start = time.perf_counter()
                reply = b.LookupAndLock(
                    storage_pb2.LookupAndLockRequest(
                        keys=_grid(hashes),
                        num_kv_readers=1,
                        wait_timeout_ms=120_000,
                        request_id="bench-p2p",
                        chunk_bytes=chunk_bytes,
                    ),
                    timeout=130,
                )
                elapsed = time.perf_counter() - start
                if not reply.completed or reply.result.hit_chunks != args.chunks:
                    raise RuntimeError(
                        f"node B fetched {reply.result.hit_chunks} of {args.chunks} chunks"
                    )
                times.append(elapsed)
                b.ReleaseLocks(storage_pb2.ReleaseLocksRequest(keys=_grid(hashes)), timeout=10)
            progress.phase("comparing node B's bytes with node A's")
            equal = _digests_on_b(b, hashes, chunk_bytes) == digests
            p2p_status = b.GetStatus(storage_pb2.GetStatusRequest(), timeout=10).p2p
            for c in channels:
                c.close()
            tcp = max(tcp_rounds)
            hot = max(hot_rounds)
            best = total / min(times) / 1e9
            return {
                "p2p_gbps": round(best, 3),
                "p2p_gbps_median": round(total / statistics.median(times) / 1e9, 3),
                "loopback_tcp_gbps": round(tcp, 3),
                "p2p_vs_tcp": round(best / tcp, 3) if tcp else None,
                "loopback_tcp_hot_gbps": round(hot, 3),
                "p2p_vs_tcp_hot": round(best / hot, 3) if hot else None,
                "prefix_fetch_p50_ms": round(statistics.median(times) * 1000, 1),
                "prefix_fetch_ms": [round(t * 1000, 1) for t in times],
                "loopback_tcp_rounds_gbps": [round(g, 3) for g in tcp_rounds],
                "bytes_equal": equal,
                "transport": p2p_status.transport,
                "chunk_bytes": chunk_bytes,
                "chunks": args.chunks,
                "prefix_bytes": total,
                "frame_bytes": args.frame_kib * 1024,
                "rounds": len(times),
                "cpus": os.cpu_count(),
                "parameters": {
                    "chunk_mib": args.chunk_mib,
                    "chunks": args.chunks,
                    "rounds": args.rounds,
                    "frame_kib": args.frame_kib,
                    "transport": args.transport,
                    "nodes": "2 storage processes + coordinator, loopback, no L2",
                },
            }
    finally:
        progress.phase("stopping the processes")
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(shm, ignore_errors=True)
        with contextlib.suppress(OSError):
            shutil.rmtree(workdir, ignore_errors=True)


def format_table(result: dict[str, Any]) -> str:
    """Human-readable figures."""
    lines = [
        f"P2P fetch, {result['chunks']} chunks x {result['chunk_bytes'] // MIB} MiB "
        f"({result['transport']}, frames of {result['frame_bytes'] // 1024} KiB)",
        f"  p2p            {result['p2p_gbps']:8.3f} GB/s (median {result['p2p_gbps_median']})",
        f"  loopback TCP   {result['loopback_tcp_gbps']:8.3f} GB/s (prefix-sized buffers)",
        f"  ratio          {result['p2p_vs_tcp']}",
        f"  TCP, in cache  {result['loopback_tcp_hot_gbps']:8.3f} GB/s (one 4 MiB block again "
        f"and again; ratio {result['p2p_vs_tcp_hot']})",
        f"  prefix p50     {result['prefix_fetch_p50_ms']:8.1f} ms  {result['prefix_fetch_ms']}",
        f"  bytes equal    {result['bytes_equal']}",
    ]
    return "\n".join(lines)
