"""Benchmark of the coordinator core alone (no gRPC): ingest, memory, lookup, fence, checkpoint.

Ingests 64-entry STORE batches from N emitters round-robin through
``Coordinator.ingest_validated`` (the servicer's fast path) and prints:

* entries/s over the time spent inside the core (wall clock, and thread
  CPU time, which is steadier on a shared machine), per-batch latency
  p50/p99/max and the longest stall (a batch that took over 50 ms counts as
  a stall; the max is reported either way);
* bytes per key once the directory holds ``--keys`` keys (RSS growth, and
  tracemalloc-free structural size), and whether the big tables are
  untracked by the GC;
* 16-key lookup latency p50/p99;
* fence cost: a new incarnation of one emitter fences its L1 keys;
* checkpoint capture time (how long ingest is quiesced) and write time.

Reference figures for LMCache 0.5.6 on this machine kind (docs/benchmarks.md, "Targets"):
15–20k entries/s, p99 4.7–9.1 ms, stalls up to 0.75 s, 16-key lookup p50 1 ms.

Run: ``python -m kvmesh.bench.coordinator_core [--keys 1000000] [--emitters 4] [--json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.common.events import CacheEventBatch, CacheEventEntry, EventType, Tier
from kvmesh.common.keys import ObjectKey, worker_kv_rank
from kvmesh.coordinator.core import Coordinator, CoordinatorSettings
from kvmesh.coordinator.core.persistence import save_checkpoint

BATCH = 64
MODEL = "meta-llama/Llama-3.1-8B"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class Emitter:
    """One fake storage node's event stream."""

    instance_id: str
    incarnation: int = 1
    seq: int = 0

    def batch(
        self,
        keys: Sequence[ObjectKey],
        tier: Tier,
        event_type: EventType = EventType.STORE,
        tokens: Sequence[int] = (),
    ) -> CacheEventBatch:
        self.seq += 1
        return CacheEventBatch(
            instance_id=self.instance_id,
            incarnation=self.incarnation,
            seq=self.seq,
            event_type=event_type,
            tier=tier,
            backend="dram" if tier == Tier.L1 else "fs",
            entries=tuple(CacheEventEntry(k, 4 << 20, tokens, 0 if tokens else -1) for k in keys),
            ts=time.time(),
        )


def _keys(n: int, world_size: int) -> list[ObjectKey]:
    ranks = [worker_kv_rank(world_size, r) for r in range(world_size)]
    out: list[ObjectKey] = []
    while len(out) < n:
        h = os.urandom(32)
        out.extend(ObjectKey(h, MODEL, r, 0, "tenant-a") for r in ranks)
    return out[:n]


