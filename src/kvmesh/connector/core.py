"""``KVMeshConnector``: vLLM's KV-connector hooks over kvmesh's gateway.

vLLM builds one connector per role: the **scheduler** side decides, per
request, how many prompt tokens kvmesh can supply and what to load and save
in each step; the **worker** side registers the paged KV memory and executes
those loads and saves. This class has the same hooks under the same names,
taking plain objects (:mod:`kvmesh.connector.metadata`), so wiring it into vLLM is an
adapter that copies fields, not a rewrite. The flow follows LMCache's MP
connector (docs/connector.md, "Scheduler flow" and "Worker flow"):

scheduler, per request:
  1. :meth:`get_num_new_matched_tokens` — sends ``Lookup`` once (it returns at
     once; L2 hits keep loading in the background), then polls
     ``QueryPrefetchStatus``; ``None`` means "ask again next step". A gateway
     error, or a lookup still unfinished after ``lookup_timeout_s``, gives 0:
     the engine recomputes, it never waits on kvmesh.
  2. :meth:`update_state_after_alloc` — frees the lookup locks of the chunks
     that will not be retrieved.
  3. :meth:`build_connector_meta` — a retrieve op (``start`` rounded down to a
     chunk, ``skip_first_n_tokens`` = the engine's own prefix hit inside it)
     and store ops for newly computed complete chunks.
  4. :meth:`request_finished` — ``EndSession`` (releases whatever locks remain),
     sent from a thread of its own (:mod:`kvmesh.connector.background`).

worker, per step: :meth:`start_load_kv` → :meth:`wait_for_load` → forward →
:meth:`save_kv` → :meth:`wait_for_save`. A failed or short retrieve is
reported (request ids, and block ids via :meth:`get_block_ids_with_load_errors`)
so the engine recomputes from the first missing block. If the gateway
forgot the engine (it restarted, or reaped it), the call counts as a miss and
the worker's heartbeat registers again off the forward path.

Both halves beat (``heartbeat_s``, :mod:`kvmesh.connector.heartbeat`): the
worker pings with its engine id, the scheduler with the instance id its
lookups carry, so the gateway reaps a killed engine's memory and leases.

Every call has a deadline (the typed client's defaults, or ``rpc_timeout_s``).

A vLLM ``KVConnectorBase_V1`` adapter maps: ``request_finished(request,
block_ids)`` → ``(request_finished(request), None)``; ``start_load_kv(ctx)`` →
``start_load_kv(bound metadata)`` then :meth:`wait_for_load` (a load by layer:
``start_load_kv(metadata, by_layer=True)``, ``wait_for_layer_load`` →
:meth:`wait_for_layer`, and :meth:`wait_for_load` before the step is
reported); ``save_kv_layer`` → nothing,
``wait_for_save()`` → :meth:`save_kv` + :meth:`wait_for_save`;
``register_kv_caches(kv_caches)`` → the same, plus the shared-memory regions
of the engine's KV allocator.
"""

from __future__ import annotations

import logging

import grpc

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.connector.scheduler import SchedulerHooks
from kvmesh.connector.types import (
    ConnectorError,
    KVConnectorRole,
    KVMeshConnectorConfig,
    LookupResult,
    ShmRegion,
    rpc_failure,
)
from kvmesh.connector.worker import WorkerHooks

__all__ = [
    "ConnectorError",
    "KVConnectorRole",
    "KVMeshConnector",
    "KVMeshConnectorConfig",
    "LookupResult",
    "ShmRegion",
]

logger = logging.getLogger(__name__)


class KVMeshConnector(SchedulerHooks, WorkerHooks):
    """The KV-connector hooks of one role, talking to one gateway over gRPC.

    The scheduler hooks live in :mod:`kvmesh.connector.scheduler`, the worker
    hooks in :mod:`kvmesh.connector.worker`; a method of the other role raises.
    """

    def shutdown(self) -> None:
        """Finish transfers, unregister the KV memory (worker) and close the channel."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self.role is KVConnectorRole.WORKER:
            self.wait_for_load()
            self.wait_for_save()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._registration is not None:
                try:
                    self.client.unregister_kv_cache(
                        gateway_pb2.UnregisterKVCacheRequest(engine_id=self.engine_id),
                        timeout=self._timeout,
                    )
                except grpc.RpcError as exc:
                    logger.warning("unregistering %s failed: %s", self.engine_id, rpc_failure(exc))
                self._registration = None
        else:
            if self._ahead is not None:
                self._ahead.close()
            self.flush_releases()
            for request_id in list(self._requests):
                self._end_session(request_id)
            self._requests.clear()
        if self._owns_client:
            self.client.close()
