"""Helpers of the coordinator's integration tests: servers, raw node streams, processes, batches.

* :class:`Coord` is a real coordinator (``CoordinatorApp`` through the chassis
  ``create_server``) on a loopback port of this process, with the typed sync
  clients of ``src/kvmesh/coordinator/client.py`` over one channel.
* :class:`RawNode` plays a storage node on one ``StreamEvents`` call with the
  raw generated stub: the test decides every message (so it can send what a
  real node never would), and reads every ack and command.
* :class:`CliProcess` runs ``kvmesh coordinator`` / ``kvmesh storage`` as a
  real child process (forked with kvmesh already imported:
  ``tests.support.forked``) on a fixed port, so it can be SIGKILLed and
  restarted on the same port; its output goes to files, shown when a start fails.
* batch builders make protobuf batches directly, valid by default, so a test
  can break exactly one field.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import (
    directory_pb2,
    ingest_pb2,
    ingest_pb2_grpc,
    membership_pb2,
    policy_pb2,
)
from kvmesh.api.events.v1 import events_pb2
from kvmesh.common.hashing import TokenHasher
from kvmesh.common.keys import worker_kv_rank
from kvmesh.coordinator.app import CoordinatorApp
from kvmesh.coordinator.client import DirectoryClient, EventIngestClient, MembershipClient
from kvmesh.coordinator.operator_client import AdminClient, PolicyClient
from kvmesh.rpc.client import create_channel
from kvmesh.rpc.interceptors import error_info
from kvmesh.rpc.server import Server
from tests.support.forked import ForkedProcess, fork_cli
from tests.support.harness import REPO_ROOT, ServerThread
from tests.support.waiting import wait_until

MODEL = "org/model-7b"
RANK = worker_kv_rank(1, 0)
INGEST_SERVICE = "kvmesh.coordinator.v1.EventIngestService"

STORE = events_pb2.CACHE_EVENT_TYPE_STORE
DELETE = events_pb2.CACHE_EVENT_TYPE_DELETE
ACCESS = events_pb2.CACHE_EVENT_TYPE_ACCESS
CONFIG = events_pb2.CACHE_EVENT_TYPE_CONFIG
L1 = common_pb2.TIER_L1
L2 = common_pb2.TIER_L2
ADMITTED = events_pb2.INGEST_RESULT_ADMITTED
DUPLICATE = events_pb2.INGEST_RESULT_DUPLICATE
STALE = events_pb2.INGEST_RESULT_STALE_INCARNATION


# ----------------------------------------------------------------------------- batches


def pkey(
    i: int, *, salt: str = "", model: str = MODEL, rank: int = RANK, group: int = 0
) -> common_pb2.ObjectKey:
    """A valid wire key whose chunk hash encodes ``i``."""
    return common_pb2.ObjectKey(
        chunk_hash=i.to_bytes(32, "big"),
        model_name=model,
        kv_rank=rank,
        object_group_id=group,
        cache_salt=salt,
    )


def hkey(chunk_hash: bytes, *, salt: str = "", rank: int = RANK) -> common_pb2.ObjectKey:
    """A wire key with an explicit chunk hash (e.g. from :func:`token_hashes`)."""
    return common_pb2.ObjectKey(
        chunk_hash=chunk_hash, model_name=MODEL, kv_rank=rank, cache_salt=salt
    )


def token_hashes(tokens: Sequence[int], chunk_size: int) -> list[bytes]:
    """The chained chunk hashes the coordinator computes for ``tokens``."""
    return TokenHasher(chunk_size).hash_chunks(list(tokens))


def entry(
    key: common_pb2.ObjectKey,
    size: int = 100,
    tokens: Sequence[int] = (),
    offset: int | None = None,
) -> events_pb2.CacheEventEntry:
    """One wire entry (``offset`` None leaves it absent: unknown)."""
    out = events_pb2.CacheEventEntry(key=key, size_bytes=size, token_ids=list(tokens))
    if offset is not None:
        out.token_offset = offset
    return out


def batch(
    instance_id: str = "node-a",
    seq: int = 1,
    *,
    incarnation: int = 1,
    event_type: int = STORE,
    tier: int = L1,
    backend: str | None = None,
    entries: Iterable[events_pb2.CacheEventEntry] = (),
    **fields: Any,
) -> events_pb2.CacheEventBatch:
    """A wire batch; backend defaults to "dram" (L1) / "disk" (L2)."""
    if backend is None:
        backend = "dram" if tier == L1 else "disk"
    return events_pb2.CacheEventBatch(
        instance_id=instance_id,
        incarnation=incarnation,
        seq=seq,
        event_type=event_type,  # type: ignore[arg-type]
        tier=tier,  # type: ignore[arg-type]
        backend=backend,
        entries=list(entries),
        **fields,
    )


def stores(
    ids: Iterable[int], size: int = 100, **key_args: Any
) -> list[events_pb2.CacheEventEntry]:
    """STORE entries of ``pkey(i)`` for each id."""
    return [entry(pkey(i, **key_args), size) for i in ids]


def field_of(error: grpc.RpcError) -> str:
    """The ErrorInfo "field" of a failed call ("" when none)."""
    info = error_info(error)
    return "" if info is None else str(info.metadata.get("field", ""))


def code_of(error: grpc.RpcError) -> grpc.StatusCode:
    """The status code of a failed call."""
    assert isinstance(error, grpc.Call)
    return error.code()


# --------------------------------------------------------------------------- coordinator


@dataclass
class Clients:
    """The five typed clients over one channel."""

    channel: grpc.Channel
    ingest: EventIngestClient
    directory: DirectoryClient
    membership: MembershipClient
    policy: PolicyClient
    admin: AdminClient

    @classmethod
    def connect(cls, target: str) -> Clients:
        """Clients of the coordinator at ``target``."""
        channel = create_channel(target)
        return cls(
            channel,
            EventIngestClient(target, channel=channel),
            DirectoryClient(target, channel=channel),
            MembershipClient(target, channel=channel),
            PolicyClient(target, channel=channel),
            AdminClient(target, channel=channel),
        )

    def close(self) -> None:
        """Close the shared channel."""
        self.channel.close()

    # -- shorthands ------------------------------------------------------------------

    def ingest_batches(self, *batches: events_pb2.CacheEventBatch) -> Any:
        """IngestBatches of ``batches``; the response."""
        return self.ingest.ingest_batches(ingest_pb2.IngestBatchesRequest(batches=list(batches)))

    def lookup(
        self, *keys: common_pb2.ObjectKey, include_token_ids: bool = False
    ) -> directory_pb2.LookupResponse:
        """Lookup by keys."""
        return self.directory.lookup(
            directory_pb2.LookupRequest(
                keys=directory_pb2.KeyList(keys=list(keys)), include_token_ids=include_token_ids
            )
        )

    def placements(self, key: common_pb2.ObjectKey) -> list[tuple[str, int, int, str, int]]:
        """``(instance, incarnation, tier, backend, size)`` of each placement of ``key``."""
        result = self.lookup(key).results[0]
        return [
            (p.instance_id, p.incarnation, p.tier, p.backend, p.size_bytes)
            for p in result.placements
        ]

    def stats(self) -> directory_pb2.GetStatsResponse:
        """GetStats."""
        return self.directory.get_stats(directory_pb2.GetStatsRequest())

    def cursors(self) -> dict[str, directory_pb2.IngestCursor]:
        """ListIngestCursors by instance id."""
        response = self.directory.list_ingest_cursors(directory_pb2.ListIngestCursorsRequest())
        return {c.instance_id: c for c in response.cursors}

    def list_all(self, **filters: Any) -> list[directory_pb2.KeyPlacements]:
        """Every ListKeys entry, following page tokens until the token is empty."""
        out: list[directory_pb2.KeyPlacements] = []
        token = ""
        while True:
            page = self.directory.list_keys(
                directory_pb2.ListKeysRequest(page_token=token, **filters)
            )
            out.extend(page.keys)
            token = page.next_page_token
            if not token:
                return out

    def directory_view(self) -> dict[bytes, set[tuple[str, int, int, str, int]]]:
        """Chunk hash → placements of the whole directory (key fields other than hash fixed)."""
        return {
            k.key.chunk_hash: {
                (p.instance_id, p.incarnation, p.tier, p.backend, p.size_bytes)
                for p in k.placements
            }
            for k in self.list_all()
        }

    def usage(self) -> policy_pb2.GetUsageResponse:
        """GetUsage."""
        return self.policy.get_usage(policy_pb2.GetUsageRequest())

    def instances(self) -> dict[str, membership_pb2.Instance]:
        """ListInstances by id."""
        response = self.membership.list_instances(membership_pb2.ListInstancesRequest())
        return {i.instance_id: i for i in response.instances}

    def register(self, instance_id: str, incarnation: int = 1) -> Any:
        """RegisterInstance."""
        return self.membership.register_instance(
            membership_pb2.RegisterInstanceRequest(instance_id=instance_id, incarnation=incarnation)
        )

    def snapshot(self) -> tuple[Any, ...]:
        """Everything an ingest can change: stats, cursors, every key, usage."""
        return (
            self.stats(),
            sorted(self.cursors().items()),
            [k.SerializeToString() for k in self.list_all()],
            self.usage(),
        )


@dataclass
class Coord:
    """A coordinator server in this process and clients of it."""

    thread: ServerThread
    server: Server
    clients: Clients

    @property
    def target(self) -> str:
        """``127.0.0.1:port``."""
        return self.server.target

    @property
    def app(self) -> CoordinatorApp:
        """The app behind the server (for waits on background work only)."""
        app = self.server.app
        assert isinstance(app, CoordinatorApp)
        return app

    def node(self, instance_id: str = "node-a", incarnation: int = 1) -> RawNode:
        """A raw event stream to this coordinator, already open."""
        return RawNode(self.target, instance_id, incarnation)

    def stop(self) -> None:
        """Stop the server (the app's stop hook writes the final checkpoint, if any)."""
        self.clients.close()
        self.thread.stop(self.server, grace=0.2)


# ---------------------------------------------------------------------------- raw node


class RawNode:
    """One ``StreamEvents`` call played by the test: every message explicit.

    ``open_with`` None sends nothing first (to test a stream that does not
    start with ``open``). Responses are collected on a reader thread.
    """

    def __init__(
        self,
        target: str,
        instance_id: str,
        incarnation: int = 1,
        *,
        open_with: ingest_pb2.StreamEventsRequest | str | None = "default",
    ) -> None:
        self.instance_id = instance_id
        self.incarnation = incarnation
        self.channel = grpc.insecure_channel(target)
        self._outbox: queue.SimpleQueue[ingest_pb2.StreamEventsRequest | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self.acks: list[ingest_pb2.BatchAck] = []
        self.commands: list[ingest_pb2.NodeCommand] = []
        self.error: grpc.RpcError | None = None
        self.ended = False
        stub = ingest_pb2_grpc.EventIngestServiceStub(self.channel)
        if open_with == "default":
            self.send(
                ingest_pb2.StreamEventsRequest(
                    open=ingest_pb2.StreamOpen(instance_id=instance_id, incarnation=incarnation)
                )
            )
        elif isinstance(open_with, ingest_pb2.StreamEventsRequest):
            self.send(open_with)
        self._call = stub.StreamEvents(self._requests())
        self._reader = threading.Thread(
            target=self._read, name=f"raw-node-{instance_id}", daemon=True
        )
        self._reader.start()

    def _requests(self) -> Iterator[ingest_pb2.StreamEventsRequest]:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        try:
            for response in self._call:
                with self._cond:
                    if response.WhichOneof("kind") == "ack":
                        self.acks.append(response.ack)
                    else:
                        self.commands.append(response.command)
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            with self._cond:
                self.error = exc
        finally:
            with self._cond:
                self.ended = True
                self._cond.notify_all()

    # -- writing -----------------------------------------------------------------------

    def send(self, request: ingest_pb2.StreamEventsRequest) -> None:
        """Queue any request."""
        self._outbox.put(request)

    def send_batch(self, msg: events_pb2.CacheEventBatch) -> None:
        """Queue a batch."""
        self.send(ingest_pb2.StreamEventsRequest(batch=msg))

    def batch(self, seq: int, **kwargs: Any) -> events_pb2.CacheEventBatch:
        """Send :func:`batch` of this node's id and incarnation; returns it."""
        kwargs.setdefault("incarnation", self.incarnation)
        msg = batch(self.instance_id, seq, **kwargs)
        self.send_batch(msg)
        return msg

    def result(self, command_id: str, affected: int = 0, effects_through_seq: int = 0) -> None:
        """Answer a command OK."""
        self.send(
            ingest_pb2.StreamEventsRequest(
                command_result=ingest_pb2.CommandResult(
                    command_id=command_id,
                    code="OK",
                    affected=affected,
                    effects_through_seq=effects_through_seq,
                )
            )
        )

    # -- reading -----------------------------------------------------------------------

    def wait(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Block until ``predicate()`` (checked under the lock) holds."""
        with self._cond:
            if not self._cond.wait_for(predicate, timeout):
                raise AssertionError(
                    f"raw node {self.instance_id}: condition not met within {timeout} s "
                    f"(acks {len(self.acks)}, ended {self.ended}, error {self.error})"
                )

    def wait_acks(self, n: int, timeout: float = 10.0) -> list[ingest_pb2.BatchAck]:
        """The first ``n`` acks, once they arrived."""
        self.wait(lambda: len(self.acks) >= n or self.ended, timeout)
        with self._cond:
            assert len(self.acks) >= n, f"stream ended after {len(self.acks)} acks: {self.error}"
            return list(self.acks[:n])

    def verdicts(self, n: int) -> list[tuple[int, int, int]]:
        """``(incarnation, seq, result)`` of the first ``n`` acks."""
        return [(a.incarnation, a.seq, a.result) for a in self.wait_acks(n)]

    def wait_ended(self, timeout: float = 10.0) -> grpc.RpcError | None:
        """Wait for the stream to end; its error (None when it ended OK)."""
        self.wait(lambda: self.ended, timeout)
        return self.error

    def deletes(self) -> list[ingest_pb2.NodeCommand]:
        """Delete commands received so far."""
        with self._cond:
            return [c for c in self.commands if c.WhichOneof("kind") == "delete_keys"]

    def vanish(self) -> None:
        """Cancel the call without half-closing first, as a node that died would end it."""
        self._call.cancel()
        self._reader.join(5.0)

    def close(self) -> None:
        """Half-close, wait briefly for the end, cancel whatever remains, close the channel."""
        self._outbox.put(None)
        with self._cond:
            self._cond.wait_for(lambda: self.ended, 2.0)
        self._call.cancel()
        self._reader.join(5.0)
        self.channel.close()


# ----------------------------------------------------------------------------- processes


class CliProcess:
    """``kvmesh <service> ARGS`` as a child process on a fixed port; kill and restart it.

    The child is forked from a server that imported kvmesh once
    (:mod:`tests.support.forked`, torch included): a node then imports nothing
    before it serves, nor at its first registration. It is a real process all the same:
    its own sockets and memory, SIGKILL for a crash, SIGTERM for a clean stop.
    Its output goes to two files; :meth:`log` reads them.
    """

    def __init__(self, service: str, port: int, args: Sequence[str]) -> None:
        self.service = service
        self.port = port
        self.args = list(args)
        self.proc: ForkedProcess | None = None

    @property
    def target(self) -> str:
        """``127.0.0.1:port``."""
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 60.0, *, wait: bool = True) -> None:
        """Start and wait until its health service says SERVING (``wait=False``: start
        only; call :meth:`wait_serving` later, so several processes start side by side)."""
        assert not self.running, "already running"
        self.proc = fork_cli(
            self.service,
            "--port",
            str(self.port),
            "--metrics-port",
            "-1",
            *self.args,
            cwd=REPO_ROOT,
        )
        if not wait:
            return
        try:
            self.wait_serving(timeout)
        except BaseException:
            self.kill()
            raise

    def log(self, limit: int = 4000) -> str:
        """The process's output so far (tail)."""
        return self.proc.output()[-limit:] if self.proc is not None else ""

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Poll ``grpc.health.v1`` until SERVING; fail at once if the process exits."""
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if not self.running:
                    raise AssertionError(f"{self.service} exited at start:\n{self.log()}")
                with contextlib.suppress(grpc.RpcError):
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                if time.monotonic() > deadline:
                    raise AssertionError(f"{self.service} did not start:\n{self.log()}")
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL and reap (a crash)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (a clean stop: a coordinator writes its final checkpoint), then reap."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
                raise AssertionError(f"{self.service} ignored SIGTERM:\n{self.log()}") from None


def eventually(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """``wait_for`` that tolerates transient RPC failures (a server restarting)."""

    def check() -> bool:
        try:
            return predicate()
        except grpc.RpcError:
            return False

    wait_until(check, timeout=timeout, interval=0.05)
