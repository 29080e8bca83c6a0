"""Learn each L2 adapter's capacity and contents when a node starts, off the serving path.

A thread walks the adapters: it asks each for its capacity and, when the
node indexes L2 at start, for everything it holds (each :class:`L2Tier`
reports what it finds as STORE/L2 events, so the coordinator relearns this
node's L2 placements after a restart). :meth:`L2Indexer.wait` returns after
the first pass; adapters that were down are retried every backoff period
until they answer or the node closes, so one that comes back later is still
indexed and announced.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvmesh.storage.core.controllers.l2tier import L2Tier
from kvmesh.storage.core.l2.base import L2Unavailable

logger = logging.getLogger(__name__)


class L2Indexer:
    """The start-up indexing thread of a node's L2 tiers."""

    def __init__(
        self,
        tiers: Sequence[L2Tier],
        *,
        index_contents: bool,
        backoff_s: float,
        on_progress: Callable[[], None],
    ) -> None:
        self.tiers = list(tiers)
        self.index_contents = index_contents
        self.backoff_s = backoff_s
        self.on_progress = on_progress
        self._done = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.tiers:
            self._done.set()
            return
        self._thread = threading.Thread(target=self._run, name="kvmesh-l2-index", daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> bool:
        """Wait until every adapter has been indexed once (or failed to be)."""
        return self._done.wait(timeout)

    def close(self, timeout: float) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        pending = list(self.tiers)
        first_pass = True
        try:
            while pending and not self._closing.is_set():
                progressed = False
                for tier in list(pending):
                    if self._closing.is_set():
                        return
                    if not tier.available():
                        continue
                    try:
                        tier.refresh_capacity()
                        if self.index_contents:
                            tier.rebuild_index()
                    except L2Unavailable as exc:
                        logger.warning("could not index L2 %s at start: %s", tier.name, exc)
                        tier.index_state = "failed"
                        continue
                    pending.remove(tier)
                    progressed = True
                if progressed:
                    self.on_progress()
                if first_pass:
                    first_pass = False
                    self._done.set()
                if pending:
                    self._closing.wait(self.backoff_s)
        except Exception:
            logger.exception("L2 start-up indexing failed")
        finally:
            self._done.set()
