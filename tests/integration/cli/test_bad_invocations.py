"""Every mistake an operator makes on the command line is one line and exit 2.

A table of bad invocations, each a real ``python -m kvmesh.cli`` process.
Each row checks: exit status 2, exactly one line on stderr naming the
problem, no traceback, nothing new in shared memory under the names that
process could create (its own ``--shm-dir``, its instance's ``kvmesh-l1-*``
files, its ``kvmesh-fleet-<pid>-*`` directories), and — for the rows aimed
at a running storage node — that node's state unchanged.

Missing optional packages (redis, boto3, nats) are simulated with a
``sitecustomize`` on PYTHONPATH whose import hook refuses them, exactly as
an interpreter without them would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.cli.main import BENCHES
from kvmesh.storage.client import StorageClient
from tests.support.harness import REPO_ROOT
from tests.support.waiting import wait_until

SHM = Path("/dev/shm")
RUN = uuid.uuid4().hex[:10]
HUGE = "1000TB"  # more than any /dev/shm here
NOT_UTF8 = "@not-utf8-file"

BLOCKER = """\
import os, sys
_BLOCKED = set(filter(None, os.environ.get("KVMESH_TEST_BLOCK", "").split(",")))
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Block())
"""


@dataclass
class Running:
    """A storage node the 'beside a running one' rows aim at."""

    process: subprocess.Popen[bytes]
    instance_id: str
    data_dir: Path
    shm_dir: Path
    port: int

    def state(self) -> dict[str, object]:
        files = {
            p.name: (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(self.shm_dir.iterdir())
        }

        async def ask() -> tuple[str, int]:
            client = StorageClient(f"127.0.0.1:{self.port}")
            try:
                resp = await client.get_status(storage_pb2.GetStatusRequest(), timeout=10)
            finally:
                await client.close()
            return resp.instance_id, resp.incarnation

        return {
            "alive": self.process.poll() is None,
            "incarnation_file": (self.data_dir / "incarnation").read_text(),
            "shm_files": files,
            "answers": asyncio.run(ask()),
        }


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    base = tmp_path_factory.mktemp("running")
    instance = f"bad-inv-running-{RUN}"
    shm_dir = SHM / f"kvmesh-test-{RUN}-running"
    ready = base / "ready.json"
    process = subprocess.Popen(
        [
            sys.executable, "-m", "kvmesh.cli", "storage",
            "--port", "0", "--metrics-port", "-1",
            "--instance-id", instance,
            "--data-dir", str(base / "data"),
            "--shm-dir", str(shm_dir),
            "--l1-size-bytes", "8MiB",
            "--ready-file", str(ready),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: ready.exists() or process.poll() is not None, timeout=60)
        assert process.poll() is None, "the running storage node did not start"
        import json

        port = int(json.loads(ready.read_text())["grpc"].rsplit(":", 1)[1])
        yield Running(process, instance, base / "data", shm_dir, port)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        assert not shm_dir.exists() or not any(shm_dir.iterdir())
        if shm_dir.exists():
            shm_dir.rmdir()


@dataclass
class Row:
    """One bad invocation and the words its one line must contain."""

    id: str
    args: list[str]
    expect: list[str]
    env: dict[str, str] = field(default_factory=dict)
    block: str = ""  # optional packages to hide
    beside_running: bool = False


def _storage(*args: str) -> list[str]:
    """``kvmesh storage`` with this test's own names (so its leftovers can be looked for)."""
    return [
        "storage", "--port", "0", "--metrics-port", "-1",
        "--instance-id", f"bad-inv-{RUN}",
        "--shm-dir", str(SHM / f"kvmesh-test-{RUN}-row"),
        "--l1-size-bytes", "8MiB",
        *args,
    ]  # fmt: skip


