"""The asking side of P2P (PeerFetcher) over a real L1, with a scripted directory and peer.

The directory and the link are test doubles of the ports (they are the
network); everything else (L1 state machine, staging, publish, locks) is the
real core. Each test scripts one way a peer can let the asker down.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l1.manager import L1Manager
from kvmesh.storage.core.peer import fetch as fetch_module
from kvmesh.storage.core.peer.choice import pick_peer, rendezvous
from kvmesh.storage.core.peer.fetch import FetchSettings, PeerFetcher
from kvmesh.storage.core.peer.ports import (
    FrameSink,
    PeerLease,
    PeerTarget,
    PeerUnavailable,
    deliver,
)
from tests.unit.storage.helpers import make_key

SIZE = 4096
PEER = PeerTarget("node-a", "127.0.0.1:1", 7)


def payload(index: int) -> bytes:
    return bytes([index % 251 + 1]) * SIZE


class Directory:
    def __init__(self, holders: dict[ObjectKey, set[str]], peers: dict[str, PeerTarget]) -> None:
        self.map = holders
        self.live = peers
        self.fail = False
        self.holder_calls = 0
        #: What the last peers() call returned, and whether that listing has aged.
        self.listed: dict[str, PeerTarget] | None = None
        self.stale = False

    def holders(self, keys: Sequence[ObjectKey], timeout: float) -> list[frozenset[str]]:
        self.holder_calls += 1
        if self.fail:
            raise PeerUnavailable("coordinator down")
        return [frozenset(self.map.get(k, set())) for k in keys]

    def peers(self, timeout: float) -> dict[str, PeerTarget]:
        self.listed = dict(self.live)
        return dict(self.live)

    def cached_peers(self) -> dict[str, PeerTarget] | None:
        return None if self.listed is None or self.stale else dict(self.listed)

    def close(self) -> None:
        pass


class Link:
    """A peer holding ``held`` chunks; ``script`` shapes the stream it sends."""

    def __init__(self, held: int, *, sizes: list[int] | None = None) -> None:
        self.held = held
        self.sizes = sizes
        self.locks = 0
        self.unlocks: list[str] = []
        self.die_after_frames: int | None = None
        self.frame = SIZE // 2
        self.gate: threading.Event | None = None
        self.frames_override: list[tuple[int, int, bytes]] | None = None

    def lock(
        self, peer: PeerTarget, rows: Sequence[Sequence[ObjectKey]], ttl_s: float, timeout: float
    ) -> PeerLease:
        self.locks += 1
        n = min(self.held, len(rows[0]))
        sizes = self.sizes or [SIZE] * (n * len(rows))
        return PeerLease(f"lease-{self.locks}", n, tuple(sizes))

    def read(self, peer: PeerTarget, lease: PeerLease, sink: FrameSink, timeout: float) -> bool:
        return deliver(self.frames(), sink)

    def frames(self) -> Iterator[tuple[int, int, memoryview]]:
        if self.gate is not None:
            self.gate.wait(10)
        if self.frames_override is not None:
            for index, offset, data in self.frames_override:
                yield index, offset, memoryview(data)
            return
        sent = 0
        for index in range(self.held):
            data = payload(index)
            for offset in range(0, SIZE, self.frame):
                if self.die_after_frames is not None and sent >= self.die_after_frames:
                    raise PeerUnavailable("peer died")
                yield index, offset, memoryview(data)[offset : offset + self.frame]
                sent += 1

    def unlock(self, peer: PeerTarget, lease_id: str, timeout: float) -> None:
        self.unlocks.append(lease_id)

    def close(self) -> None:
        pass


def keys(n: int) -> list[ObjectKey]:
    return [make_key(i) for i in range(n)]


def fetcher(l1: L1Manager, link: Link, ks: list[ObjectKey], held: int = 4) -> PeerFetcher:
    directory = Directory({k: {"node-a"} for k in ks[:held]}, {"node-a": PEER})
    return PeerFetcher(
        l1,
        directory,
        link,
        instance_id="node-b",
        settings=FetchSettings(lookup_timeout_s=2, load_timeout_s=2),
    )


def resident_bytes(l1: L1Manager, key: ObjectKey) -> bytes:
    _, objects = l1.unsafe_read([key])
    return bytes(objects[key].view())


def test_a_whole_prefix_arrives_published_and_locked(l1: L1Manager) -> None:
    ks = keys(6)
    link = Link(held=4)
    f = fetcher(l1, link, ks)
    try:
        assert f.fetch("r", [ks], 2, None) == 4
        for i, key in enumerate(ks[:4]):
            assert l1.read_lock_count(key) == 2
            assert resident_bytes(l1, key) == payload(i)
        assert l1.contains(ks[4:]) == [False, False]
        assert l1.staging_count == 0
        assert link.unlocks == []  # the stream's end ended the lease
        assert f.stats()["fetched_chunks"] == 4
    finally:
        f.close()


def test_a_peer_dying_mid_stream_leaves_only_whole_chunks(l1: L1Manager) -> None:
    ks = keys(4)
    link = Link(held=4)
    link.die_after_frames = 5  # chunks 0 and 1 whole, half of chunk 2
    f = fetcher(l1, link, ks)
    try:
        assert f.fetch("r", [ks], 1, None) == 2
        assert l1.contains(ks) == [True, True, False, False]
        assert resident_bytes(l1, ks[1]) == payload(1)
        assert l1.staging_count == 0
        assert link.unlocks == ["lease-1"]  # the broken stream is unlocked explicitly
        assert f.stats()["fetch_failures"] == 1
    finally:
        f.close()


def test_frames_out_of_order_or_too_long_cut_the_prefix(l1: L1Manager) -> None:
    ks = keys(3)
    link = Link(held=3)
    link.frames_override = [
        (0, 0, payload(0)),
        (1, 0, payload(1)[:100]),
        (1, 200, payload(1)[:100]),  # a gap: not the next offset
        (2, 0, payload(2)),
    ]
    f = fetcher(l1, link, ks)
    try:
        assert f.fetch("r", [ks], 1, None) == 1
        assert l1.contains(ks) == [True, False, False]
        assert l1.staging_count == 0
        link.frames_override = [(0, 0, payload(0) + b"x")]  # more bytes than announced
        l1.finish_read([ks[0]])
        l1.delete([ks[0]])
        assert f.fetch("r", [ks], 1, None) == 0
        assert l1.contains(ks) == [False, False, False]
        assert l1.staging_count == 0
    finally:
        f.close()


def test_announced_sizes_must_match_the_chunk_size(l1: L1Manager) -> None:
    ks = keys(2)
    link = Link(held=2, sizes=[SIZE, SIZE + 1])
    f = fetcher(l1, link, ks)
    try:
        assert f.fetch("r", [ks], 1, [SIZE]) == 1  # chunk 1's size is wrong: cut there
        assert l1.contains(ks) == [True, False]
        link.sizes = [SIZE * 2, SIZE]
        l1.finish_read([ks[0]])
        l1.delete([ks[0]])
        assert f.fetch("r", [ks], 1, [SIZE]) == 0
        assert link.unlocks  # a lease that is not read is unlocked
        assert l1.staging_count == 0
    finally:
        f.close()


def test_a_directory_failure_or_no_holder_is_a_miss(l1: L1Manager) -> None:
    ks = keys(2)
    link = Link(held=2)
    f = fetcher(l1, link, ks, held=0)
    try:
        assert f.fetch("r", [ks], 1, None) == 0
        assert link.locks == 0
        f.directory.fail = True  # type: ignore[attr-defined]
        assert f.fetch("r", [ks], 1, None) == 0
        assert f.stats()["fetch_failures"] == 1
    finally:
        f.close()


def test_concurrent_fetches_of_the_same_keys_lock_the_peer_once(l1: L1Manager) -> None:
    ks = keys(3)
    link = Link(held=3)
    link.gate = threading.Event()
    f = fetcher(l1, link, ks)
    results: list[int] = []

    def ask() -> None:
        results.append(f.fetch("r", [ks], 1, None))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        # The leader is inside read (blocked on the gate); the others must join it.
        deadline = threading.Event()
        for _ in range(500):
            if f.stats()["joined_fetches"] == 2:
                break
            deadline.wait(0.01)
        assert f.stats()["joined_fetches"] == 2
        link.gate.set()
        for t in threads:
            t.join(10)
        assert results == [3, 3, 3]
        assert link.locks == 1
        assert all(l1.read_lock_count(k) == 3 for k in ks)
    finally:
        link.gate.set()
        f.close()


def test_the_longest_prefix_wins_and_ties_follow_the_rendezvous_hash() -> None:
    ks = keys(3)
    peers = {n: PeerTarget(n, f"h:{i + 1}", 1) for i, n in enumerate(["x", "y", "z", "me"])}
    holders = [frozenset({"x", "y", "me"}), frozenset({"y", "me"}), frozenset({"me", "z"})]
    assert pick_peer([ks], holders, peers, "me") == (peers["y"], 2)
    tie = [frozenset({"x", "y"})] * 3
    want = max(["x", "y"], key=lambda n: rendezvous(n, ks[0].chunk_hash))
    assert pick_peer([ks], tie, peers, "me") == (peers[want], 3)
    # Not alive (absent from membership) or only this node: no peer.
    assert pick_peer([ks], [frozenset({"gone"})] * 3, peers, "me") == (None, 0)
    assert pick_peer([ks], [frozenset({"me"})] * 3, peers, "me") == (None, 0)


def test_a_closed_fetcher_refuses_new_work(l1: L1Manager) -> None:
    f = fetcher(l1, Link(held=1), keys(1))
    f.close()
    with pytest.raises(RuntimeError):
        f.submit("r", [keys(1)], 1, None, lambda n: None)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """The fetcher's spans, kept in memory (a tracer of its own: no global provider)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(fetch_module, "_tracer", provider.get_tracer("test"))
    return exporter


