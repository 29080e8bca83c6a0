"""Each benchmark, run at a tiny size, prints progress on stderr while it runs.

stdout is the result alone (with ``--json``: exactly one JSON object), and the
table made of it prints only what the run measured: no LMCache figure (none
is measured by a run). Figures are never checked.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench.common import HEARTBEAT_S
from kvmesh.cli.main import BENCHES, bench_parser

REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Run:
    name: str
    returncode: int
    stdout: str
    stderr: list[str]
    # (seconds since start, the line, whether the benchmark was still running)
    timeline: list[tuple[float, str, bool]]


def _run(name: str, *args: str, timeout: float = 240.0) -> Run:
    """``kvmesh bench NAME ARGS --json``, its stderr read line by line as it comes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "bench", name, *args, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    start = time.monotonic()
    timeline: list[tuple[float, str, bool]] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            timeline.append((time.monotonic() - start, line.rstrip("\n"), proc.poll() is None))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert proc.stdout is not None
        stdout = proc.stdout.read()
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    return Run(name, proc.returncode, stdout, [t[1] for t in timeline], timeline)


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[Path]:
    path = Path("/dev/shm") / f"kvmesh-bench-unit-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    try:
        yield path
    finally:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


TINY: dict[str, list[str]] = {
    "datapath": [
        "--chunks", "2", "--repetitions", "2", "--chunk-tokens", "16", "--num-layers", "2",
        "--kv-heads", "1", "--head-dim", "8", "--block-size", "16",
    ],
    "lookup": [
        "--arrangement", "in-process", "--iterations", "20", "--warmup", "3", "--chunks", "2",
    ],
    "ingest": [
        "--keys", "1024", "--emitters", "1", "--window", "2", "--lookups", "20",
    ],
    "p2p": ["--chunk-mib", "1", "--chunks", "2", "--rounds", "1"],
}  # fmt: skip
SHM = {"datapath", "lookup"}  # the benchmarks that take --shm-dir
SLOW = {"ingest", "p2p"}  # coordinator and storage processes: several seconds


@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(TINY)],
)
def run(request: pytest.FixtureRequest, shm_dir: Path) -> Run:
    name: str = request.param
    extra = ["--shm-dir", str(shm_dir)] if name in SHM else []
    done = _run(name, *TINY[name], *extra)
    assert done.returncode == 0, "\n".join(done.stderr[-40:])
    return done


def _result(run: Run) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(run.stdout)
    return result


def test_stdout_is_exactly_one_json_object(run: Run) -> None:
    text = run.stdout.strip()
    assert text.startswith("{")
    assert text.endswith("}")
    decoded, end = json.JSONDecoder().raw_decode(text)
    assert isinstance(decoded, dict)
    assert end == len(text)
    assert not any(line.startswith(f"{run.name}: ") for line in run.stdout.splitlines())


def test_progress_lines_come_on_stderr_while_it_runs(run: Run) -> None:
    progress = [
        (at, line, running)
        for at, line, running in run.timeline
        if line.startswith(f"{run.name}: ")
    ]
    assert len(progress) >= 4, run.stderr  # what it runs, two phases at least, done
    # Printed as it goes, not at the end: lines were read while the benchmark ran.
    assert progress[0][2], run.timeline
    assert sum(running for _, _, running in progress) >= 2
    assert progress[-1][1].startswith(f"{run.name}: done in ")
    # No long silence between lines (the heartbeat repeats a long phase).
    gaps = [(b[0] - a[0], b[1]) for a, b in itertools.pairwise(progress)]
    assert max(gap for gap, _ in gaps) <= HEARTBEAT_S + 5, gaps


def test_the_table_prints_no_figure_the_run_did_not_measure(run: Run) -> None:
    result = _result(run)
    module = importlib.import_module(BENCHES[run.name][0])
    table = module.format_table(result)
    assert table.strip()
    assert "lmcache" not in table.lower(), table
    assert "lmcache" not in run.stdout.lower(), "the JSON carries LMCache figures"


