"""Two ``kvmesh storage --port 0`` on one host: two instances, as ``--help`` promises.

Each gets the default id ``storage-<hostname>-<port>`` with the port it
really bound, its own state directory and its own incarnation; the second
start leaves the first one's state alone.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.storage.client import StorageClient
from tests.support.harness import REPO_ROOT
from tests.support.waiting import wait_until


def _status(address: str) -> storage_pb2.GetStatusResponse:
    async def ask() -> storage_pb2.GetStatusResponse:
        client = StorageClient(address)
        try:
            return await client.get_status(storage_pb2.GetStatusRequest(), timeout=10)
        finally:
            await client.close()

    return asyncio.run(ask())


def test_port_zero_storages_get_distinct_ids_naming_their_port(tmp_path: Path) -> None:
    shm_dir = Path("/dev/shm") / f"kvmesh-test-ids-{uuid.uuid4().hex[:10]}"
    processes: list[subprocess.Popen[bytes]] = []
    addresses = []
    try:
        for i in range(2):
            ready = tmp_path / f"ready-{i}.json"
            command = [
                sys.executable, "-m", "kvmesh.cli", "storage", "--port", "0",
                "--metrics-port", "-1", "--shm-dir", str(shm_dir),
                "--l1-size-bytes", "8MiB", "--ready-file", str(ready),
                "--data-dir", str(tmp_path / f"data-{i}"),
            ]  # fmt: skip
            process = subprocess.Popen(
                command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            processes.append(process)

            def started(ready: Path = ready, process: subprocess.Popen[bytes] = process) -> bool:
                return ready.exists() or process.poll() is not None

            wait_until(started, timeout=60)
            assert process.poll() is None, f"storage {i} did not start"
            addresses.append(json.loads(ready.read_text())["grpc"])
            if i == 0:
                first_incarnation = (tmp_path / "data-0" / "incarnation").read_text()
        statuses = [_status(a) for a in addresses]
        host = socket.gethostname()
        for address, status in zip(addresses, statuses, strict=True):
            assert status.instance_id == f"storage-{host}-{address.rsplit(':', 1)[1]}"
        assert statuses[0].instance_id != statuses[1].instance_id
        assert (tmp_path / "data-0" / "incarnation").read_text() == first_incarnation
        assert str(statuses[0].incarnation) == first_incarnation.strip()
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(timeout=60)
    assert sorted(shm_dir.iterdir()) == []
    shm_dir.rmdir()