def test_the_fetch_span_records_failures_and_misses(
    l1: L1Manager, spans: InMemorySpanExporter
) -> None:
    ks = keys(4)
    link = Link(held=4)
    link.die_after_frames = 5  # two whole chunks, then the peer dies
    f = fetcher(l1, link, ks)
    try:
        assert f.fetch("dies", [ks], 1, None) == 2
        (span,) = spans.get_finished_spans()
        assert span.name == "kvmesh.p2p.fetch"
        assert span.status.status_code is StatusCode.ERROR
        assert "node-a" in (span.status.description or "")
        assert span.attributes is not None
        assert span.attributes["kvmesh.p2p.outcome"] == "failed"
        assert span.attributes["kvmesh.p2p.chunks_fetched"] == 2
        exceptions = [e for e in span.events if e.name == "exception"]
        assert exceptions
        assert exceptions[0].attributes is not None
        assert str(exceptions[0].attributes["exception.type"]).endswith("PeerUnavailable")
        assert f.stats()["received_bytes"] == 5 * link.frame
        spans.clear()

        f.directory.fail = True  # type: ignore[attr-defined]
        assert f.fetch("no directory", [keys(6)[4:]], 1, None) == 0
        (span,) = spans.get_finished_spans()
        assert span.status.status_code is StatusCode.ERROR
        assert any(e.name == "exception" for e in span.events)
        spans.clear()

        f.directory.fail = False  # type: ignore[attr-defined]
        assert f.fetch("nobody has it", [keys(6)[4:]], 1, None) == 0  # no holder: a miss
        (span,) = spans.get_finished_spans()
        assert span.status.status_code is not StatusCode.ERROR
        assert span.attributes is not None
        assert span.attributes["kvmesh.p2p.outcome"] == "miss"
        assert f.stats()["misses"] == 1
    finally:
        f.close()


