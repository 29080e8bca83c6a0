"""``kvmesh demo`` without ``--gateway`` starts a local fleet, runs, and leaves nothing behind.

In a module of its own: fleets on one host must not overlap.
"""

from __future__ import annotations

import os

import pytest

from kvmesh.cli.main import main
from tests.e2e.support import require_fleet_services


def test_kvmesh_demo_starts_and_stops_its_own_fleet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    require_fleet_services()

    def engine_files() -> set[str]:
        return {f for f in os.listdir("/dev/shm") if f.startswith("kvmesh-engine-")}

    before = engine_files()

    argv = [
        "demo",
        "--prompt-tokens",
        "600",
        "--layers",
        "1",
        "--l1-size",
        "64MiB",
        "--no-progress",
    ]
    assert main(argv) == 0

    out = capsys.readouterr().out
    assert "(local fleet)" in out
    assert out.count("logits bit-identical: yes") == 2
    assert engine_files() <= before
