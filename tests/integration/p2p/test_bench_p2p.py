"""``kvmesh bench p2p`` runs end to end at a tiny size and reports the issue's keys.

Figures are not checked (tests never assert times); the keys, the parameters,
the same-run TCP baseline and the byte check are.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.harness import kvmesh_cli


def test_bench_p2p_reports_the_issue_keys_and_equal_bytes() -> None:
    before = set(Path("/dev/shm").glob("kvmesh-bench-p2p-*"))
    done = kvmesh_cli(
        "bench", "p2p", "--chunk-mib", "1", "--chunks", "4", "--rounds", "2", "--json",
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    for key in ("p2p_gbps", "loopback_tcp_gbps", "prefix_fetch_p50_ms", "chunk_bytes"):
        assert result[key] > 0, key
    assert result["chunk_bytes"] == 1 << 20
    assert result["bytes_equal"] is True
    assert result["transport"] == "tcp-stream"
    assert result["parameters"]["chunks"] == 4
    assert len(result["prefix_fetch_ms"]) == 2
    assert set(Path("/dev/shm").glob("kvmesh-bench-p2p-*")) <= before  # nothing left behind
