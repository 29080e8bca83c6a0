"""An asyncio event loop on its own daemon thread, driven from threaded code.

The NATS transport's client (nats-py) is asyncio while the emitter is
threads; the transport runs its connections on one of these.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """An asyncio loop on a daemon thread, for an asyncio client under a threaded caller.

    Started on construction; :meth:`stop` cancels what is left and joins it.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop (any thread); RuntimeError once the loop closed."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float) -> None:
        """Cancel what is left, stop the loop and join the thread."""

        async def _cancel_all() -> None:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_closed():
            return
        try:
            self.submit(_cancel_all()).result(timeout)
        except Exception:
            logger.debug(
                "cancelling the tasks of loop thread %s failed", self._thread.name, exc_info=True
            )
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
