"""``kvmesh bench route``: routing by the coordinator's ScoreEngines vs round robin vs an oracle.

A fleet of two real vLLM OpenAI servers, each with kvmesh's connector on a
``kvmesh node`` of its own, and a ``kvmesh coordinator`` following both
engines' vLLM KV events and both nodes' cache events (:mod:`.fleet`). Each
router sends the same kind of workload through it, one router after the
other (:mod:`.workload`): ``--groups`` groups of ``--requests-per-group``
requests sharing a prefix of ``--prefix-tokens`` tokens, each with a suffix
of its own, the first request of every group first, ``--concurrency`` in
flight, streamed so that a request's TTFT is the time to its first chunk.
Each router gets prefixes of its own, so none finds another's in a cache.

The routers (:mod:`.routers`):

- ``score``: asks ``DirectoryService/ScoreEngines`` and sends the prompt to
  the best-scored engine (each call timed on the client, over one open
  grpc.aio channel);
- ``round_robin``: the engines in turn;
- ``oracle``: knows every engine's cache (the prompts it sent there) and
  picks the longest common prefix in whole chunks.

Ties go to the engine with the fewest requests in flight, then round robin.
vLLM's KV cache holds every prompt of the run and each node's L2 is off, so
an engine's cache is exactly what was sent to it unless ``--p2p`` lets the
nodes fetch from each other. Before the routers run, each engine answers a
prompt of its own, and (with the score router) the coordinator must score it
as cached in that engine: the KV events arrive and meet kvmesh's keys.

Per router: tokens vLLM reported cached (``usage.prompt_tokens_details.
cached_tokens``: its own prefix cache and kvmesh's), prompt tokens, TTFT
mean/p50/p90, requests per engine; for ``score`` also the ScoreEngines
calls, failures and p50/p99. Every process is stopped on the way out, also
on failure or Ctrl-C.

Modules: :mod:`.params` (options), :mod:`.workload`, :mod:`.routers`,
:mod:`.fleet`, :mod:`.runner` (``run``) and :mod:`.report`
(``format_table``).
"""

from __future__ import annotations

from kvmesh.bench.common import bench_main

from .params import add_arguments
from .report import format_table
from .runner import run

__all__ = ["add_arguments", "format_table", "main", "run"]


def main(argv: list[str] | None = None) -> None:
    """``python -m kvmesh.bench.route [--json]``."""
    bench_main(__doc__, add_arguments, run, format_table, argv)
