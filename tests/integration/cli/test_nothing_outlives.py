"""Nothing outlives its parent: a killed or hung-up ``kvmesh up`` leaves no process, no file.

``kvmesh up`` runs as an operator runs it; it is then killed with SIGKILL
(nothing of it runs again) or sent SIGHUP (its terminal closed). Within a
bound, every process it started (services and reaper) must be gone, and its
shared-memory directory, its data directory and its fleet file removed.
Also: a service stops cleanly on SIGHUP as on SIGTERM, and what a killed
process left in shared memory is reclaimed at the next start, by the
liveness of its owner (the lock it held), never by its name alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from kvmesh.cli.reaper import LOCK_NAME, FleetLock, reclaim_abandoned
from kvmesh.storage.core.l1.pool import reclaim_dead_pools
from tests.support.harness import REPO_ROOT
from tests.support.processes import alive
from tests.support.waiting import wait_until

BOUND_S = 60.0


def _start_up(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], dict[str, object]]:
    fleet_file = tmp_path / "fleet.json"
    env = dict(os.environ, KVMESH_FLEET_FILE=str(fleet_file))
    process = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "up", "--l1-size", "16MiB", *extra],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(
            lambda: fleet_file.exists() or process.poll() is not None,
            timeout=BOUND_S,
            message="kvmesh up wrote no fleet file",
        )
        assert process.poll() is None, f"kvmesh up exited with {process.returncode}"
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process, json.loads(fleet_file.read_text())


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_killed_or_hung_up_fleet_leaves_nothing(tmp_path: Path, sig: signal.Signals) -> None:
    process, fleet = _start_up(tmp_path)
    services = fleet["services"]
    assert isinstance(services, list)
    pids = [int(s["pid"]) for s in services]
    reaper = int(str(fleet["reaper_pid"]))
    shm_dir = Path(str(fleet["shm_dir"]))
    data_dir = Path(str(fleet["data_dir"]))
    assert len(pids) == 3
    assert all(alive(pid) for pid in [*pids, reaper])
    assert shm_dir.is_dir()
    assert any(p.name.startswith("kvmesh-l1-") for p in shm_dir.iterdir())
    assert data_dir.is_dir()

    process.send_signal(sig)
    status = process.wait(timeout=BOUND_S)
    assert status == (-signal.SIGKILL if sig == signal.SIGKILL else 0)

    def everything_gone() -> bool:
        return (
            not any(alive(pid) for pid in [*pids, reaper])
            and not shm_dir.exists()
            and not data_dir.exists()
            and not (tmp_path / "fleet.json").exists()
        )

    wait_until(
        everything_gone,
        timeout=BOUND_S,
        message=f"left behind after {sig.name}: "
        f"processes {[p for p in [*pids, reaper] if alive(p)]}, "
        f"shm {shm_dir.exists()}, data {data_dir.exists()}, "
        f"fleet file {(tmp_path / 'fleet.json').exists()}",
    )


def _reapers_of(shm_dir: Path) -> list[int]:
    """Pids of reaper processes watching ``shm_dir``."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"kvmesh.cli.reaper" in cmdline and str(shm_dir).encode() in cmdline:
                found.append(int(proc.name))
    return found


def test_killed_demo_leaves_nothing(tmp_path: Path) -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "demo", "--own-fleet", "--no-progress",
         "--l1-size", "64MiB", "--prompt-tokens", "16384"],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:

        def engine_running() -> Path | None:
            for shm_dir in Path("/dev/shm").glob(f"kvmesh-fleet-{demo.pid}-*"):
                if any(p.name.startswith("kvmesh-engine-") for p in shm_dir.iterdir()):
                    return shm_dir
            assert demo.poll() is None, f"kvmesh demo exited with {demo.returncode}"
            return None

        shm_dir = wait_until(engine_running, timeout=BOUND_S * 2)
        pids = json.loads((shm_dir / "fleet.pids").read_text())
        reapers = _reapers_of(shm_dir)
        data_dirs = list(Path(tempfile.gettempdir()).glob(f"kvmesh-fleet-{demo.pid}-*"))
        assert len(pids) == 3
        assert len(reapers) == 1
        assert len(data_dirs) == 1
    finally:
        demo.kill()
        demo.wait()

    def everything_gone() -> bool:
        return not any(alive(pid) for pid in [*pids, *reapers]) and not any(
            p.exists() for p in [shm_dir, *data_dirs]
        )

    wait_until(everything_gone, timeout=BOUND_S, message="kvmesh demo's fleet outlived it")


