"""``kvmesh bench ingest``: cache-event ingest and directory lookups through a real coordinator.

Baseline and targets (docs/benchmarks.md, "Targets"): LMCache 0.5.6 ingests
15–20k entries/s (64-entry store batches, 4 emitters) with ack p99 4.7–9.1 ms and
stalls up to 0.75 s (full garbage collections that grow with the directory);
a 16-key directory lookup takes about 1 ms. Targets: at least 10x its
entries/s, p99 at most 5 ms and no stall over 50 ms.

What runs, as deployed:

* the coordinator is a ``kvmesh coordinator`` subprocess on a loopback port
  (timers that do not matter here are off: health sweep, eviction loop);
* ``--emitters`` emitter processes (separate processes, so their Python
  work never competes with the coordinator for one GIL) each open one
  ``EventIngestService.StreamEvents`` call and stream ``--batch-entries``
  -entry STORE batches of fresh keys, at most ``--window`` batches in flight
  (sent, not yet acked). Window 1 is what LMCache's figures were measured
  with (its HTTP sink posts one flush at a time and waits for the answer).
  With a larger window an emitter sends the batches the window lets out at
  once as one ``batches`` group (at most ``--group`` per message, default
  the window; 1 never groups), as the storage node's link does with
  batches already waiting: one message and one AckGroup per group instead
  of one per batch, which is where gRPC's per-message cost goes. Batches
  stay ``--batch-entries`` entries each and every batch's ack latency is
  still measured on its own; the window adds queueing to every ack
  (Little's law). ``--window`` takes several values to run one
  configuration after another, each against a fresh coordinator. The
  default runs first what a storage node runs (window
  ``DEFAULT_MAX_IN_FLIGHT_BATCHES`` of ``kvmesh.storage.events.emitter``, 2,
  with groups: the headline figures), then window 1 without groups
  (LMCache's synchronous flush, for the comparison). Every
  request is serialized before the clock starts (the stream sends the
  bytes as they are; a group is the batches' bytes joined) and each emitter
  streams with ``grpc.aio`` (a write and a read per message on its own event
  loop, no request thread to hand each message to), so the client side,
  which shares this machine's cores with the coordinator, costs little;
* all emitters start together; each batch's send and ack times are taken
  with the system-wide monotonic clock, so the emitters' timelines merge.

Figures:

* ``entries_per_s``: entries acked / (last ack − first send);
* ``ack_p50_ms`` / ``ack_p99_ms`` / ``ack_max_ms``: send → ack of each batch;
* ``max_stall_ms``: the longest gap between consecutive acks of the whole
  fleet (all emitters merged) while traffic flows — a coordinator pause
  shows here; ``max_stall_per_emitter_ms`` is the same per stream (it also
  counts an emitter process that was descheduled);
* ``lookup16_p50_ms`` / ``lookup16_p99_ms``: ``DirectoryService.Lookup`` of
  16 stored keys over the loaded directory, one call at a time;
* ``bytes_per_key``: growth of the coordinator's VmRSS (``/proc/<pid>/status``)
  from before ingest to after it, divided by ``num_keys`` from ``GetStats``;
* ``coordinator_cpu_s`` and ``entries_per_coordinator_cpu_s``: the
  coordinator's user+system CPU time during ingest, steadier than wall time
  on a shared machine; ``emitters_cpu_s``: what the emitter processes used
  meanwhile (on a 2-core machine they share the second core);
* ``batches_per_message``: batches per StreamEvents message actually sent
  (1.0 without groups).

Memory: about 60 MB of pre-serialized batches per million keys across the
emitters, plus the coordinator's directory.

Modules: :mod:`.params` (options and reference figures), :mod:`.server` (the
coordinator subprocess), :mod:`.emitter` (the emitter processes),
:mod:`.runner` (``run``) and :mod:`.report` (``format_table``).
"""

from __future__ import annotations

from kvmesh.bench.common import bench_main

from .params import add_arguments
from .report import format_table
from .runner import run

__all__ = ["add_arguments", "format_table", "main", "run"]


def main(argv: list[str] | None = None) -> None:
    """``python -m kvmesh.bench.ingest [--json]``."""
    bench_main(__doc__, add_arguments, run, format_table, argv)
