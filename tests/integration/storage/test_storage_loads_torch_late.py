"""A storage node serves without torch and loads it at the first registration.

Importing torch costs a storage process about 0.9 s of CPU at each start; a node
with no engine registered (a fleet starting, a P2P peer, an L2-only node) never
needs it. The first registration loads it on a copy thread, and the data path
then works as before. Both ways in: ``kvmesh storage`` (RegisterEngineMemory,
then a chunk stored from the engine comes back byte for byte) and ``kvmesh
node`` (the gateway's RegisterKVCache, through the in-process link).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.gateway.client import GatewayClient
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


def _maps_torch(pid: int) -> bool:
    """Whether the process has torch's C library mapped (what ``import torch`` loads)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@contextmanager
def _serving(service: str, shm_dirs: ShmDirs, tmp_path: Path) -> Iterator[tuple[int, str]]:
    """``kvmesh SERVICE`` on a free port: its pid and gRPC address; SIGTERM and exit 0 after."""
    ready = tmp_path / "ready.json"
    command = [
        sys.executable, "-m", "kvmesh.cli", service, "--port", "0", "--metrics-port", "-1",
        "--shm-dir", str(shm_dirs.l1), "--allowed-memory-dir", str(shm_dirs.engine),
        "--l1-size-bytes", "8MiB", "--l2", "none", "--ready-file", str(ready),
        "--data-dir", str(tmp_path / "data"),
    ]  # fmt: skip
    log = tmp_path / f"{service}.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: ready.exists() or process.poll() is not None, timeout=60)
        assert process.poll() is None, log.read_text()[-3000:]
        yield process.pid, json.loads(ready.read_text())["grpc"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert process.returncode == 0


def test_storage_serves_without_torch_and_loads_it_at_the_first_registration(
    shm_dirs: ShmDirs, tmp_path: Path
) -> None:
    engine = Engine(shm_dirs.engine, "engine-late-torch")
    keys = row(new_hashes(1))
    blocks = chunk_blocks(0)
    before = engine.blocks_bytes(blocks)

    try:
        with _serving("storage", shm_dirs, tmp_path) as (pid, address):
            assert not _maps_torch(pid)
            assert asyncio.run(store_and_read_back(address, engine, keys, blocks)) == before
            assert _maps_torch(pid)
    finally:
        engine.close()


def test_a_node_loads_torch_when_its_gateway_registers_the_first_engine(
    shm_dirs: ShmDirs, tmp_path: Path
) -> None:
    engine = Engine(shm_dirs.engine, "engine-late-torch-node")
    try:
        with _serving("node", shm_dirs, tmp_path) as (pid, address):
            assert not _maps_torch(pid)
            client = GatewayClient(address)
            try:
                client.register_kv_cache(engine.gateway_request(), timeout=60)
                assert client.ping(
                    gateway_pb2.PingRequest(engine_id=engine.engine_id), timeout=10
                ).engine_known
            finally:
                client.close()
            assert _maps_torch(pid)
    finally:
        engine.close()
