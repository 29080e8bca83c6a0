"""``kvmesh bench score``: ScoreEngines latency while the coordinator ingests engines' KV events.

Target (docs/benchmarks.md): the p99 of one ``DirectoryService/ScoreEngines``
call for an 8 000-token prompt over 16 engines stays under 1 ms at the
coordinator's ingest rate.

What runs, as deployed:

- a ``kvmesh coordinator`` subprocess following ``--engines`` engines from
  an engines file; each engine is a ZMQ PUB socket in this process that
  speaks vLLM's KV event format (:mod:`.feed`);
- every engine first stores ``--prompts`` prompts of ``--prompt-tokens``
  tokens in blocks of ``--block-size``, all sharing a system prefix of
  ``--shared-tokens`` tokens; one kvmesh node reports the first half of the
  probed prompt's chunks in L1, so the scores mix the engine tier and L1;
- while the ``ScoreEngines`` calls are timed, a feeder thread keeps every
  engine publishing new blocks (and removing old ones) at ``--rate``
  batches per second per engine, and the rate the coordinator applied is
  read from ``ListEngines`` before and after;
- the request (the probed prompt's token ids, every engine) is built once;
  each call goes through the typed client a router would use. The same run
  times ``GetStats`` (an RPC that does no work) on the same channel: the
  floor of one call.

The answers are checked: the engine holding the probed prompt must come
first with the whole prompt matched.
"""

from __future__ import annotations

from kvmesh.bench.common import bench_main

from .runner import add_arguments, format_table, run

__all__ = ["add_arguments", "format_table", "main", "run"]


def main(argv: list[str] | None = None) -> None:
    """``python -m kvmesh.bench.score [--json]``."""
    bench_main(__doc__, add_arguments, run, format_table, argv)