def test_quiet_prints_no_progress(shm_dir: Path) -> None:
    done = _run("datapath", *TINY["datapath"], "--shm-dir", str(shm_dir), "--quiet")
    assert done.returncode == 0, done.stderr
    assert not [line for line in done.stderr if line.startswith("datapath: ")]
    assert isinstance(json.loads(done.stdout), dict)


def test_bench_vllm_reports_progress_and_no_lmcache_figure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``kvmesh bench vllm`` with its vLLM processes faked (real vLLM takes minutes)."""
    vllm_bench = importlib.import_module("kvmesh.bench.vllm")
    calls: list[int] = []

    limits: list[float] = []

    specs: list[dict[str, Any]] = []

    def fake_engine(spec: dict[str, Any], *, timeout_s: float) -> list[dict[str, Any]]:
        calls.append(len(spec["prompts"]))
        specs.append(spec)
        limits.append(timeout_s)
        ttft = 0.3 if "gateway" not in spec else 0.05 * len(calls)
        # With kvmesh switched off for a request, the miss process's run takes 0.1 s; in
        # the warm process each prompt's second run (vLLM's own hit) takes 0.1 s.
        off = spec.get("kv_transfer_params") or [None] * len(spec["prompts"])
        own_hit = "gateway" in spec and spec.get("prefix_caching")
        return [
            {
                "ttft_s": 0.1 if params or (own_hit and i > 0 and i % 2 == 0) else ttft,
                "cached_tokens": 512,
                "token_ids": [7],
            }
            for i, params in enumerate(off)
        ]

    monkeypatch.setattr(vllm_bench, "run_engine", fake_engine)
    monkeypatch.setattr(vllm_bench, "make_tiny_model", lambda path: tmp_path / "model")
    monkeypatch.setattr(vllm_bench.importlib.util, "find_spec", lambda name: object())
    args = bench_parser("vllm", vllm_bench).parse_args(
        ["--prompts", "2", "--prompt-tokens", "600", "--gap-s", "0", "--gateway", "lane:/nowhere",
         "--engine-timeout-s", "42"]
    )  # fmt: skip
    assert isinstance(args, argparse.Namespace)
    result = vllm_bench.run(args)
    assert limits == [42.0] * 4  # every engine runs under the limit asked for
    assert result["parameters"]["engine_timeout_s"] == 42.0
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if line.startswith("vllm: ")]
    assert any("round 1/1: cold" in line for line in lines), lines
    assert any("round 1/1: warm" in line for line in lines), lines
    assert lines[-1].startswith("vllm: done in ")
    assert len(calls) == 4
    # The miss process runs each prompt as a miss and with kvmesh off, alternating which
    # goes first; the warm process runs each twice with vLLM's prefix caching on.
    off = vllm_bench.KVMESH_OFF
    miss, warm = specs[2], specs[3]
    assert miss["kv_transfer_params"] == [None, None, off, off, None]
    assert miss["prompts"][1] == miss["prompts"][2] != miss["prompts"][3] == miss["prompts"][4]
    assert warm["prefix_caching"] is True
    assert len(warm["prompts"]) == 5
    assert result["miss_cost_fraction_same_process"] == 0.5  # 0.15 s over 0.1 s
    assert result["warm_over_prefix_cache_same_process"] == 2.0  # 0.2 s over 0.1 s
    table = vllm_bench.format_table(result)
    assert "lmcache" not in table.lower(), table
    assert "lmcache" not in json.dumps(result).lower()


@pytest.mark.parametrize("limit", ["0", "-5", "nan"])
def test_bench_vllm_refuses_an_engine_limit_that_is_not_positive(
    monkeypatch: pytest.MonkeyPatch, limit: str
) -> None:
    vllm_bench = importlib.import_module("kvmesh.bench.vllm")
    monkeypatch.setattr(vllm_bench.importlib.util, "find_spec", lambda name: object())
    args = bench_parser("vllm", vllm_bench).parse_args(["--engine-timeout-s", limit])
    with pytest.raises(SystemExit, match="--engine-timeout-s must be positive"):
        vllm_bench.run(args)
