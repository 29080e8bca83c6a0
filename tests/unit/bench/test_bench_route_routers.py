"""``kvmesh bench route``'s routers and workload, without a fleet (the e2e test runs one)."""

from __future__ import annotations

from kvmesh.bench.route.params import default_omp_binds
from kvmesh.bench.route.routers import OracleRouter, RoundRobinRouter
from kvmesh.bench.route.workload import Shape, requests

CHUNK = 4


def test_oracle_picks_the_longest_prefix_in_whole_chunks() -> None:
    router = OracleRouter(2, CHUNK)
    a = list(range(100, 112))  # 3 chunks
    assert router.pick(a) == 0  # nothing cached anywhere: round robin starts at engine 0
    router.done(0)
    b = list(range(200, 212))
    assert router.pick(b) == 1
    router.done(1)
    # Round robin's turn is engine 0's, but b's prefix is on engine 1: one whole chunk of
    # it (a token short of a second), then two.
    assert router.pick([*b[:7], 9, 9, 9, 9, 9]) == 1
    router.done(1)
    assert router.pick([*b[:8], 9, 9, 9, 9]) == 1
    router.done(1)
    assert router.rank([*a[:8], 7, 7, 7, 7]) == [8.0, 0.0]
    assert router.rank([*a[:3], 1]) == [0.0, 0.0]  # less than a chunk matches nothing


def test_ties_go_to_the_fewest_in_flight_then_round_robin() -> None:
    router = OracleRouter(3, CHUNK)
    fresh = iter(range(1000, 10_000, CHUNK))

    def prompt() -> list[int]:
        return list(range(next(fresh), next(fresh) + CHUNK))

    assert [router.pick(prompt()) for _ in range(3)] == [0, 1, 2]
    router.done(1)
    assert router.pick(prompt()) == 1  # the only engine with nothing in flight
    for engine in (0, 1, 2):
        router.done(engine)
    assert router.pick(prompt()) == 2  # all idle: the turn after engine 1


def test_round_robin_cycles_whatever_the_load() -> None:
    router = RoundRobinRouter(2)
    assert [router.pick([1, 2, 3]) for _ in range(5)] == [0, 1, 0, 1, 0]


def test_workload_sends_each_group_first_once_and_gives_each_router_its_own_tokens() -> None:
    shape = Shape(
        groups=3, prefix_tokens=8, requests_per_group=4, suffix_tokens=2, vocab_size=500, seed=1
    )
    score, oracle = requests(shape, "score"), requests(shape, "oracle")
    assert len(score) == shape.requests
    firsts = [r.group for r in score[: shape.groups]]
    assert sorted(firsts) == [0, 1, 2]
    # The same order of groups for every router, other tokens.
    assert [r.group for r in score] == [r.group for r in oracle]
    assert {tuple(r.prompt[:8]) for r in score}.isdisjoint(tuple(r.prompt[:8]) for r in oracle)
    for request in score:
        assert len(request.prompt) == 10
        assert all(100 <= t < 400 for t in request.prompt)
    by_group = {r.group: r.prompt[:8] for r in score}
    assert all(r.prompt[:8] == by_group[r.group] for r in score)
    assert shape.reusable_tokens(CHUNK) == 3 * 3 * 8


def test_each_engine_gets_its_own_cores() -> None:
    assert default_omp_binds(2) == "0;1"
    assert default_omp_binds(16) == "0-6;7-13"
