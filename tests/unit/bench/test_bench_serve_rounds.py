"""``kvmesh bench serve``'s rounds: the workload of each query round, how rounds are
pooled, and the order in which arrangements run (the real servers run in
tests/e2e/with_vllm/test_bench_serve.py)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvmesh.bench import serve
from kvmesh.bench.serve.arrangement import QUESTION_TOKENS, Round, pooled
from kvmesh.bench.serve.client import Answer, ttft_summary


def _args(**overrides: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args([])
    args.documents, args.doc_tokens = 5, 300
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_every_query_round_asks_every_document_with_new_questions() -> None:
    warmup, rounds = serve._workload(_args(query_rounds=3))
    docs = [p[:-QUESTION_TOKENS] for p in warmup]
    assert len(rounds) == 3
    questions = {tuple(p[-QUESTION_TOKENS:]) for p in warmup}
    for prompts in rounds:
        assert sorted(p[:-QUESTION_TOKENS] for p in prompts) == sorted(docs)
        asked = {tuple(p[-QUESTION_TOKENS:]) for p in prompts}
        assert not asked & questions  # never a question asked before: no full-prompt hit
        questions |= asked
    assert rounds[0] != rounds[1]  # new questions (and most likely another order)


def test_the_first_query_round_does_not_depend_on_how_many_follow() -> None:
    warmup_1, rounds_1 = serve._workload(_args(query_rounds=1))
    warmup_4, rounds_4 = serve._workload(_args(query_rounds=4))
    assert warmup_1 == warmup_4
    assert rounds_1[0] == rounds_4[0]


def _round(ttfts_ms: list[float], seconds: float, prefill: float) -> Round:
    answers = [Answer(i, t / 1e3, t / 1e3, 256) for i, t in enumerate(ttfts_ms)]
    summary = {**ttft_summary(answers, seconds), "queue_ms_mean": 0.5, "prefill_ms_mean": prefill}
    return Round(answers, seconds, summary)


def test_one_round_is_its_own_figures() -> None:
    one = _round([10.0, 30.0], 1.0, 7.0)
    assert pooled([one]) == one.summary


def test_several_rounds_pool_every_answer() -> None:
    figures = pooled([_round([10.0, 30.0], 1.0, 6.0), _round([50.0, 70.0], 3.0, 8.0)])
    assert figures["ttft_mean_ms"] == 40.0  # over all four answers, not a mean of means
    assert figures["ttft_max_ms"] == 70.0
    assert figures["round_s"] == 2.0  # a round's mean time
    assert figures["prefill_ms_mean"] == 7.0
    assert figures["queue_ms_mean"] == 0.5
    assert figures["cached_tokens"] == 4 * 256


class _Fake:
    """An arrangement that records what it was asked to do (the order is the point)."""

    def __init__(self, name: str, log: list[str], fail_on: str = "") -> None:
        self.name = name
        self.log = log
        self.fail_on = fail_on

    def _do(self, what: str) -> None:
        self.log.append(f"{self.name} {what}")
        if what == self.fail_on:
            raise RuntimeError(f"{self.name} failed to {what}")

    def start(self) -> None:
        self._do("start")

    def run_round(self, label: str, prompts: list[list[int]]) -> None:
        self._do(f"{label} {prompts[0][0]}")

    def result(self) -> dict[str, Any]:
        self._do("result")
        return {"name": self.name}

    def stop(self, *, abandoned: bool) -> None:
        self.log.append(f"{self.name} stop{' abandoned' if abandoned else ''}")


def test_query_rounds_take_turns_in_alternating_order() -> None:
    log: list[str] = []
    each = [_Fake("floor", log), _Fake("kvmesh", log)]
    results = serve._taking_turns(each, [[0]], [[[1]], [[2]], [[3]]], pause_s=0)  # type: ignore[arg-type]
    assert results == {"floor": {"name": "floor"}, "kvmesh": {"name": "kvmesh"}}
    assert log == [
        "floor start", "floor warmup 0", "kvmesh start", "kvmesh warmup 0",
        "floor query 1", "kvmesh query 1",
        "kvmesh query 2", "floor query 2",
        "floor query 3", "kvmesh query 3",
        "floor result", "kvmesh result",
        "floor stop", "kvmesh stop",
    ]  # fmt: skip


def test_a_failed_turn_stops_every_arrangement_it_started() -> None:
    log: list[str] = []
    each = [_Fake("floor", log), _Fake("kvmesh", log, fail_on="query 2")]
    with pytest.raises(RuntimeError, match="kvmesh failed to query 2"):
        serve._taking_turns(each, [[0]], [[[1]], [[2]]], pause_s=0)  # type: ignore[arg-type]
    assert log[-2:] == ["floor stop abandoned", "kvmesh stop abandoned"]


def test_one_arrangement_at_a_time_stops_each_before_the_next_starts() -> None:
    log: list[str] = []
    for name in ("floor", "kvmesh"):  # how run() uses it with one query round
        serve._taking_turns([_Fake(name, log)], [[0]], [[[1]]], pause_s=0)  # type: ignore[list-item]
    assert log == [
        "floor start", "floor warmup 0", "floor query 1", "floor result", "floor stop",
        "kvmesh start", "kvmesh warmup 0", "kvmesh query 1", "kvmesh result", "kvmesh stop",
    ]  # fmt: skip


def test_query_rounds_below_one_are_refused() -> None:
    with pytest.raises(SystemExit, match="--query-rounds must be >= 1"):
        serve.run(_args(query_rounds=0))
