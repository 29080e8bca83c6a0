"""Fleet files: one per ``kvmesh up``, the newest live one picked, stale ones ignored.

Real processes stand in for ``kvmesh up`` (a ``sleep`` whose pid a file records);
a fleet that failed to start keeps the log its error names.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.cli import fleetfile
from tests.support.harness import REPO_ROOT


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv(fleetfile.FLEET_FILE_ENV, raising=False)
    monkeypatch.setenv(fleetfile.FLEET_DIR_ENV, str(tmp_path / "fleets"))
    return tmp_path / "fleets"


@pytest.fixture
def ups() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Live processes standing in for kvmesh up."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def _fleet(
    ups: list[subprocess.Popen[bytes]], tmp_path: Path, started: float, *, alive: bool = True
) -> Path:
    proc = subprocess.Popen(["sleep", "60"])
    ups.append(proc)
    shm_dir = tmp_path / f"shm-{proc.pid}"
    shm_dir.mkdir()
    path = fleetfile.default_path(proc.pid)
    record = {"pid": proc.pid, "started": started, "coordinator": f"c-{proc.pid}", "nodes": []}
    fleetfile.write(path, {**record, "shm_dir": str(shm_dir)})
    if not alive:
        proc.kill()
        proc.wait()
    return path


def test_each_up_has_a_file_of_its_own_and_the_newest_is_picked(
    registry: Path, tmp_path: Path, ups: list[subprocess.Popen[bytes]]
) -> None:
    older = _fleet(ups, tmp_path, started=100.0)
    newer = _fleet(ups, tmp_path, started=200.0)
    assert older != newer
    assert older.parent == newer.parent == registry

    running = fleetfile.find()
    assert running is not None
    assert running.path == newer
    assert running.others == [older]
    note = running.note()
    assert note is not None
    assert "2 fleets are running" in note
    assert str(older) in note
    assert fleetfile.FLEET_FILE_ENV in note

    # The first fleet stopping removes its own file only; the other is then alone.
    fleetfile.remove(older, ups[0].pid)
    fleetfile.remove(newer, ups[0].pid)  # not its file: kept
    running = fleetfile.find()
    assert running is not None
    assert running.path == newer
    assert running.note() is None


def test_stale_files_are_ignored_and_removed(
    registry: Path, tmp_path: Path, ups: list[subprocess.Popen[bytes]]
) -> None:
    dead = _fleet(ups, tmp_path, started=300.0, alive=False)
    live = _fleet(ups, tmp_path, started=100.0)
    # A live pid that is not a fleet any more (a reused pid): its shm dir is gone.
    reused = _fleet(ups, tmp_path, started=400.0)
    (tmp_path / f"shm-{ups[-1].pid}").rmdir()

    running = fleetfile.find()
    assert running is not None
    assert running.path == live
    assert running.others == []
    assert not dead.exists()
    assert not reused.exists()


def test_no_live_fleet_is_none_and_says_where_it_looked(registry: Path, tmp_path: Path) -> None:
    assert fleetfile.find() is None
    assert str(registry) in fleetfile.describe(None)


def test_an_explicit_fleet_file_wins_over_the_registry(
    registry: Path,
    tmp_path: Path,
    ups: list[subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fleet(ups, tmp_path, started=500.0)
    chosen = tmp_path / "mine.json"
    fleetfile.write(chosen, {"pid": os.getpid(), "started": 1.0, "coordinator": "mine"})
    monkeypatch.setenv(fleetfile.FLEET_FILE_ENV, str(chosen))
    running = fleetfile.find()
    assert running is not None
    assert running.path == chosen
    assert running.data["coordinator"] == "mine"


def test_a_fleet_that_failed_to_start_keeps_the_log_its_error_names(tmp_path: Path) -> None:
    env = dict(os.environ, KVMESH_FLEET_DIR=str(tmp_path / "fleets"))
    env.pop(fleetfile.FLEET_FILE_ENV, None)
    # 203.0.113.0/24 is reserved for documentation: no host has it, so binding fails.
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "up", "--host", "203.0.113.1", "--l1-size", "16MiB"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    found = re.search(r"\(log: (\S+)\)", done.stderr)
    assert found, done.stderr
    log = Path(found.group(1))
    try:
        assert log.is_file(), f"{log} was deleted"
        assert "cannot listen on 203.0.113.1" in log.read_text()
        # Nothing else of the failed fleet is left; no fleet file was written.
        assert [p.name for p in log.parent.parent.iterdir()] == ["logs"]
        assert not list((tmp_path / "fleets").glob("*.json"))
    finally:
        shutil.rmtree(log.parent.parent, ignore_errors=True)


def test_demo_ignores_a_fleet_whose_gateway_does_not_answer(
    registry: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvmesh.cli.demo import _running_gateway
    from tests.support.ports import free_port

    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    gateway = f"127.0.0.1:{free_port()}"  # nothing listens there
    path = fleetfile.default_path(os.getpid())
    fleetfile.write(
        path,
        {"pid": os.getpid(), "shm_dir": str(shm_dir), "nodes": [{"name": "n", "gateway": gateway}]},
    )
    assert _running_gateway() is None
    err = capsys.readouterr().err
    assert f"ignoring {path}: its gateway {gateway} does not answer" in err
    assert "starting a fleet of its own" in err