def test_storage_stops_cleanly_on_sighup(tmp_path: Path) -> None:
    shm_dir = Path("/dev/shm") / f"kvmesh-test-hup-{uuid.uuid4().hex[:10]}"
    ready = tmp_path / "ready.json"
    lane = shm_dir / "storage.lane"
    process = subprocess.Popen(
        [
            sys.executable, "-m", "kvmesh.cli", "storage",
            "--port", "0", "--metrics-port", "-1",
            "--instance-id", f"hup-{uuid.uuid4().hex[:8]}",
            "--data-dir", str(tmp_path / "data"),
            "--shm-dir", str(shm_dir), "--l1-size-bytes", "8MiB",
            "--lane-socket", str(lane), "--ready-file", str(ready),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: ready.exists() or process.poll() is not None, timeout=BOUND_S)
        assert process.poll() is None
        assert any(p.name.startswith("kvmesh-l1-") for p in shm_dir.iterdir())
        process.send_signal(signal.SIGHUP)
        _, stderr = process.communicate(timeout=BOUND_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert "storage stopped" in stderr
    assert not ready.exists()
    assert sorted(p.name for p in shm_dir.iterdir()) == []
    shm_dir.rmdir()


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    kind, where = sys.argv[1], sys.argv[2]
    if kind == "pool":
        from kvmesh.storage.core.l1.pool import L1Pool
        pool = L1Pool(sys.argv[3], 1 << 20, segment_bytes=1 << 20, shm_dir=where)
    else:
        from kvmesh.cli.reaper import FleetLock
        lock = FleetLock(Path(where), {"pid": 0, "data_dir": sys.argv[3], "owns_data_dir": True})
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _holder(*args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


def test_l1_segments_of_a_killed_node_are_reclaimed_by_owner_liveness() -> None:
    shm_dir = Path("/dev/shm") / f"kvmesh-test-reclaim-{uuid.uuid4().hex[:10]}"
    shm_dir.mkdir()
    dead = _holder("pool", str(shm_dir), "dead-node")
    live = _holder("pool", str(shm_dir), "live-node")
    try:
        dead.kill()
        dead.wait()
        names = sorted(p.name for p in shm_dir.iterdir())
        assert names == [
            "kvmesh-l1-dead-node-0",
            "kvmesh-l1-dead-node.lock",
            "kvmesh-l1-live-node-0",
            "kvmesh-l1-live-node.lock",
        ]
        removed = reclaim_dead_pools(str(shm_dir))
        assert sorted(Path(p).name for p in removed) == [
            "kvmesh-l1-dead-node-0",
            "kvmesh-l1-dead-node.lock",
        ]
        # The live node's memory is untouched: its owner holds the lock.
        assert sorted(p.name for p in shm_dir.iterdir()) == [
            "kvmesh-l1-live-node-0",
            "kvmesh-l1-live-node.lock",
        ]
        assert (shm_dir / "kvmesh-l1-live-node.lock").read_text().strip() == str(live.pid)
    finally:
        live.kill()
        live.wait()
        for path in shm_dir.iterdir():
            path.unlink()
        shm_dir.rmdir()


def test_abandoned_fleet_directories_are_reclaimed_by_owner_liveness(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    root.mkdir()
    dirs = {name: root / f"kvmesh-fleet-{name}" for name in ("dead", "live", "starting")}
    data = {name: tmp_path / f"kvmesh-fleet-data-{name}" for name in dirs}
    for name, path in dirs.items():
        path.mkdir()
        data[name].mkdir()
    dead = _holder("lock", str(dirs["dead"]), str(data["dead"]))
    live = _holder("lock", str(dirs["live"]), str(data["live"]))
    try:
        dead.kill()
        dead.wait()
        # A fleet that has no lock yet is never taken for a dead one.
        assert reclaim_abandoned(root) == [dirs["dead"]]
        assert not dirs["dead"].exists()
        assert not data["dead"].exists()
        assert dirs["live"].exists()
        assert (dirs["live"] / LOCK_NAME).exists()
        assert data["live"].exists()
        assert dirs["starting"].exists()
        # This process cannot take a live fleet's lock either.
        assert reclaim_abandoned(root) == []
    finally:
        live.kill()
        live.wait()
    assert reclaim_abandoned(root) == [dirs["live"]]
    assert not data["live"].exists()


def test_fleet_lock_is_held_by_every_process_sharing_it(tmp_path: Path) -> None:
    fleet_dir = tmp_path / "kvmesh-fleet-shared"
    fleet_dir.mkdir()
    lock = FleetLock(fleet_dir, {"pid": os.getpid()})
    assert lock.fd is not None
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(lock.fd,)
    )
    try:
        lock.release()
        # The child still holds it (the same open file): the fleet is alive.
        assert reclaim_abandoned(tmp_path) == []
        assert (fleet_dir / LOCK_NAME).exists()
    finally:
        child.kill()
        child.wait()
    assert reclaim_abandoned(tmp_path) == [fleet_dir]
