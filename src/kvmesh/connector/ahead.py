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

import functools
import logging

import grpc

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.connector.background import BackgroundCalls
from kvmesh.connector.types import rpc_failure
from kvmesh.gateway.client import GatewayClient

logger = logging.getLogger(__name__)

#: Deadline of one RetrieveAhead: the load is useless to start later than the step.
AHEAD_TIMEOUT_S = 2.0


class AheadSender:
    """Sends ``RetrieveAhead`` requests in order from one daemon thread (started on first use)."""

    def __init__(self, client: GatewayClient) -> None:
        self.client = client
        self._calls = BackgroundCalls("kvmesh-retrieve-ahead")

    def send(self, request: gateway_pb2.RetrieveRequest) -> None:
        """Queue one request; returns at once."""
        self._calls.submit(request.range.request_id, functools.partial(self._send, request))

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread."""
        self._calls.close(timeout)

    def _send(self, request: gateway_pb2.RetrieveRequest) -> None:
        try:
            resp = self.client.retrieve_ahead(request, timeout=AHEAD_TIMEOUT_S)
        except grpc.RpcError as exc:
            # The worker's Retrieve copies as usual (and reports the same error).
            logger.debug(
                "retrieve ahead of %s failed: %s", request.range.request_id, rpc_failure(exc)
            )
            return
        logger.debug(
            "load of %s %s ahead",
            request.range.request_id,
            "started" if resp.started else "not started",
        )