ROWS = [
    Row(
        "l2-unknown-type",
        _storage("--l2", '{"type": "memcached"}'),
        ["unknown L2 adapter type 'memcached'", "disk, memory", "shorthand: disk, none"],
    ),
    Row("l2-not-json", _storage("--l2", "dsik"), ["'dsik'", "shorthand (disk, none)"]),
    Row(
        "l2-unknown-field",
        _storage("--l2", '{"type": "disk", "base_path": "/tmp/x", "sizee": 1}'),
        ["l2[0].sizee", "unknown field"],
    ),
    Row(
        "l2-redis-extra-missing",
        _storage("--l2", '{"type": "redis", "url": "redis://127.0.0.1:6379"}'),
        ["'redis'", "pip install 'kvmesh[redis]'"],
        block="redis",
    ),
    Row(
        "l2-s3-extra-missing",
        _storage("--l2", '{"type": "s3", "bucket": "kv"}'),
        ["'boto3'", "pip install 'kvmesh[s3]'"],
        block="boto3",
    ),
    Row(
        "storage-nats-extra-missing",
        _storage("--event-transport", "nats"),
        ["'nats'", "pip install 'kvmesh[nats]'"],
        block="nats",
    ),
    Row(
        "coordinator-nats-extra-missing",
        ["coordinator", "--port", "0", "--nats-url", "nats://127.0.0.1:4222"],
        ["pip install 'kvmesh[nats]'"],
        block="nats",
    ),
    # The base install has no torch: what needs it names the extra.
    *(
        Row(
            f"{name}-torch-missing",
            args,
            ["needs the Python package 'torch'", "pip install 'kvmesh[storage]'", "whl/cpu"],
            block="torch",
        )
        for name, args in (
            ("storage", _storage()),
            ("node", ["node", *_storage()[1:]]),
            ("up", ["up"]),
            ("demo", ["demo", "--no-progress"]),
            ("bench", ["bench", "datapath"]),
        )
    ),
    Row(
        "log-level",
        _storage("--log-level", "verbose"),
        ["'verbose'", "DEBUG, INFO, WARNING, ERROR, CRITICAL"],
    ),
    Row(
        "env-var-names-itself",
        ["coordinator"],
        ["KVMESH_COORDINATOR_PORT", "'abc'", "integer"],
        env={"KVMESH_COORDINATOR_PORT": "abc"},
    ),
    Row(
        "env-size",
        _storage(),
        ["KVMESH_STORAGE_L1_SEGMENT_BYTES", "not a size"],
        env={"KVMESH_STORAGE_L1_SEGMENT_BYTES": "lots"},
    ),
    Row("flag-not-int", ["gateway", "--port", "x"], ["--port", "'x'", "integer"]),
    Row("port-range", _storage("--port", "70000"), ["port must be in [0, 65535]"]),
    Row(
        "realtime-priority-range",
        ["node", *_storage("--realtime-priority", "100")[1:]],
        ["realtime_priority must be 0 (off) or 1..99"],
    ),
    Row(
        "l1-larger-than-shm",
        _storage("--l1-size-bytes", HUGE),
        ["l1_size_bytes", "free space of"],
    ),
    Row(
        "node-l1-larger-than-shm",
        ["node", *_storage("--l1-size-bytes", HUGE)[1:]],
        ["l1_size_bytes", "free space of"],
    ),
    Row("config-missing", _storage("--config", "/nonexistent/kvmesh.yaml"), ["cannot read"]),
    # NOT_UTF8 stands for a file written in Latin-1 (a config saved by an old editor).
    *(
        Row(
            f"{command}-config-not-utf8",
            [command, "--config", NOT_UTF8, *extra],
            ["is not UTF-8 text: byte 0xe9 at line 2, column 9"],
        )
        for command, extra in (
            ("storage", ["--port", "0"]),
            ("node", ["--port", "0"]),
            ("gateway", ["--port", "0"]),
            ("coordinator", ["--port", "0"]),
            ("up", []),
        )
    ),
    Row("traces-not-utf8", ["traces", NOT_UTF8], ["trace file", "is not UTF-8 text"]),
    Row(
        "data-dir-unusable",
        _storage("--data-dir", "/proc/kvmesh-cannot-be-here"),
        ["/proc/kvmesh-cannot-be-here"],
    ),
    Row(
        "coordinator-checkpoint-uncreatable",
        ["coordinator", "--port", "0", "--checkpoint-path", "/proc/kvmesh-nope/cp.bin"],
        ["checkpoint_path /proc/kvmesh-nope/cp.bin", "cannot create it"],
    ),
    Row(
        "coordinator-engine-events-without-model",
        ["coordinator", "--port", "0", "--engine-events", "e1=tcp://127.0.0.1:5557"],
        ["engine 'e1'", "model=NAME is required"],
    ),
    Row(
        "coordinator-engine-events-bad-endpoint",
        ["coordinator", "--port", "0", "--engine-events", "e1=http://h:1,model=m"],
        ["endpoint 'http://h:1' is not a ZMQ endpoint"],
    ),
    Row(
        "coordinator-score-weights-negative",
        ["coordinator", "--port", "0", "--score-weights", "l2=-1"],
        ["weight l2 must be a finite number >= 0"],
    ),
    Row(
        "coordinator-blend-probe-stride-zero",
        ["coordinator", "--port", "0", "--blend-probe-stride", "0"],
        ["blend_probe_stride must be >= 1"],
    ),
    Row(
        "coordinator-publish-endpoint-in-use",
        ["coordinator", "--port", "0", "--publish-events-endpoint", "tcp://256.0.0.1:5"],
        ["tcp://256.0.0.1:5"],
    ),
    Row(
        "gateway-socket-dir-missing",
        ["gateway", "--unix-socket", "/nonexistent-kvmesh/g.sock"],
        ["cannot listen on unix:/nonexistent-kvmesh/g.sock", "no directory /nonexistent-kvmesh"],
    ),
    Row(
        "shm-dir-uncreatable",
        _storage("--shm-dir", "/proc/kvmesh-nope"),
        ["shm_dir /proc/kvmesh-nope", "cannot create it"],
    ),
    Row(
        "gateway-check-period",
        ["gateway", "--port", "0", "--storage-check-seconds", "0"],
        ["storage_check_seconds must be > 0"],
    ),
    Row("unknown-flag", ["storage", "--l1-sise", "1GiB"], ["unrecognized arguments"]),
    Row("bench-unknown", ["bench", "--json", "lookupp"], ["'lookupp'", "datapath"]),
    Row("bench-no-name", ["bench", "--json"], ["required: name"]),
    Row(
        "store-copy-threads",
        _storage("--store-copy-threads", "-1"),
        ["store_copy_threads must be >= 0"],
    ),
    Row(
        "bench-store-copy-threads",
        ["bench", "datapath", "--store-copy-threads", "-1"],
        ["--store-copy-threads must be >= 0"],
    ),
    Row(
        "up-bad-l2",
        ["up", "--l2", '{"type": "memcached"}'],
        ["unknown L2 adapter type 'memcached'", "disk, none"],
    ),
    Row("up-log-level", ["up", "--log-level", "verbose"], ["--log-level", "'VERBOSE'"]),
    Row("up-l1-larger-than-shm", ["up", "--l1-size", HUGE], ["free space of /dev/shm"]),
    Row("up-nodes", ["up", "--nodes", "0"], ["--nodes must be >= 1"]),
    Row(
        "second-storage-same-instance",
        [],  # filled from the running node
        ["in use by the running process", "--instance-id or --data-dir"],
        beside_running=True,
    ),
    Row(
        "second-storage-same-data-dir",
        [],
        ["in use by the running process"],
        beside_running=True,
    ),
    Row("second-storage-same-port", [], ["address in use"], beside_running=True),
]


