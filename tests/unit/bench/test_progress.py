"""The benchmarks' shared progress lines and help formatter (kvmesh.bench.common)."""

from __future__ import annotations

import argparse
import io
import time

import pytest

from kvmesh.bench.common import (
    DefaultsHelpFormatter,
    Progress,
    add_common_arguments,
    size_text,
)


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_phases_are_printed_at_once_with_the_benchmark_name() -> None:
    out = io.StringIO()
    with Progress("datapath", stream=out, every_s=60) as progress:
        progress.say("2 chunks x 32 MiB")
        progress.phase("warm-up")
        assert _lines(out) == ["datapath: 2 chunks x 32 MiB", "datapath: warm-up"]
        progress.phase("repetition 1/3")
    lines = _lines(out)
    assert lines[2] == "datapath: repetition 1/3"
    assert lines[3].startswith("datapath: done in ")
    assert len(lines) == 4


def test_a_long_phase_repeats_itself_with_its_count() -> None:
    out = io.StringIO()
    with Progress("lookup", stream=out, every_s=0.05) as progress:
        progress.phase("timed lookups", 10, "lookups")
        progress.count(4)
        deadline = time.monotonic() + 5
        while len(_lines(out)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    beats = [line for line in _lines(out) if line.startswith("lookup: timed lookups ...")]
    assert len(beats) >= 2
    assert "4/10 lookups" in beats[0]


def test_quiet_prints_nothing() -> None:
    out = io.StringIO()
    args = argparse.Namespace(quiet=True)
    progress = Progress.for_args("ingest", args)
    progress._stream = out
    with progress:
        progress.phase("streaming")
        progress.say("hello")
    assert out.getvalue() == ""
    assert not Progress.for_args("ingest", argparse.Namespace()).quiet


def test_a_failed_run_says_so() -> None:
    out = io.StringIO()
    progress = Progress("p2p", stream=out, every_s=60)

    def fail() -> None:
        with progress:
            progress.phase("starting the coordinator")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail()
    assert _lines(out)[-1].startswith("p2p: failed after ")


def test_progress_goes_to_stderr_not_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress("vllm", every_s=60) as progress:
        progress.phase("round 1/1: cold")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "vllm: round 1/1: cold" in captured.err


def test_size_text() -> None:
    assert size_text(32 << 20) == "32 MiB"
    assert size_text(1536 << 20) == "1.5 GiB"
    assert size_text(512) == "512 B"


def test_the_formatter_shows_defaults_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")
    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--chunks", type=int, default=16, help="chunks per round")
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    parser.add_argument("--window", type=int, nargs="+", default=[2, 1], help="windows")
    parser.add_argument("--rate", type=float, default=0.5, help="share in %%")
    parser.add_argument("--model", default=None, help="a model (default: a tiny one)")
    parser.add_argument("--flag", action="store_true", help="a switch")
    add_common_arguments(parser)
    text = parser.format_help()
    assert "chunks per round (default: 16)" in text
    assert text.count("(default: 0)") == 1
    assert "windows (default: 2 1)" in text
    assert "share in % (default: 0.5)" in text
    assert "a model (default: a tiny one)\n" in text
    assert "a switch\n" in text
    assert "--json" in text
    assert "--quiet" in text
