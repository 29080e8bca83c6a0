"""``kvmesh demo`` without ``--gateway`` starts a local fleet, runs, and leaves nothing behind.

In a module of its own: fleets on one host must not overlap.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest

from kvmesh.cli.main import main
from tests.e2e.support import require_fleet_services


def test_kvmesh_demo_starts_and_stops_its_own_fleet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    require_fleet_services()
    # The engine's KV file goes to a directory of this test's own, so the check below
    # sees only what this demo made (other processes on the host may be using /dev/shm).
    engine_dir = tempfile.mkdtemp(prefix="kvmesh-test-demo-", dir="/dev/shm")

    argv = [
        "demo",
        "--prompt-tokens",
        "600",
        "--layers",
        "1",
        "--l1-size",
        "64MiB",
        "--no-progress",
        "--engine-dir",
        engine_dir,
    ]
    try:
        assert main(argv) == 0
        left = os.listdir(engine_dir)
    finally:
        shutil.rmtree(engine_dir, ignore_errors=True)

    out = capsys.readouterr().out
    assert "(local fleet)" in out
    assert out.count("logits bit-identical: yes") == 2
    assert left == []


def test_kvmesh_demo_on_two_nodes_serves_the_warm_run_over_p2p(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--nodes 2``: a fleet without L2; the warm engine sits on node 1, the prefix on node 0."""
    require_fleet_services()
    engine_dir = tempfile.mkdtemp(prefix="kvmesh-test-demo-", dir="/dev/shm")
    argv = ["demo", "--nodes", "2", "--prompt-tokens", "600", "--layers", "1", "--l1-size",
            "64MiB", "--no-progress", "--json", "--engine-dir", engine_dir]  # fmt: skip
    try:
        assert main(argv) == 0
        left = os.listdir(engine_dir)
    finally:
        shutil.rmtree(engine_dir, ignore_errors=True)
    result = json.loads(capsys.readouterr().out)
    params = result["parameters"]
    assert params["warm_gateway"] != params["gateway"]
    assert "node-1" in params["warm_gateway"]
    assert result["cold"]["tokens_from_cache"] == 0
    assert result["tokens_from_cache"] == 512  # two whole chunks came from node 0
    assert result["logits_match"] is True
    assert result["shared_prefix"]["logits_match"] is True
    assert left == []
