"""gRPC implementations of the P2P ports: the coordinator's directory, and peers.

Both are blocking (the P2P fetcher calls them on its own threads) and turn
every failure into :class:`~kvmesh.storage.core.peer.ports.PeerUnavailable`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import directory_pb2, membership_pb2
from kvmesh.api.storage.v1 import peer_pb2
from kvmesh.common.convert import key_to_proto
from kvmesh.common.keys import ObjectKey
from kvmesh.coordinator.client import DirectoryClient, MembershipClient
from kvmesh.rpc.client import create_channel
from kvmesh.storage.config import split_advertise_address
from kvmesh.storage.core.peer.ports import (
    FrameSink,
    PeerLease,
    PeerTarget,
    PeerUnavailable,
    deliver,
)
from kvmesh.storage.core.segment_catalog import FleetUnavailable
from kvmesh.storage.peer_client import PeerClient
from kvmesh.storage.peers import tcp_stream

#: Membership is cached this long (a dead peer then costs one failed lock, no more).
MEMBERSHIP_TTL_S = 1.0
#: The largest directory lookup, in keys (the coordinator's limit is 100 000).
MAX_LOOKUP_KEYS = 100_000
#: Longest wait for a peer's data port to accept (then ReadChunks is used).
CONNECT_TIMEOUT_S = 3.0

logger = logging.getLogger(__name__)


class _NoDataPlane(Exception):
    """The data plane cannot serve this lease (unreachable, busy); the lease is intact."""


class CoordinatorPeerDirectory:
    """Who holds which key (DirectoryService.Lookup), who is alive (ListInstances).

    With ``refresh_s`` > 0 a daemon thread lists the members that often, so the
    cached listing never ages past :data:`MEMBERSHIP_TTL_S` while the
    coordinator answers: a lookup's miss on a node alone in its fleet then
    never waits for a listing, however long the node was idle (see
    docs/p2p.md). After a poll fails (logged once per outage) the directory
    names no peers until a listing succeeds again: the coordinator's directory
    is what finds holders, so while it does not answer no peer can be found,
    and misses end in the lookup instead of each waiting for a listing to
    fail (about 0.2–0.3 s with its retries). The polls go on meanwhile.
    """

    def __init__(self, target: str, *, refresh_s: float = 0.0) -> None:
        if refresh_s < 0 or refresh_s >= MEMBERSHIP_TTL_S:
            raise ValueError(f"refresh_s must be in [0, {MEMBERSHIP_TTL_S}) seconds")
        self._channel = create_channel(target)
        self._directory = DirectoryClient(target, channel=self._channel)
        self._membership = MembershipClient(target, channel=self._channel)
        self._lock = threading.Lock()
        self._peers: dict[str, PeerTarget] = {}
        self._peers_at = -1e9
        #: The last poll failed and nothing has listed the members since: no peers.
        self._unreachable = False
        self._closed = threading.Event()
        self._refresher: threading.Thread | None = None
        self._poll_channel: grpc.Channel | None = None
        if refresh_s > 0:
            # A channel of its own, untraced: a poll is no request's work.
            self._poll_channel = create_channel(target, background=True)
            poll = MembershipClient(target, channel=self._poll_channel)
            self._refresher = threading.Thread(
                target=self._refresh_loop,
                args=(refresh_s, poll),
                name="kvmesh-p2p-membership",
                daemon=True,
            )
            self._refresher.start()

    def _refresh_loop(self, period_s: float, poll: MembershipClient) -> None:
        failing = False
        while not self._closed.wait(period_s):
            started = time.monotonic()
            try:
                self._list(timeout=MEMBERSHIP_TTL_S, membership=poll)
            except Exception as exc:  # PeerUnavailable; ValueError: closed meanwhile
                # Whatever went wrong, the thread goes on: a poll that stopped while the
                # directory names no peers would leave P2P off for good.
                if self._closed.is_set():
                    return
                with self._lock:
                    if started >= self._peers_at:
                        self._unreachable = True
                if not failing:  # once per outage, not every period
                    logger.warning(
                        "P2P membership poll failed; no peers until it works again: %s", exc
                    )
                failing = True
            else:
                if failing:
                    logger.info("P2P membership poll works again")
                failing = False

    def holders(self, keys: Sequence[ObjectKey], timeout: float) -> list[frozenset[str]]:
        if len(keys) > MAX_LOOKUP_KEYS:
            keys = keys[:MAX_LOOKUP_KEYS]
        request = directory_pb2.LookupRequest(
            keys=directory_pb2.KeyList(keys=[key_to_proto(k) for k in keys])
        )
        try:
            response = self._directory.lookup(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise PeerUnavailable(f"directory lookup failed: {_describe(exc)}") from None
        out: list[frozenset[str]] = []
        for result in response.results:
            out.append(
                frozenset(
                    p.instance_id
                    for p in result.placements
                    if p.tier == common_pb2.TIER_L1
                    or (p.tier == common_pb2.TIER_L2 and not p.shared)
                )
            )
        if len(out) != len(keys):
            raise PeerUnavailable(f"directory answered {len(out)} results for {len(keys)} keys")
        return out

    def peers(self, timeout: float) -> dict[str, PeerTarget]:
        with self._lock:
            if self._unreachable:
                return {}
            if time.monotonic() - self._peers_at < MEMBERSHIP_TTL_S:
                return dict(self._peers)
        return self._list(timeout)

    def _list(
        self, timeout: float, membership: MembershipClient | None = None
    ) -> dict[str, PeerTarget]:
        """Ask the coordinator for the live members and cache the answer."""
        started = time.monotonic()
        try:
            response = (membership or self._membership).list_instances(
                membership_pb2.ListInstancesRequest(), timeout=timeout
            )
        except grpc.RpcError as exc:
            raise PeerUnavailable(f"membership listing failed: {_describe(exc)}") from None
        peers = {
            i.instance_id: PeerTarget(i.instance_id, i.endpoints.storage_address, i.incarnation)
            for i in response.instances
            if i.endpoints.storage_address and not i.endpoints.storage_address.startswith("lane:")
        }
        with self._lock:
            if started >= self._peers_at:  # never overwrite a newer listing
                self._peers = peers
                self._peers_at = started
                self._unreachable = False
        return dict(peers)

    def cached_peers(self) -> dict[str, PeerTarget] | None:
        with self._lock:
            if self._unreachable:
                return {}
            if time.monotonic() - self._peers_at < MEMBERSHIP_TTL_S:
                return dict(self._peers)
        return None

    def find(
        self,
        like: ObjectKey,
        world_size: int,
        prompt: Sequence[int],
        stride: int,
        timeout: float,
    ) -> list[tuple[int, int, bytes]]:
        """The coordinator's BlendLookup (a
        :class:`~kvmesh.storage.core.segment_catalog.FleetSegments`)."""
        request = directory_pb2.BlendLookupRequest(
            tokens=directory_pb2.TokenQuery(
                model_name=like.model_name,
                world_size=world_size,
                cache_salt=like.cache_salt,
                token_ids=prompt,
            ),
            stride=stride,
        )
        try:
            response = self._directory.blend_lookup(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise FleetUnavailable(f"blend lookup failed: {_describe(exc)}") from None
        return [(m.start_token, m.num_tokens, m.chunk_hash) for m in response.matches]

    def close(self) -> None:
        self._closed.set()
        self._channel.close()  # a listing in flight ends at once
        if self._poll_channel is not None:
            self._poll_channel.close()
        if self._refresher is not None:
            self._refresher.join()


class GrpcPeerLink:
    """Other nodes' PeerService, one channel per peer address (kept until close).

    Chunk bytes come over the peer's TCP data plane (one connection per
    lease, :mod:`kvmesh.storage.peers.tcp_stream`) when its LockPrefix
    answer names a data port, and over ReadChunks otherwise.
    """

    def __init__(
        self,
        instance_id: str,
        *,
        max_message_bytes: int = 64 * 1024 * 1024,
        frame_bytes: int = 1024 * 1024,
    ) -> None:
        self.instance_id = instance_id
        self.max_message_bytes = max_message_bytes
        self.frame_bytes = frame_bytes  # of a ReadChunks stream
        self._lock = threading.Lock()
        self._clients: dict[str, PeerClient] = {}
        self._calls: set[Any] = set()
        self._sockets: set[socket.socket] = set()
        self._closed = False

    def _client(self, peer: PeerTarget) -> PeerClient:
        with self._lock:
            if self._closed:
                raise PeerUnavailable("the P2P link is closed")
            client = self._clients.get(peer.address)
            if client is None:
                client = PeerClient(peer.address, max_message_bytes=self.max_message_bytes)
                self._clients[peer.address] = client
            return client

    def lock(
        self,
        peer: PeerTarget,
        rows: Sequence[Sequence[ObjectKey]],
        ttl_s: float,
        timeout: float,
    ) -> PeerLease:
        first = rows[0][0]
        if any(
            k.model_name != first.model_name
            or k.cache_salt != first.cache_salt
            or k.object_group_id != first.object_group_id
            or k.chunk_hash != rows[0][c].chunk_hash
            for row in rows
            for c, k in enumerate(row)
        ):
            raise PeerUnavailable("the rows do not form one key grid")
        request = peer_pb2.LockPrefixRequest(
            keys=common_pb2.KeyGrid(
                model_name=first.model_name,
                cache_salt=first.cache_salt,
                object_group_id=first.object_group_id,
                kv_ranks=[row[0].kv_rank for row in rows],
                chunk_hashes=[k.chunk_hash for k in rows[0]],
            ),
            lease_ttl_ms=max(1, min(600_000, int(ttl_s * 1000))),
            expected_incarnation=peer.incarnation,
            requester_id=self.instance_id,
        )
        try:
            response = self._client(peer).lock_prefix(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise PeerUnavailable(f"{peer.instance_id}: {_describe(exc)}") from None
        if response.instance_id != peer.instance_id:
            if response.lease_id:
                self.unlock(peer, response.lease_id, 2.0)
            raise PeerUnavailable(
                f"{peer.address} is {response.instance_id!r}, not {peer.instance_id!r}"
            )
        return PeerLease(
            response.lease_id,
            response.locked_chunks,
            tuple(response.chunk_sizes),
            response.data_port,
        )

    def read(self, peer: PeerTarget, lease: PeerLease, sink: FrameSink, timeout: float) -> bool:
        """Over the peer's TCP data plane when it has one, else its ReadChunks stream.

        A data port that cannot be reached (a firewall, a container that does not
        publish it) or a peer too busy to stream falls back to ReadChunks: the
        lease is untouched in both cases.
        """
        if lease.data_port:
            deadline = time.monotonic() + timeout
            try:
                return self._read_tcp(peer, lease, sink, deadline)
            except _NoDataPlane as exc:
                logger.info("P2P: %s; reading over ReadChunks instead", exc)
            timeout = max(0.001, deadline - time.monotonic())
        return self._read_grpc(peer, lease, sink, timeout)

    def _read_tcp(
        self, peer: PeerTarget, lease: PeerLease, sink: FrameSink, deadline: float
    ) -> bool:
        host, _ = split_advertise_address(peer.address)
        connect_s = max(0.001, min(CONNECT_TIMEOUT_S, deadline - time.monotonic()))
        try:
            sock = socket.create_connection((host, lease.data_port), timeout=connect_s)
        except OSError as exc:
            raise _NoDataPlane(
                f"{peer.instance_id}: data port {host}:{lease.data_port} unreachable: {exc}"
            ) from None
        with sock:
            with self._lock:
                if self._closed:
                    raise PeerUnavailable("the P2P link is closed")
                self._sockets.add(sock)
            try:
                return tcp_stream.receive(sock, lease.lease_id, sink, deadline)
            except tcp_stream.StreamRefused as exc:
                if exc.code == "RESOURCE_EXHAUSTED":
                    raise _NoDataPlane(f"{peer.instance_id}: {exc}") from None
                raise PeerUnavailable(f"{peer.instance_id}: {exc}") from None
            except PeerUnavailable as exc:
                raise PeerUnavailable(f"{peer.instance_id}: {exc}") from None
            finally:
                with self._lock:
                    self._sockets.discard(sock)

    def _read_grpc(
        self, peer: PeerTarget, lease: PeerLease, sink: FrameSink, timeout: float
    ) -> bool:
        client = self._client(peer)
        request = peer_pb2.ReadChunksRequest(
            lease_id=lease.lease_id, max_frame_bytes=self.frame_bytes
        )
        try:
            call = client.read_chunks(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise PeerUnavailable(f"{peer.instance_id}: {_describe(exc)}") from None
        # A traced channel hands back a generator around the call (no cancel()):
        # closing it ends the stream, and the fetcher unlocks a lease it did not finish.
        cancel = getattr(call, "cancel", None)
        with self._lock:
            if self._closed:
                _end(call, cancel)
                raise PeerUnavailable("the P2P link is closed")
            if cancel is not None:
                self._calls.add(call)
        try:
            return deliver(call, sink)
        except grpc.RpcError as exc:
            raise PeerUnavailable(f"{peer.instance_id}: {_describe(exc)}") from None
        finally:
            _end(call, cancel)  # a no-op after a normal end; stops the stream otherwise
            with self._lock:
                self._calls.discard(call)

    def unlock(self, peer: PeerTarget, lease_id: str, timeout: float) -> None:
        try:
            self._client(peer).unlock(peer_pb2.UnlockRequest(lease_id=lease_id), timeout=timeout)
        except grpc.RpcError as exc:
            raise PeerUnavailable(f"{peer.instance_id}: {_describe(exc)}") from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            calls = list(self._calls)
            sockets = list(self._sockets)
            clients = list(self._clients.values())
            self._clients.clear()
        for call in calls:
            call.cancel()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # the reading thread's recv returns at once
        for client in clients:
            client.close()


def _end(call: Any, cancel: Any) -> None:
    if cancel is not None:
        cancel()
    else:
        close = getattr(call, "close", None)
        if close is not None:
            close()


def _describe(exc: grpc.RpcError) -> str:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    return f"{code.name if code else 'ERROR'}: {details}"