def _beside(row: Row, run: Running, tmp: Path) -> list[str]:
    base = ["storage", "--metrics-port", "-1", "--l1-size-bytes", "8MiB"]
    if row.id == "second-storage-same-instance":
        return [*base, "--port", "0", "--instance-id", run.instance_id,
                "--data-dir", str(run.data_dir), "--shm-dir", str(run.shm_dir)]  # fmt: skip
    if row.id == "second-storage-same-data-dir":
        return [*base, "--port", "0", "--instance-id", f"bad-inv-other-{RUN}",
                "--data-dir", str(run.data_dir), "--shm-dir", str(run.shm_dir)]  # fmt: skip
    return [*base, "--port", str(run.port), "--instance-id", f"bad-inv-{RUN}",
            "--data-dir", str(tmp / "data"), "--shm-dir", str(run.shm_dir)]  # fmt: skip


def _ours_in_shm(pid: int) -> set[str]:
    """Shared-memory names a row's process could have created."""
    names = set()
    for path in SHM.iterdir():
        if path.name.startswith(
            (f"kvmesh-l1-bad-inv-{RUN}", f"kvmesh-test-{RUN}-row", f"kvmesh-fleet-{pid}-")
        ):
            names.add(path.name)
    row_dir = SHM / f"kvmesh-test-{RUN}-row"
    if row_dir.is_dir():
        names |= {f"{row_dir.name}/{p.name}" for p in row_dir.iterdir()}
    return names


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_invocation_is_one_line_and_exit_2(
    row: Row, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = dict(os.environ)
    env.pop("KVMESH_CONFIG", None)
    env.update(row.env)
    args = list(row.args)
    if NOT_UTF8 in args:
        latin1 = tmp_path / "kvmesh.yaml"
        latin1.write_bytes("storage:\n  # cach\u00e9 size\n".encode("latin-1"))
        args = [str(latin1) if a == NOT_UTF8 else a for a in args]
    if "--data-dir" not in args and args and args[0] in ("storage", "node"):
        args += ["--data-dir", str(tmp_path / "data")]
    if row.block:
        (tmp_path / "block").mkdir()
        (tmp_path / "block" / "sitecustomize.py").write_text(BLOCKER)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(tmp_path / "block"), env.get("PYTHONPATH", "")])
        )
        env["KVMESH_TEST_BLOCK"] = row.block
    run: Running | None = None
    before: dict[str, object] = {}
    if row.beside_running:
        run = request.getfixturevalue("running")
        args = _beside(row, run, tmp_path)
        before = run.state()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=120)
    lines = stderr.splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode}, stderr:\n{stderr}"
    assert "Traceback" not in stderr
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    for word in row.expect:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    # A benchmark refuses its own options as "kvmesh bench NAME: error: ".
    commands = {args[0], " ".join(args[:2]) if args[0] == "bench" and args[1] in BENCHES else ""}
    assert any(lines[0].startswith(f"kvmesh {c}: error: ") for c in commands if c), lines[0]
    assert _ours_in_shm(proc.pid) == set()
    if run is not None:
        assert run.state() == before, "the running storage node's state changed"
