"""The coordinator-backed peer directory's membership cache, read without blocking."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest

from kvmesh.api.coordinator.v1 import membership_pb2
from kvmesh.storage.core.peer.ports import PeerTarget
from kvmesh.storage.peers import links
from kvmesh.storage.peers.links import MEMBERSHIP_TTL_S, CoordinatorPeerDirectory
from tests.support.waiting import wait_until


class Membership:
    """Stands in for the coordinator's MembershipService; counts the listings."""

    def __init__(self) -> None:
        self.calls = 0

    def list_instances(self, request: Any, timeout: float) -> membership_pb2.ListInstancesResponse:
        self.calls += 1
        endpoints = membership_pb2.InstanceEndpoints(storage_address="127.0.0.1:7001")
        lane = membership_pb2.InstanceEndpoints(storage_address="lane:/tmp/x.lane")
        return membership_pb2.ListInstancesResponse(
            instances=[
                membership_pb2.Instance(instance_id="a", incarnation=3, endpoints=endpoints),
                membership_pb2.Instance(instance_id="b", incarnation=1, endpoints=lane),
            ]
        )


def test_cached_peers_is_the_listing_peers_would_give_and_never_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(links.time, "monotonic", lambda: now[0])
    directory = CoordinatorPeerDirectory("127.0.0.1:1")  # the channel connects lazily
    membership = Membership()
    monkeypatch.setattr(directory, "_membership", membership)
    try:
        assert directory.cached_peers() is None  # nothing listed yet
        assert membership.calls == 0
        listed = directory.peers(1.0)
        assert listed == {"a": PeerTarget("a", "127.0.0.1:7001", 3)}  # lanes are not dialled
        now[0] += MEMBERSHIP_TTL_S / 2
        assert directory.cached_peers() == listed
        assert directory.peers(1.0) == listed
        assert membership.calls == 1  # both answered from the cache
        now[0] += MEMBERSHIP_TTL_S
        assert directory.cached_peers() is None  # expired: peers() would ask again
        assert membership.calls == 1
    finally:
        directory.close()


class FlakyMembership(Membership):
    """Fails while ``down`` is set, as a coordinator that is restarting."""

    def __init__(self, fail_after_s: float = 0.0) -> None:
        super().__init__()
        self.down = False
        self.fail_after_s = fail_after_s
        self.listed = threading.Event()

    def list_instances(self, request: Any, timeout: float) -> membership_pb2.ListInstancesResponse:
        if self.down:
            self.calls += 1
            time.sleep(self.fail_after_s)
            raise _Unavailable()
        response = super().list_instances(request, timeout)
        self.listed.set()
        return response


class Broken(FlakyMembership):
    """Fails with an error no gRPC call should raise."""

    def list_instances(self, request: Any, timeout: float) -> membership_pb2.ListInstancesResponse:
        if self.down:
            self.calls += 1
            raise KeyError("not an RpcError")
        return super().list_instances(request, timeout)


def test_an_unexpected_error_does_not_stop_the_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    membership = Broken()
    membership.down = True
    monkeypatch.setattr(links, "MembershipClient", lambda target, channel: membership)
    directory = CoordinatorPeerDirectory("127.0.0.1:1", refresh_s=0.02)
    try:
        wait_until(lambda: membership.calls >= 3)  # it went on polling
        assert directory.cached_peers() == {}
        membership.down = False
        wait_until(lambda: directory.cached_peers() == {"a": PeerTarget("a", "127.0.0.1:7001", 3)})
    finally:
        directory.close()


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "coordinator restarting"


def test_the_refresher_keeps_the_listing_fresh_while_nobody_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    membership = FlakyMembership()
    membership.down = True  # the first listings fail: nothing raised
    monkeypatch.setattr(links, "MembershipClient", lambda target, channel: membership)
    directory = CoordinatorPeerDirectory("127.0.0.1:1", refresh_s=0.02)
    try:
        deadline = time.monotonic() + 10
        while membership.calls < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert membership.calls >= 2  # retried after failing
        # The coordinator does not answer: no peer can be found, the lookup need not ask,
        # and a fetch does not list the members itself (the poll goes on doing it).
        assert directory.cached_peers() == {}
        assert directory.peers(1.0) == {}
        membership.down = False
        assert membership.listed.wait(10)
        # Listed with no caller: a lookup now reads the members without asking.
        assert directory.cached_peers() == {"a": PeerTarget("a", "127.0.0.1:7001", 3)}
        before = membership.calls
        deadline = time.monotonic() + 10
        while membership.calls < before + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert membership.calls >= before + 3  # it goes on listing
    finally:
        directory.close()
    stopped = membership.calls
    time.sleep(0.1)
    assert membership.calls == stopped  # close() stopped the thread


def test_no_refresher_unless_asked_and_bad_periods_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    membership = Membership()
    monkeypatch.setattr(links, "MembershipClient", lambda target, channel: membership)
    directory = CoordinatorPeerDirectory("127.0.0.1:1")
    try:
        time.sleep(0.1)
        assert membership.calls == 0
    finally:
        directory.close()
    for bad in (-1.0, MEMBERSHIP_TTL_S):
        with pytest.raises(ValueError, match="refresh_s"):
            CoordinatorPeerDirectory("127.0.0.1:1", refresh_s=bad)


def test_no_peers_while_polls_fail_however_long_each_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A coordinator that times out makes polls longer than a listing's lifetime: the
    directory still names no peers between them, never an expired (asking) listing."""
    membership = FlakyMembership(fail_after_s=MEMBERSHIP_TTL_S * 0.6)
    monkeypatch.setattr(links, "MembershipClient", lambda target, channel: membership)
    directory = CoordinatorPeerDirectory("127.0.0.1:1", refresh_s=MEMBERSHIP_TTL_S / 2)
    try:
        assert directory.peers(1.0) == {"a": PeerTarget("a", "127.0.0.1:7001", 3)}
        membership.down = True
        wait_until(lambda: directory.cached_peers() == {}, timeout=10)
        seen = set()
        deadline = time.monotonic() + MEMBERSHIP_TTL_S * 2.5
        while time.monotonic() < deadline:
            peers = directory.cached_peers()
            seen.add(None if peers is None else len(peers))
            time.sleep(0.02)
        assert seen == {0}
        membership.down = False
        wait_until(lambda: directory.cached_peers() == {"a": PeerTarget("a", "127.0.0.1:7001", 3)})
    finally:
        directory.close()
