"""``realtime_priority``: a real ``kvmesh node`` runs its event loop and copy threads in real time.

Only those threads: gRPC's own threads and the node's background threads,
started by the loop's thread after it went real time, run under the default
policy (``SCHED_RESET_ON_FORK``). The data path works as before. A process
that may not use ``SCHED_FIFO`` (here: root without ``CAP_SYS_NICE``, made
with ``setpriv``) refuses to start with one line that names what it lacks,
and leaves nothing in shared memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.storage.conftest import ShmDirs
from tests.integration.storage.support import (
    Engine,
    chunk_blocks,
    new_hashes,
    row,
    store_and_read_back,
)
from tests.support.harness import REPO_ROOT
from tests.support.waiting import wait_until

PRIORITY = 7
SCHED_OTHER, SCHED_FIFO = 0, 1
#: Threads gRPC's core starts (their names as /proc shows them).
GRPC_THREADS = ("event_engine", "grpc_global_tim", "lifeguard")


def _threads(pid: int) -> list[tuple[int, str, int, int]]:
    """(tid, name, policy, real-time priority) of each thread of ``pid``, from /proc."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on
        out.append((int(task.name), name, int(fields[38]), int(fields[37])))
    return out


def _node_command(shm_dirs: ShmDirs, tmp_path: Path, ready: Path) -> list[str]:
    return [
        sys.executable, "-m", "kvmesh.cli", "node", "--port", "0", "--metrics-port", "-1",
        "--shm-dir", str(shm_dirs.l1), "--allowed-memory-dir", str(shm_dirs.engine),
        "--l1-size-bytes", "8MiB", "--l2", "none", "--ready-file", str(ready),
        "--data-dir", str(tmp_path / "data"), "--realtime-priority", str(PRIORITY),
    ]  # fmt: skip


def _require_setpriv() -> str:
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        reason = "needs root and setpriv (util-linux) to run a node with and without CAP_SYS_NICE"
        if os.environ.get("KVMESH_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{reason} (KVMESH_REQUIRE_SERVICES=1 requires it)", pytrace=False)
        pytest.skip(reason)
    return setpriv


def test_a_realtime_node_runs_only_its_loop_and_copy_threads_in_real_time(
    shm_dirs: ShmDirs, tmp_path: Path
) -> None:
    _require_setpriv()
    ready = tmp_path / "ready.json"
    log = tmp_path / "node.log"
    engine = Engine(shm_dirs.engine, "engine-realtime")
    keys = row(new_hashes(4))
    blocks = [b for i in range(4) for b in chunk_blocks(i)]
    before = engine.blocks_bytes(blocks)
    with log.open("w") as out:
        process = subprocess.Popen(
            _node_command(shm_dirs, tmp_path, ready),
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    try:
        wait_until(lambda: ready.exists() or process.poll() is not None, timeout=60)
        assert process.poll() is None, log.read_text()[-3000:]
        address = json.loads(ready.read_text())["grpc"]
        main = {t[0]: t for t in _threads(process.pid)}[process.pid]
        assert main[2:] == (SCHED_FIFO, PRIORITY)  # the event loop's thread

        assert asyncio.run(store_and_read_back(address, engine, keys, blocks)) == before
        threads = _threads(process.pid)
        realtime = [t for t in threads if t[2] == SCHED_FIFO]
        # The loop, and at least one thread of the stores and one of the loads.
        assert len(realtime) >= 3, threads
        assert {t[3] for t in realtime} == {PRIORITY}
        grpc_threads = [t for t in threads if t[1].startswith(GRPC_THREADS)]
        assert grpc_threads, threads
        assert {t[2] for t in grpc_threads} == {SCHED_OTHER}
        # Besides gRPC's, the node's background threads (eviction, ...) are not real time.
        others = [t for t in threads if t[2] == SCHED_OTHER and t not in grpc_threads]
        assert others, threads
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        engine.close()
    assert process.returncode == 0, log.read_text()[-3000:]


def test_a_node_that_may_not_run_in_real_time_refuses_to_start(
    shm_dirs: ShmDirs, tmp_path: Path
) -> None:
    setpriv = _require_setpriv()
    ready = tmp_path / "ready.json"
    done = subprocess.run(
        [setpriv, "--bounding-set", "-sys_nice", *_node_command(shm_dirs, tmp_path, ready)],
        check=False,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for words in (f"realtime_priority {PRIORITY}", "CAP_SYS_NICE", "realtime_priority 0"):
        assert words in lines[0]
    assert "Traceback" not in done.stderr
    assert not ready.exists()
    assert list(shm_dirs.l1.iterdir()) == []