def test_a_peer_that_locks_nothing_is_a_counted_miss(l1: L1Manager) -> None:
    ks = keys(2)
    link = Link(held=0)  # the directory still names the peer; it evicted the keys
    f = fetcher(l1, link, ks)
    try:
        assert f.fetch("r", [ks], 1, None) == 0
        assert link.locks == 1
        stats = f.stats()
        assert (stats["misses"], stats["fetch_failures"], stats["received_bytes"]) == (1, 0, 0)
        assert l1.staging_count == 0
    finally:
        f.close()


@pytest.mark.parametrize("live", [{}, {"node-b": PeerTarget("node-b", "127.0.0.1:2", 1)}])
def test_a_node_alone_in_its_fleet_misses_without_asking_the_directory(
    l1: L1Manager, live: dict[str, PeerTarget]
) -> None:
    ks = keys(2)
    link = Link(held=2)
    directory = Directory({k: {"node-a"} for k in ks}, live)
    f = PeerFetcher(l1, directory, link, instance_id="node-b")
    try:
        assert f.fetch("r", [ks], 1, None) == 0
        assert directory.holder_calls == 0
        assert link.locks == 0
        stats = f.stats()
        assert (stats["misses"], stats["directory_lookups"], stats["fetch_failures"]) == (1, 0, 0)
    finally:
        f.close()


def test_alone_trusts_only_a_cached_listing_with_no_other_node(l1: L1Manager) -> None:
    ks = keys(2)
    me = {"node-b": PeerTarget("node-b", "127.0.0.1:2", 1)}
    directory = Directory({}, me)
    f = PeerFetcher(l1, directory, Link(held=0), instance_id="node-b")
    try:
        assert not f.alone()  # nothing listed yet: unknown, so ask
        assert f.fetch("r", [ks], 1, None) == 0  # lists the members: only this node
        assert f.alone()
        directory.stale = True
        assert not f.alone()  # the cache expired: the next miss lists again
        directory.stale = False
        directory.live = {**me, "node-a": PEER}
        assert f.fetch("r", [ks], 1, None) == 0
        assert not f.alone()  # another node joined
    finally:
        f.close()
