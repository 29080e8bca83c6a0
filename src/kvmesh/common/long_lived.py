"""Keep a service's start-up objects out of Python's full garbage collections.

A full (generation 2) collection walks every tracked object and holds the
GIL while it does: in a storage node with torch imported (about 180 000
objects) one took 13–59 ms in serving and 72–84 ms when forced, and every
lookup and retrieve waited behind it on the event loop. The modules, classes
and functions loaded at start live as long as the process, so scanning them
finds nothing. :func:`freeze_long_lived` moves every object tracked now into
the collector's permanent generation (``gc.freeze``): later collections walk
only what was made after it (docs/architecture.md, "Full collections skip
what start-up made").
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


#: Whether this process froze its start-up (a service's entry point did).
_service = False


def freeze_long_lived(what: str) -> int:
    """A service's start-up is done: free what is garbage, freeze the rest; how many
    objects are frozen. Call it before serving (the collection holds the GIL)."""
    global _service  # noqa: PLW0603 - one process-wide switch, like the collector itself
    gc.collect()
    gc.freeze()
    _service = True
    frozen = gc.get_freeze_count()
    logger.debug("%s: %d objects frozen out of full collections", what, frozen)
    return frozen


def freeze_more(what: str) -> int:
    """In a service that froze its start-up, freeze what a later one-time load made
    (torch, imported at the first registration), without a collection: a request
    is waiting. Elsewhere (a test, a library user's process) it does nothing: the
    process owns its collector. How many objects are frozen in all."""
    if not _service:
        return 0
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("%s: %d objects frozen out of full collections", what, frozen)
    return frozen
