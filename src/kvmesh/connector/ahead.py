"""The scheduler's ahead loads: ``RetrieveAhead`` sent from a thread of its own.

When the scheduler plans a load, the blocks it goes into are already
allocated; the worker asks for the load only after the engine has handed it
the step (2–3 ms on a CPU host). ``RetrieveAhead`` starts the copy at once,
and the worker's ``Retrieve`` for the same load joins it (docs/vllm.md,
"Loads started by the scheduler"). The call goes from this thread so the
scheduler never waits for it; a failed or refused one changes nothing but
the time: the worker's ``Retrieve`` then copies as it always did.
"""

from __future__ import annotations

import logging
import queue
import threading

import grpc

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.connector.types import rpc_failure
from kvmesh.gateway.client import GatewayClient

logger = logging.getLogger(__name__)

#: Deadline of one RetrieveAhead: the load is useless to start later than the step.
AHEAD_TIMEOUT_S = 2.0


class AheadSender:
    """Sends ``RetrieveAhead`` requests in order from one daemon thread (started on first use)."""

    def __init__(self, client: GatewayClient) -> None:
        self.client = client
        self._queue: queue.SimpleQueue[gateway_pb2.RetrieveRequest | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def send(self, request: gateway_pb2.RetrieveRequest) -> None:
        """Queue one request; returns at once."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvmesh-retrieve-ahead", daemon=True
                )
                self._thread.start()
        self._queue.put(request)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while (request := self._queue.get()) is not None:
            try:
                resp = self.client.retrieve_ahead(request, timeout=AHEAD_TIMEOUT_S)
            except grpc.RpcError as exc:
                # The worker's Retrieve copies as usual (and reports the same error).
                logger.debug(
                    "retrieve ahead of %s failed: %s", request.range.request_id, rpc_failure(exc)
                )
                continue
            except Exception:  # never let the thread die: later loads still go ahead
                logger.exception("retrieve ahead of %s failed", request.range.request_id)
                continue
            logger.debug(
                "load of %s %s ahead",
                request.range.request_id,
                "started" if resp.started else "not started",
            )
