"""FindSegments on a node with a coordinator (storage.core.node_segments): local matches
first, the fleet's where the prompt is uncovered, and a coordinator that fails costs one
call per retry period, not a timeout per lookup. The blend index is faked (its real
form is tested with a coordinator in tests/integration/p2p/test_p2p_segments.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np

from kvmesh.common.hashing import segment_key
from kvmesh.common.keys import ObjectKey, worker_kv_rank
from kvmesh.storage.core.node_segments import FLEET_RETRY_S, NodeSegments
from kvmesh.storage.core.segment_catalog import FleetUnavailable, checked_segment_tokens

MODEL = "m"
RANK = worker_kv_rank(1, 0)
LIKE = ObjectKey(b"", MODEL, RANK)


class FakeFleet:
    def __init__(self, answer: list[tuple[int, int, bytes]] | None) -> None:
        self.answer = answer
        self.calls: list[int] = []

    def find(self, like: ObjectKey, world_size: int, prompt: Sequence[int], stride: int,
             timeout: float) -> list[tuple[int, int, bytes]]:  # fmt: skip
        self.calls.append(world_size)
        if self.answer is None:
            raise FleetUnavailable("coordinator down")
        return self.answer


def _node(resident: set[bytes], fleet: FakeFleet) -> tuple[NodeSegments, list[float]]:
    l1 = SimpleNamespace(contains=lambda keys: [k.chunk_hash in resident for k in keys])
    segments = NodeSegments(SimpleNamespace(l1=l1), None, lambda engine: None)  # type: ignore[arg-type]
    segments.fleet = fleet
    now = [100.0]
    segments._clock = lambda: now[0]  # type: ignore[method-assign]
    return segments, now


def _find(segments: NodeSegments, prompt: list[int]) -> list[tuple[int, int, bool]]:
    found, _ = asyncio.run(segments.find_in_fleet(LIKE, prompt, 1))
    return [(start, length, here) for start, length, _, here in found]


def _doc(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def test_local_matches_come_first_and_the_fleet_fills_the_rest() -> None:
    local_doc, remote_doc = _doc(100, 20), _doc(500, 30)
    key = ObjectKey(segment_key(MODEL, local_doc), MODEL, RANK)
    prompt = [*_doc(1, 4), *remote_doc, *local_doc]
    fleet = FakeFleet([(4, 30, segment_key(MODEL, remote_doc)), (30, 10, b"x" * 32)])
    segments, _ = _node({key.chunk_hash}, fleet)
    segments.catalog.note(key, checked_segment_tokens(key, local_doc, "t"))
    # The fleet's second match overlaps the local one at 34: the local one wins.
    assert _find(segments, prompt) == [(4, 30, False), (34, 20, True)]
    assert fleet.calls == [1]  # world size from the packed kv rank


def test_a_failed_coordinator_is_not_asked_again_until_the_retry_period_ends() -> None:
    fleet = FakeFleet(None)
    segments, now = _node(set(), fleet)
    prompt = np.arange(64).tolist()
    assert _find(segments, prompt) == []
    assert _find(segments, prompt) == []
    assert len(fleet.calls) == 1
    fleet.answer = [(0, 20, b"y" * 32)]
    now[0] += FLEET_RETRY_S + 1
    assert _find(segments, prompt) == [(0, 20, False)]
    assert len(fleet.calls) == 2


def test_without_a_coordinator_finds_are_local() -> None:
    segments, _ = _node(set(), FakeFleet([(0, 20, b"z" * 32)]))
    segments.fleet = None
    assert _find(segments, _doc(0, 40)) == []
