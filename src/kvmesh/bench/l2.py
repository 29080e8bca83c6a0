"""Throughput of one L2 adapter: batched puts and gets of equal-size objects.

Builds the adapter from a factory config (the same JSON a storage node
takes), stores ``--count`` objects of ``--size-mib`` in batches of
``--batch``, reads them back into pre-faulted buffers, checks the bytes and
deletes them. Prints JSON: ``put_gbps``, ``get_gbps`` (medians over
``--rounds``), and a one-thread ``memcpy_gbps`` of the same bytes for scale.

    python -m kvmesh.bench.l2 --config '{"type": "disk", "base_path": "/tmp/kvmesh-l2-bench"}'
    python -m kvmesh.bench.l2 --size-mib 4 \
        --config '{"type": "redis", "url": "redis://127.0.0.1:6390"}'

Use a namespace nobody else uses (a fresh directory, a Redis key_prefix, an S3 prefix).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import time
from typing import Any

import numpy as np

from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.l2.factory import build_l2_adapter

logger = logging.getLogger(__name__)


def _keys(count: int, salt: str) -> list[ObjectKey]:
    return [
        ObjectKey(hashlib.blake2b(f"{salt}:{i}".encode(), digest_size=32).digest(), "bench/m", 0)
        for i in range(count)
    ]


def run(config: str, size_mib: float, count: int, batch: int, rounds: int) -> dict[str, Any]:
    """Time ``rounds`` put/get cycles; returns the figures as a dict."""
    size = int(size_mib * (1 << 20))
    adapter = build_l2_adapter(config)
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(min(count, 4))]
    outs = [np.ones(size, dtype=np.uint8) for _ in range(count)]  # pre-faulted
    put_gbps: list[float] = []
    get_gbps: list[float] = []
    try:
        for r in range(rounds):
            keys = _keys(count, f"round{r}")
            items = [(k, sources[i % len(sources)].data) for i, k in enumerate(keys)]
            start = time.perf_counter()
            for b in range(0, count, batch):
                if not all(adapter.put_many(items[b : b + batch])):
                    raise RuntimeError("a put failed")
            put_gbps.append(size * count / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            for b in range(0, count, batch):
                got = adapter.get_into(keys[b : b + batch], [o.data for o in outs[b : b + batch]])
                if not all(got):
                    raise RuntimeError("a get missed")
            get_gbps.append(size * count / (time.perf_counter() - start) / 1e9)
            for i, out in enumerate(outs):
                if not np.array_equal(out, sources[i % len(sources)]):
                    raise RuntimeError(f"object {i} read back wrong")
            adapter.delete_many(keys)
    finally:
        adapter.close()
    dst = np.empty_like(sources[0])
    dst.fill(0)
    start = time.perf_counter()
    for _ in range(5):
        np.copyto(dst, sources[0])
    memcpy = size * 5 / (time.perf_counter() - start) / 1e9
    return {
        "backend": json.loads(config).get("type"),
        "object_bytes": size,
        "count": count,
        "batch": batch,
        "put_gbps": round(statistics.median(put_gbps), 3),
        "get_gbps": round(statistics.median(get_gbps), 3),
        "memcpy_gbps": round(memcpy, 3),
    }


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: ``python -m kvmesh.bench.l2 --config JSON``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="L2 adapter config JSON")
    parser.add_argument("--size-mib", type=float, default=32.0)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.config, args.size_mib, args.count, args.batch, args.rounds)))


if __name__ == "__main__":
    main()
