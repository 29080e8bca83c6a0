"""Installs by role: the coordinator and the gateway serve without torch.

``pip install kvmesh`` carries no torch; only a storage node (and what runs
one: ``node``, ``up``, ``demo``, ``bench``) needs the ``storage`` extra. Here
the coordinator and the gateway run as real processes whose interpreter
cannot import torch (an import hook refuses it, exactly as an interpreter
without it would), in front of a normal storage node, and an engine stores
and retrieves KV through them. The commands that do need torch say so in one
line, naming the extra (tests/integration/cli/test_bad_invocations.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvmesh.api.coordinator.v1 import directory_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.coordinator.client import DirectoryClient
from kvmesh.gateway.client import GatewayClient
from tests.integration.gateway.support import CHUNK, blocks, prange, prompt
from tests.integration.storage.support import MODEL, Engine
from tests.support.harness import REPO_ROOT
from tests.support.waiting import wait_until

NO_TORCH = """\
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def test_the_base_install_names_no_torch() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("torch")]
    assert any(d.startswith("torch==") for d in project["optional-dependencies"]["storage"])


class Services:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        (tmp / "no-torch").mkdir()
        (tmp / "no-torch" / "sitecustomize.py").write_text(NO_TORCH)

    def start(self, name: str, *args: str, torch: bool) -> dict[str, str]:
        env = dict(os.environ)
        if not torch:
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(self.tmp / "no-torch"), env.get("PYTHONPATH", "")])
            )
        ready = self.tmp / f"{name}.json"
        log = (self.tmp / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", name, "--port", "0", "--metrics-port", "-1",
             "--ready-file", str(ready), *args],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.procs.append(proc)
        wait_until(lambda: ready.exists() or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, (self.tmp / f"{name}.log").read_text()
        endpoints: dict[str, str] = json.loads(ready.read_text())
        return endpoints

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted(self.tmp.glob("*.log")))


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    services = Services(tmp_path)
    try:
        yield services
    finally:
        services.stop()


def test_coordinator_and_gateway_serve_kv_without_torch(services: Services, tmp_path: Path) -> None:
    memory = Path("/dev/shm") / f"kvmesh-test-roles-{uuid.uuid4().hex[:10]}"
    memory.mkdir()
    try:
        coordinator = services.start("coordinator", "--chunk-size", str(CHUNK), torch=False)
        storage = services.start(
            "storage",
            "--instance-id", "roles-node",
            "--coordinator-target", coordinator["grpc"],
            "--data-dir", str(tmp_path / "data"),
            "--shm-dir", str(memory / "l1"),
            "--allowed-memory-dir", str(memory),
            "--l1-size-bytes", "16MiB",
            torch=True,
        )  # fmt: skip
        gateway = services.start(
            "gateway",
            "--storage-target", storage["grpc"],
            "--chunk-size", str(CHUNK),
            torch=False,
        )  # fmt: skip
        engine = Engine(memory, "roles-engine", seed=3)
        tokens = prompt(2, seed=11)
        with GatewayClient(gateway["grpc"]) as client:
            client.register_kv_cache(engine.gateway_request(), timeout=30)
            client.store(
                gateway_pb2.StoreRequest(
                    engine_id=engine.engine_id,
                    range=prange("r-store", tokens, 0, 2 * CHUNK),
                    block_ids=blocks(range(2)),
                ),
                timeout=30,
            )
            hit = client.lookup(
                gateway_pb2.LookupRequest(
                    request_id="r-load",
                    model_name=MODEL,
                    world_size=1,
                    token_ids=tokens,
                    wait_timeout_ms=5000,
                ),
                timeout=30,
            )
            assert hit.status.hit_tokens == 2 * CHUNK, hit
            target = blocks(range(2), base=8 * 4)
            client.retrieve(
                gateway_pb2.RetrieveRequest(
                    engine_id=engine.engine_id,
                    range=prange("r-load", tokens, 0, 2 * CHUNK),
                    block_ids=target,
                ),
                timeout=30,
            )
            client.end_session(gateway_pb2.EndSessionRequest(request_id="r-load"), timeout=30)
        # The blocks loaded through the torch-free gateway hold the stored bytes.
        source = blocks(range(2))
        assert np.array_equal(engine.kv[:, :, target], engine.kv[:, :, source])

        # The torch-free coordinator ingested the node's events: it knows both chunks.
        with DirectoryClient(coordinator["grpc"]) as directory:
            wait_until(
                lambda: (
                    directory.get_stats(directory_pb2.GetStatsRequest(), timeout=10).num_keys == 2
                ),
                timeout=30,
            )
    finally:
        services.stop()
        shutil.rmtree(memory, ignore_errors=True)
    logs = services.logs()
    assert "Traceback" not in logs, logs
