"""Nothing of a local fleet outlives it: the fleet lock, the reaper, and reclaiming at start.

A fleet (``kvmesh up``, ``kvmesh demo``) keeps its shared memory — L1
segments, lane sockets — in a private directory ``/dev/shm/kvmesh-fleet-*``
and its logs and checkpoints in a data directory. Three things make sure
these go away with the fleet, however it ends:

* **The fleet lock.** ``fleet.lock`` in the shared-memory directory is
  ``flock``-ed by the ``up`` process and inherited by every child (the same
  open file), so it is held exactly as long as any process of the fleet
  lives — the kernel drops it when the last one dies, SIGKILL included. It
  also records the owner's pid and what to remove.
* **The reaper.** A small process (``python -m kvmesh.cli.reaper``) in a
  session of its own, so a closed terminal's SIGHUP and a Ctrl-C do not reach
  it. When ``up`` dies without stopping its fleet (SIGKILL), its children
  stop on their own (parent-death signal, see kvmesh.cli.startup); the
  reaper waits for the lock to fall free (SIGKILLing stragglers after a
  bound), then removes the directories and the fleet file, and exits. A fleet
  that stops normally ends its reaper itself.
* **Reclaiming at start.** Every ``up``/``demo`` first removes the
  directories of fleets whose lock it can take: their owners are all dead
  (a reaper that was killed too, a machine that lost power). Live fleets are
  never touched: the decision is the lock's, not the name's.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmesh.common.procs import pid_alive

LOCK_NAME = "fleet.lock"
PIDS_NAME = "fleet.pids"
SHM_ROOT = Path("/dev/shm")
DIR_PREFIX = "kvmesh-fleet-"
#: How long the reaper lets the children of a dead ``up`` stop on their own.
STRAGGLER_GRACE_S = 20.0


class FleetLock:
    """The lock every process of one fleet holds (module docstring)."""

    def __init__(self, shm_dir: Path, owner: dict[str, Any]) -> None:
        # Locked under a temporary name, then renamed: a reclaimer never sees an
        # unlocked fleet.lock of a fleet that is starting.
        tmp = shm_dir / f".{LOCK_NAME}.{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, json.dumps(owner).encode())
            os.replace(tmp, shm_dir / LOCK_NAME)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd

    def release(self) -> None:
        """Close this process's hold (children keep theirs until they exit)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _owner(lock_path: Path) -> dict[str, Any] | None:
    """The owner record of a fleet whose lock is free (all its processes dead), else None."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return None  # held: some process of that fleet is alive
        try:
            data = json.loads(os.pread(fd, 65536, 0) or b"{}")
        except ValueError:
            data = {}
        return data if isinstance(data, dict) else {}
    finally:
        os.close(fd)


def remove_fleet_files(shm_dir: Path, owner: dict[str, Any]) -> None:
    """Remove a dead fleet's shared-memory dir, its own data dir and its fleet file."""
    shutil.rmtree(shm_dir, ignore_errors=True)
    data_dir = owner.get("data_dir")
    if owner.get("owns_data_dir") and data_dir and Path(data_dir).name.startswith(DIR_PREFIX):
        shutil.rmtree(data_dir, ignore_errors=True)
    fleet_file = owner.get("fleet_file")
    if fleet_file:
        with contextlib.suppress(OSError, ValueError):
            recorded = json.loads(Path(fleet_file).read_text())
            if recorded.get("shm_dir") == str(shm_dir):
                Path(fleet_file).unlink()


def reclaim_abandoned(shm_root: Path = SHM_ROOT) -> list[Path]:
    """Remove what fleets with no live process left behind; returns their shm dirs."""
    removed = []
    with contextlib.suppress(OSError):
        for shm_dir in sorted(shm_root.glob(DIR_PREFIX + "*")):
            owner = _owner(shm_dir / LOCK_NAME)
            if owner is None:
                continue
            remove_fleet_files(shm_dir, owner)
            removed.append(shm_dir)
    return removed


def _ours(pid: int) -> bool:
    """Whether ``pid`` still runs kvmesh (not a new process that reused the number)."""
    try:
        return b"kvmesh" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def spawn_reaper(parent: int, shm_dir: Path) -> int:
    """Start the reaper of the fleet in ``shm_dir``; returns its pid."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "KVMESH_PARENT_PID"}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli.reaper", "--parent", str(parent), str(shm_dir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    return process.pid


def stop_reaper(pid: int) -> None:
    """End a reaper this process started (its fleet stopped and cleaned up itself)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def reap(parent: int, shm_dir: Path, poll_s: float = 0.2) -> None:
    """Wait for ``parent`` to die, then for its fleet to stop, then remove what it left."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lock_path = shm_dir / LOCK_NAME
    while pid_alive(parent) and os.getppid() == parent:
        if not shm_dir.exists():
            return  # the fleet stopped and cleaned up itself
        time.sleep(poll_s)
    deadline = time.monotonic() + STRAGGLER_GRACE_S
    killed = False
    while lock_path.exists():
        owner = _owner(lock_path)
        if owner is not None:
            remove_fleet_files(shm_dir, owner)
            return
        if time.monotonic() > deadline and not killed:
            killed = True
            with contextlib.suppress(OSError, ValueError):
                for pid in json.loads((shm_dir / PIDS_NAME).read_text()):
                    if pid_alive(pid) and _ours(pid):
                        os.kill(pid, signal.SIGKILL)
        elif killed and time.monotonic() > deadline + STRAGGLER_GRACE_S:
            return  # something else holds the lock; leave it to the next start's reclaim
        time.sleep(poll_s)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvmesh.cli.reaper --parent PID SHM_DIR``."""
    parser = argparse.ArgumentParser(prog="kvmesh-reaper", description=__doc__)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("shm_dir", type=Path)
    args = parser.parse_args(argv)
    reap(args.parent, args.shm_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
