"""``--node-realtime-priority`` of ``kvmesh bench vllm`` and ``kvmesh bench serve``.

The flag reaches the benchmark's own node as ``kvmesh node --realtime-priority``;
bad values are refused by the parser, and ``bench vllm`` refuses it beside
``--gateway`` (a node it did not start). The real node's threads are checked
in tests/integration/storage/test_storage_realtime.py.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench import serve
from kvmesh.bench.common import node_realtime_args
from kvmesh.bench.serve import arrangement
from kvmesh.cli.main import bench_parser


@pytest.mark.parametrize("name", ["vllm", "serve"])
def test_the_flag_defaults_to_off_and_refuses_what_a_node_would(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module = importlib.import_module(f"kvmesh.bench.{name}")
    parser = bench_parser(name, module)
    assert parser.parse_args([]).node_realtime_priority == 0
    assert parser.parse_args(["--node-realtime-priority", "10"]).node_realtime_priority == 10
    for bad, words in (("100", "1..99"), ("-1", "1..99"), ("x", "not an integer")):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["--node-realtime-priority", bad])
        assert exc.value.code == 2
        assert words in capsys.readouterr().err


def test_the_node_gets_the_option_only_when_asked() -> None:
    assert node_realtime_args(0) == []
    assert node_realtime_args(10) == ["--realtime-priority", "10"]


def test_bench_vllm_refuses_it_for_a_node_it_did_not_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vllm_bench = importlib.import_module("kvmesh.bench.vllm")
    monkeypatch.setattr(vllm_bench.importlib.util, "find_spec", lambda name: object())
    ran: list[object] = []
    monkeypatch.setattr(vllm_bench, "run_engine", lambda spec: ran.append(spec) or [])
    args = bench_parser("vllm", vllm_bench).parse_args(
        ["--gateway", "lane:/nowhere", "--node-realtime-priority", "10"]
    )
    with pytest.raises(SystemExit, match="--realtime-priority instead"):
        vllm_bench.run(args)
    assert ran == []


def test_bench_serve_starts_its_node_with_the_option(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[list[str]] = []

    class Stop(Exception):
        """Ends the arrangement's start once the node is asked for."""

    def fake_start_node(work: Path, l1_size: str, chunk: int, extra: Any = ()) -> None:
        seen.append(list(extra))
        raise Stop

    monkeypatch.setattr(arrangement, "start_node", fake_start_node)
    parser = bench_parser("serve", serve)
    for argv, expected in (
        ([], []),
        (["--node-realtime-priority", "5"], ["--realtime-priority", "5"]),
    ):
        args = parser.parse_args(argv)
        shape = {"kv_bytes_per_token": 1024}
        one = arrangement.Arrangement(
            args, "kvmesh", tmp_path, shape, tmp_path, serve.Progress.for_args("serve", args)
        )
        with pytest.raises(Stop):
            one.start()
        assert seen[-1] == expected
