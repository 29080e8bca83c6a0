"""``kvmesh bench lookup``: latency of a prefix lookup through a real gateway and storage node.

Target (docs/benchmarks.md, "Targets"): a Lookup of a 32-chunk prefix through
the gateway must have a p50 of at most 0.5 ms. LMCache 0.5.6 measures 1.5 ms
lookup p50 on this machine kind, and an empty round trip of 0.3 ms (ZMQ) / 0.7 ms (its own gRPC).

What runs, by ``--arrangement`` (the headline is the first that runs):

- ``node-lane``: storage and gateway in one ``kvmesh node`` process (the
  gateway calls storage in-process), the engine's client on the node's
  local lane (``lane:<socket>``, src/kvmesh/rpc/lane/) — how an engine on
  the node's host is meant to connect;
- ``node``: the same process, the engine's client on gRPC (TCP loopback);
- ``processes-lane``: ``kvmesh storage`` and ``kvmesh gateway`` in their
  own processes (as ``kvmesh up`` runs them), both hops on local lanes;
- ``processes``: the same two processes with both hops on gRPC (TCP
  loopback), as when deployed on different hosts;
- ``in-process``: both servers on one asyncio loop in a background thread
  of this process (client and servers then share one GIL, which is not how
  kvmesh runs).

An engine KV
cache (flash-attn, block size 16, small dims so the store is quick) in a
/dev/shm file is registered through the gateway, and one prompt of
``--chunks`` chunks of ``--chunk-tokens`` tokens is stored, so the whole
prefix is in L1. Then, with the typed ``GatewayClient`` a connector uses:

- ``lookup``: each iteration is a new request: ``Lookup`` (waits for
  completion; the prefix is in L1, so it answers at once) followed by
  ``EndSession``, as a scheduler does per request. The lookup's latency is
  the headline; ``EndSession`` (which releases the 32 read locks and
  refreshes LRU) is reported beside it.
- ``relookup``: the same request looked up again and again (each Lookup
  first releases the previous one's locks), once per iteration.
- ``empty``: ``GetChunkSize`` and ``Ping`` round trips (no storage call).

The request message is built once per prompt and only its ``request_id``
changes, as an engine would reuse its token array (building 8192 fixed32
values from a Python list costs about 0.25 ms by itself).

Where the time goes is reported from the servers' own RPC metrics (mean
handler time per method, scraped from ``/metrics`` before and after the
timed loop): client round trip = client stack + gateway handler, and the
gateway handler = its own work + its storage calls. With ``--profile`` a
second, separate pass runs the client loop and the servers' loop threads
under cProfile (switched on by signals for the timed requests only) and
reports, per lookup + EndSession, the busy time in each part of the stack
(kvmesh code, asyncio, gRPC's Python layer, compiled gRPC/protobuf code) and
the kvmesh functions that cost most. Profiled figures are slower than the
timed ones and are never the headline.

Every file this creates (engine file, L1 segments, data directories) is
removed, also on failure.

Modules: :mod:`.params` (options, parameters, target),
:mod:`.servers` (the arrangements' servers), :mod:`.workload` (what is
timed), :mod:`.profiling` (the cProfile summary), :mod:`.runner` (``run``)
and :mod:`.report` (``format_table``).
"""

from __future__ import annotations

from kvmesh.bench.common import bench_main

from .params import add_arguments
from .report import format_table
from .runner import run

__all__ = ["add_arguments", "format_table", "main", "run"]


def main(argv: list[str] | None = None) -> None:
    """``python -m kvmesh.bench.lookup [--json]``."""
    bench_main(__doc__, add_arguments, run, format_table, argv)