def run(args: argparse.Namespace) -> dict[str, object]:
    """Run every measurement and return the figures."""
    coord = Coordinator(
        CoordinatorSettings(token_binding_cap=args.token_binding_cap, health_check_interval=0)
    )
    emitters = [Emitter(f"node-{i}") for i in range(args.emitters)]
    rng = random.Random(7)
    stored: list[ObjectKey] = []
    latencies: list[float] = []
    cpu_max = 0.0
    tokens = list(range(1000, 1000 + 256)) if args.tokens else ()
    gc.collect()
    t0 = time.thread_time()
    gc.collect()
    full_gc_empty = time.thread_time() - t0
    n_tracked_empty = len(gc.get_objects())
    rss0 = _rss_bytes()
    n_batches = args.keys // BATCH
    perf = time.perf_counter
    cpu = time.thread_time
    core_time = 0.0
    core_cpu = 0.0
    wall0 = perf()
    for i in range(n_batches):
        em = emitters[i % len(emitters)]
        keys = _keys(BATCH, args.world_size)
        # Every emitter stores to L2; a quarter of the batches also land in L1.
        tier = Tier.L1 if args.l1_share and i % args.l1_share == 0 else Tier.L2
        batch = em.batch(keys, tier, tokens=tokens)
        if i % 16 == 0:  # a bounded sample to look up later
            stored.extend(rng.sample(keys, 4))
        c0 = cpu()
        t0 = perf()
        coord.ingest_validated(batch)
        dt = perf() - t0
        dc = cpu() - c0
        core_cpu += dc
        cpu_max = max(cpu_max, dc)
        core_time += dt
        latencies.append(dt)
    wall = perf() - wall0
    del batch
    gc.collect()
    rss1 = _rss_bytes()
    dstats = coord.stats()
    entries = n_batches * BATCH
    structural = sum(sys.getsizeof(s) for s in coord.directory._shards) + sum(
        sys.getsizeof(k) + sys.getsizeof(v) for s in coord.directory._shards for k, v in s.items()
    )

    # Lookups of 16 known keys.
    lk: list[float] = []
    for _ in range(args.lookups):
        sample = rng.sample(stored, 16)
        t0 = perf()
        res = coord.lookup(sample, with_tokens=False)
        lk.append(perf() - t0)
        assert all(r.placements for r in res)

    # GC: a full collection's cost with the directory loaded (CPU time: the
    # machine is shared, wall time would include preemption). The lookup
    # sample and the latency list are this harness's own (a full collection
    # visits every element of a list, one cache miss each): drop them first,
    # or their cost would be counted as the coordinator's.
    stored.clear()
    batch_latency_ms = {
        "p50": _pct(latencies, 0.50) * 1e3,
        "p99": _pct(latencies, 0.99) * 1e3,
        "max": max(latencies) * 1e3,
    }
    stalls = sum(1 for x in latencies if x > 0.05)
    mean_batch_ms = statistics.fmean(latencies) * 1e3
    latencies.clear()
    t0 = cpu()
    gc.collect()
    full_gc = cpu() - t0
    n_tracked_loaded = len(gc.get_objects())

    # Checkpoint: quiesce hold (capture) and total.
    ckpt: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        t0 = perf()
        with coord.quiesce.quiesced(5.0):
            for c in coord.checkpoint_components:
                c.capture()
        ckpt["capture_ms"] = (perf() - t0) * 1e3
        coord.directory.release_capture()
        coord.lru.release_capture()
        t0 = perf()
        ok = save_checkpoint(path, coord.quiesce, coord.checkpoint_components)
        ckpt["save_total_s"] = perf() - t0
        ckpt["file_mb"] = os.path.getsize(path) / 1e6 if ok else 0.0
        # Ingest right after a capture pays the copy-on-write of touched shards
        # (save_checkpoint released its capture, so take one and hold it).
        coord.directory.capture()
        coord.lru.capture()
        cow: list[float] = []
        for j in range(200):
            em = emitters[j % len(emitters)]
            batch = em.batch(_keys(BATCH, args.world_size), Tier.L2)
            t0 = perf()
            coord.ingest_validated(batch)
            cow.append(perf() - t0)
        ckpt["post_capture_batch_max_ms"] = max(cow) * 1e3
        coord.directory.release_capture()
        coord.lru.release_capture()

    # Fence: emitter 0 restarts; its L1 keys are fenced before the batch applies.
    # The fence is settled at once; the records are swept in slices later.
    em = emitters[0]
    n_l1 = coord.stats().l1_keys_by_instance.get(em.instance_id, 0)
    em.incarnation += 1
    em.seq = 0
    batch = em.batch(_keys(1, args.world_size), Tier.L2)
    t0 = perf()
    coord.ingest_validated(batch)
    fence_s = perf() - t0
    backlog = coord.stats().fence_backlog_keys
    slices: list[float] = []
    t0 = perf()
    while coord.directory.reclaim_fenced(0) > 0:
        t1 = cpu()
        coord.directory.reclaim_fenced(1024)
        slices.append(cpu() - t1)
    sweep_s = perf() - t0

    return {
        "emitters": args.emitters,
        "batch_entries": BATCH,
        "keys_in_directory": dstats.num_keys,
        "placements": dstats.num_placements,
        "ingest_entries_per_s_core": entries / core_time,
        "ingest_entries_per_s_core_cpu_time": entries / core_cpu,
        "ingest_entries_per_s_wall_incl_batch_building": entries / wall,
        "batch_latency_ms": batch_latency_ms,
        "stalls_over_50ms": stalls,
        "batch_cpu_max_ms": cpu_max * 1e3,
        "bytes_per_key_rss": (rss1 - rss0) / max(1, dstats.num_keys),
        "bytes_per_key_structural": structural / max(1, dstats.num_keys),
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tables_gc_untracked": coord.directory.is_gc_untracked(),
        "full_gc_cpu_ms_empty": full_gc_empty * 1e3,
        "full_gc_cpu_ms_loaded": full_gc * 1e3,
        "gc_tracked_objects_empty_vs_loaded": (n_tracked_empty, n_tracked_loaded),
        "lookup16_ms": {"p50": _pct(lk, 0.5) * 1e3, "p99": _pct(lk, 0.99) * 1e3},
        "fence": {
            "l1_keys": n_l1,
            "settle_ms_in_ingest": fence_s * 1e3,
            "sweep_backlog_keys": backlog,
            "sweep_total_s": sweep_s,
            "sweep_us_per_key": sweep_s / max(1, backlog) * 1e6,
            "sweep_slice_1024_cpu_max_ms": max(slices, default=0.0) * 1e3,
        },
        "checkpoint": ckpt,
        "mean_batch_ms": mean_batch_ms,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--emitters", type=int, default=4)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--l1-share", type=int, default=4, help="every n-th batch is L1 (0: none)")
    p.add_argument("--tokens", action="store_true", help="stamp 256 tokens on every entry")
    p.add_argument("--token-binding-cap", type=int, default=65_536)
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for k, v in result.items():
        print(f"{k:48s} {v}")


if __name__ == "__main__":
    main()
