"""Scheduler half of the connector: lookups, load and store plans, sessions.

See docs/connector.md, "Scheduler flow".
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Sequence

import grpc

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.connector.ahead import AheadSender
from kvmesh.connector.background import BackgroundCalls
from kvmesh.connector.base import ConnectorBase
from kvmesh.connector.heartbeat import Heartbeat
from kvmesh.connector.metadata import (
    ConnectorMetadata,
    Request,
    RetrieveOp,
    SchedulerOutput,
    StoreOp,
)
from kvmesh.connector.request_state import RequestState
from kvmesh.connector.types import (
    ConnectorError,
    KVConnectorRole,
    KVMeshConnectorConfig,
    LookupResult,
    rpc_failure,
)
from kvmesh.gateway.client import GatewayClient

logger = logging.getLogger(__name__)

#: How long a lookup's answer is awaited without releasing the GIL (a hit's takes ~0.5 ms).
LOOKUP_SPIN_S = 0.002


class SchedulerHooks(ConnectorBase):
    """The scheduler-side hooks (one instance per engine scheduler)."""

    def __init__(
        self,
        config: KVMeshConnectorConfig,
        role: KVConnectorRole,
        *,
        client: GatewayClient | None = None,
    ) -> None:
        super().__init__(config, role, client=client)
        # vLLM's scheduler, and every request with it, waits for a lookup; its other
        # threads must not keep the GIL once the answer is in (docs/performance.md,
        # "The engine's threads and the GIL").
        self.client.wait_holding_gil("Lookup", LOOKUP_SPIN_S)
        self._requests: dict[str, RequestState] = {}
        #: Steps planned so far (build_connector_meta calls).
        self._step = 0
        #: Appended to the salt of every key asked for or stored since the last
        #: :meth:`reset_cache` ("" before).
        self.namespace = ""
        self._ahead = AheadSender(self.client) if config.ahead_engine_id else None
        #: Releases (FreeLookupLocks, EndSession), sent off the scheduler's loop in the
        #: order they were made (docs/connector.md, "Scheduler flow").
        self._releases = BackgroundCalls("kvmesh-releases")

    def _beat_as_owner(self) -> None:
        """Scheduler heartbeat: keeps the gateway's leases of this instance's lookups alive."""
        try:
            self.client.ping(
                gateway_pb2.PingRequest(engine_id=self.config.instance_id), timeout=self._timeout
            )
            # A gateway restarted (upgraded) with another chunk size: plans follow it.
            chunk_size = self.client.get_chunk_size(
                gateway_pb2.GetChunkSizeRequest(), timeout=self._timeout
            ).chunk_size
        except grpc.RpcError as exc:
            self._note_failure("heartbeat", exc)
            return
        self._note_ok()
        if self._chunk_size is not None and chunk_size != self._chunk_size:
            logger.warning(
                "kvmesh gateway %s now keys chunks of %d tokens (was %d)",
                self.config.gateway,
                chunk_size,
                self._chunk_size,
            )
            try:
                self._check_chunk_size(chunk_size)
            except ConnectorError as exc:
                logger.warning("%s", exc)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvmesh will load, and whether async.

        Returns ``(None, False)`` while the lookup is still running (ask again
        later), and ``(0, False)`` when kvmesh cannot help (miss, error,
        timeout). Never blocks beyond one short RPC.
        """
        self._require(KVConnectorRole.SCHEDULER)
        if self._heartbeat is None and self.config.instance_id and self.config.heartbeat_s > 0:
            self._heartbeat = Heartbeat(
                self._beat_as_owner, self.config.heartbeat_s, "kvmesh-heartbeat-scheduler"
            )
            self._heartbeat.start()
        state = self._requests.get(request.request_id)
        if state is None:
            state = RequestState(
                request, lookup_deadline=time.monotonic() + self.config.lookup_timeout_s
            )
            self._requests[request.request_id] = state
        if state.hit_tokens is None and not state.lookup_sent:
            covered = self._own_hit_covers(request, num_computed_tokens)
            # Asked again with less in the engine's cache, what it held then no longer counts.
            state.own_chunk_tokens = covered or 0
            if covered is not None:
                state.local_hit_tokens = num_computed_tokens
                state.num_external_tokens = 0
                return 0, False
        if not request.lookup:
            state.hit_tokens = 0  # the request's own switch: computed without kvmesh
        if state.hit_tokens is None:
            state.hit_tokens = self._poll_lookup(state)
            if state.hit_tokens is None:
                return None, False
        n = request.num_prompt_tokens
        # The last prompt token is always recomputed (its logits are needed), and a
        # load ends on a block boundary (vLLM only counts whole blocks as computed).
        usable = min(state.hit_tokens, n - 1) if n else 0
        usable -= usable % self.config.block_size
        need = max(0, usable - num_computed_tokens)
        state.local_hit_tokens = num_computed_tokens
        state.num_external_tokens = need
        return need, need > 0

    def _own_hit_covers(self, request: Request, num_computed_tokens: int) -> int | None:
        """The prompt's complete-chunk tokens when the engine's own hit holds all of
        them (kvmesh could load nothing, nor store anything new), else None.

        Such a request is not looked up: the lookup's round trip on the engine's
        loop was the connector's whole cost on a hit vLLM served itself
        (docs/performance.md, "When vLLM's own cache holds the prompt"). Asked
        again (a preempted request resumed with less of its prefix in the
        engine's cache), it is looked up then.
        """
        try:
            chunk = self.chunk_size
        except (grpc.RpcError, ConnectorError):
            return None  # the lookup path reports the gateway's state
        complete = (request.num_prompt_tokens // chunk) * chunk
        return complete if num_computed_tokens >= complete else None

    def lookup_result(self, request_id: str) -> LookupResult:
        """What kvmesh reported for a request's lookup (zeros until it finished)."""
        state = self._requests.get(request_id)
        if state is None:
            return LookupResult(0, 0, 0)
        return LookupResult(state.hit_tokens or 0, state.l1_hit_chunks, state.l2_hit_chunks)

    def _poll_lookup(self, state: RequestState) -> int | None:
        """Send the lookup or poll it: hit tokens, or None while it runs."""
        request = state.request
        if self.gateway_down():
            return 0
        asked = time.perf_counter()
        try:
            chunk = self.chunk_size
            if request.num_prompt_tokens < chunk:
                return 0  # no complete chunk: nothing to look up
            if not state.lookup_sent:
                # A session of this id still being ended must end before it starts again.
                self._releases.wait_for(request.request_id, self._timeout or 5.0)
                resp = self.client.lookup(
                    gateway_pb2.LookupRequest(
                        request_id=request.request_id,
                        model_name=self.config.model_name,
                        world_size=self.config.world_size,
                        cache_salt=request.cache_salt + self.namespace,
                        token_ids=request.prompt_token_ids,
                        num_kv_readers=self.config.num_kv_readers,
                        wait_timeout_ms=self.config.lookup_wait_ms,
                        engine_id=self.config.instance_id,
                    ),
                    timeout=self._timeout,
                )
                state.lookup_sent = True
                status = resp.status
            else:
                status = self.client.query_prefetch_status(
                    gateway_pb2.QueryPrefetchStatusRequest(request_id=request.request_id),
                    timeout=self._timeout,
                ).status
        except grpc.RpcError as exc:
            self._note_failure(f"lookup of {request.request_id}", exc)
            return 0
        except ConnectorError as exc:
            logger.warning("lookup of %s failed, recomputing it: %s", request.request_id, exc)
            return 0
        self._note_ok()
        if status.completed:
            logger.debug(
                "lookup %s: %d of %d tokens cached (L1 %d, L2 %d chunks), call %.1f ms",
                request.request_id,
                status.hit_tokens,
                request.num_prompt_tokens,
                status.l1_hit_chunks,
                status.l2_hit_chunks,
                (time.perf_counter() - asked) * 1e3,
            )
            state.l1_hit_chunks = status.l1_hit_chunks
            state.l2_hit_chunks = status.l2_hit_chunks
            return int(status.hit_tokens)
        if time.monotonic() > state.lookup_deadline:
            logger.warning(
                "lookup of %s unfinished after %.1f s, recomputing it",
                request.request_id,
                self.config.lookup_timeout_s,
            )
            return 0
        return None

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Record the request's blocks; free the lookup locks of chunks not retrieved."""
        self._require(KVConnectorRole.SCHEDULER)
        state = self._requests.get(request.request_id)
        if state is None:
            state = RequestState(request, lookup_deadline=0.0, hit_tokens=0)
            self._requests[request.request_id] = state
        state.block_ids = list(block_ids)
        state.allocated_in_step = self._step
        state.stale = False
        state.num_external_tokens = num_external_tokens
        hit = state.hit_tokens or 0
        # What kvmesh holds is never stored again, nor what the engine held when
        # kvmesh was not asked.
        state.stored_tokens = max(hit, state.own_chunk_tokens)
        state.num_computed_tokens = state.local_hit_tokens + num_external_tokens
        if num_external_tokens > 0:
            state.load_pending = True
            # Chunks wholly inside the engine's own prefix hit are not retrieved.
            free_end = (state.local_hit_tokens // self.chunk_size) * self.chunk_size
        else:
            free_end = hit
        if state.lookup_sent and free_end > 0:
            # Nothing waits for the release: it goes off the scheduler's loop, where a
            # round trip held up every request's next step (1-6 ms on a busy 2-core host).
            request_id = request.request_id
            self._releases.submit(request_id, lambda: self._free_locks(request_id, free_end))

    def _free_locks(self, request_id: str, end_token: int) -> None:
        """Release the lookup locks of ``[0, end_token)`` (chunks the engine will not load)."""
        if self.gateway_down():
            return  # EndSession or the session's expiry releases them
        try:
            self.client.free_lookup_locks(
                gateway_pb2.FreeLookupLocksRequest(
                    request_id=request_id, start_token=0, end_token=end_token
                ),
                timeout=self._timeout,
            )
        except grpc.RpcError as exc:
            # Harmless: EndSession (or the session's expiry) releases them.
            logger.warning("freeing lookup locks of %s failed: %s", request_id, rpc_failure(exc))

    def set_block_ids(self, request_id: str, block_ids: Sequence[int]) -> None:
        """The request's whole block table (vLLM: a new or resumed request's blocks)."""
        state = self._requests.get(request_id)
        if state is not None:
            state.block_ids = list(block_ids)

    def extend_block_ids(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Blocks the engine allocated to a request after its first allocation (chunked prefill)."""
        state = self._requests.get(request_id)
        if state is not None:
            state.block_ids.extend(block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        """The retrieves and stores the workers run in this step."""
        self._require(KVConnectorRole.SCHEDULER)
        meta = ConnectorMetadata()
        # The engine's one worker runs this step only after the last one finished, so
        # the blocks allocated for this step's loads are written by nothing else; but a
        # request preempted with stores in flight freed blocks those stores still read
        # (the worker waits for them first), so such a step starts nothing ahead.
        ahead = self._ahead is not None and not any(
            (state := self._requests.get(rid)) is not None and state.stores_emitted
            for rid in scheduler_output.preempted_req_ids
        )
        try:
            self._plan_step(meta, scheduler_output, ahead=ahead)
        finally:
            self._step += 1
        return meta

    def _plan_step(
        self, meta: ConnectorMetadata, scheduler_output: SchedulerOutput, *, ahead: bool
    ) -> None:
        for request_id in sorted(scheduler_output.preempted_req_ids):
            state = self._requests.get(request_id)
            if state is None:
                continue
            # The engine freed the request's blocks; it asks again (and allocates anew)
            # when it resumes the request. A store already started still reads the old
            # blocks: the workers wait for it before the step runs (see worker).
            if state.allocated_in_step != self._step:
                state.block_ids = []
                state.load_pending = False
            # else: preempted and resumed before this step (vLLM's reset_prefix_cache
            # with running requests): its new blocks and load are already recorded.
            if state.stores_emitted:
                meta.preempted.append(request_id)
        computed = scheduler_output.num_computed_tokens
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(request_id)
            if state is None:
                continue
            if request_id in computed:
                state.num_computed_tokens = computed[request_id]
            loading = state.load_pending
            try:
                self._plan(meta, state, scheduled, ahead=ahead)
            except Exception:
                # Never into the engine: a promised load that cannot be planned is a
                # load error (vLLM recomputes those blocks), a store is skipped.
                logger.exception("kvmesh could not plan request %s", request_id)
                state.load_pending = False
                if loading:
                    meta.failed_blocks.extend(state.block_ids)

    def _plan(
        self, meta: ConnectorMetadata, state: RequestState, scheduled: int, *, ahead: bool
    ) -> None:
        """Add a request's retrieve (a pending load) and stores (new prompt chunks) to ``meta``;
        ``ahead``: start the load now (:mod:`kvmesh.connector.ahead`)."""
        bs = self.config.block_size
        request = state.request
        request_id = request.request_id
        if state.load_pending:
            chunk = self.chunk_size
            start = (state.local_hit_tokens // chunk) * chunk
            end = state.hit_tokens or 0
            meta.retrieve_ops.append(
                RetrieveOp(
                    request_id=request_id,
                    token_ids=request.prompt_token_ids[:end],
                    cache_salt=request.cache_salt + self.namespace,
                    start=start,
                    end=end,
                    skip_first_n_tokens=state.local_hit_tokens - start,
                    block_ids=state.block_ids[start // bs : end // bs],
                )
            )
            state.load_pending = False
            if ahead and self._ahead is not None:
                op = meta.retrieve_ops[-1]
                self._ahead.send(self._retrieve_request(self.config.ahead_engine_id, op))
        state.num_computed_tokens += scheduled
        if state.load_dropped or state.stale:
            state.load_dropped = False
            return  # computed over blocks no load filled (drop_load), or before a reset
        if not request.store:
            return  # the request's own switch: kept out of kvmesh
        if (
            self.config.store_after_prefill
            and state.num_computed_tokens < request.num_prompt_tokens
        ):
            return  # stored in the step that finishes the prefill
        limit = min(
            request.num_prompt_tokens,  # only prompt chunks (save_decode_cache = false)
            len(state.block_ids) * bs,
            state.num_computed_tokens,
        )
        try:
            end = (limit // self.chunk_size) * self.chunk_size
        except (grpc.RpcError, ConnectorError) as exc:
            # The unreachable gateway was reported once (gateway_down's back-off).
            logger.debug("cannot plan stores of %s: %s", request_id, exc)
            return
        if end > state.stored_tokens:
            start = state.stored_tokens
            meta.store_ops.append(
                StoreOp(
                    request_id=request_id,
                    token_ids=request.prompt_token_ids[:end],
                    cache_salt=request.cache_salt + self.namespace,
                    start=start,
                    end=end,
                    block_ids=state.block_ids[start // bs : end // bs],
                )
            )
            state.stored_tokens = end
            state.stores_emitted = True

    def drop_load(self, request_id: str) -> None:
        """Forget a request's pending load (the caller reports its blocks as load errors)."""
        state = self._requests.get(request_id)
        if state is not None:
            state.load_pending = False
            state.load_dropped = True

    def fail_pending_loads(self) -> ConnectorMetadata:
        """A step that could not be planned: every pending load's blocks as load errors."""
        meta = ConnectorMetadata()
        for state in self._requests.values():
            if state.load_pending:
                state.load_pending = False
                meta.failed_blocks.extend(state.block_ids)
        return meta

    def reset_cache(self) -> int:
        """The engine cleared its caches (new weights): never load or store older KV again.

        kvmesh's cache is shared by every engine of the model, so nothing is
        deleted: this engine moves to a key namespace of its own (a suffix on
        every request's salt) and, from now on, neither finds what was stored
        before nor stores where engines without the reset look. Requests it
        already knows are looked up again in the new namespace (their sessions
        end); one whose blocks still hold older KV is not stored until the
        engine allocates it anew. Returns how many requests were forgotten.
        See docs/vllm.md, "Cache resets".
        """
        self._require(KVConnectorRole.SCHEDULER)
        self.namespace = f"\x1freset:{uuid.uuid4().hex[:12]}"
        deadline = time.monotonic() + self.config.lookup_timeout_s
        for request_id, state in self._requests.items():
            if state.lookup_sent:
                self._releases.submit(request_id, functools.partial(self._end_session, request_id))
            state.forget_lookup(deadline)
        logger.warning(
            "kvmesh: the engine reset its caches; from now on it uses its own key namespace "
            "(%d requests looked up again)",
            len(self._requests),
        )
        return len(self._requests)

    def request_finished(self, request: Request) -> bool:
        """End the request's session; True when its blocks must wait for a store to finish.

        ``EndSession`` is queued and sent from a thread of its own: nothing the
        scheduler does next needs its answer, and on the engine's loop it held up
        every other request's next step for a round trip (about 1 ms on a busy
        2-core host). Its failure changes nothing: the session's expiry releases
        what it holds."""
        self._require(KVConnectorRole.SCHEDULER)
        state = self._requests.pop(request.request_id, None)
        request_id = request.request_id
        if state is not None and not request.lookup and not state.stores_emitted:
            return False  # switched off and never stored: the gateway holds no session
        self._releases.submit(request_id, lambda: self._end_session(request_id))
        return state is not None and state.stores_emitted

    def flush_releases(self, timeout: float = 5.0) -> None:
        """Send every queued release (``FreeLookupLocks``, ``EndSession``) now and stop
        their thread (the connector's shutdown; later ones are sent at once, from the
        caller)."""
        self._releases.close(timeout)

    def _end_session(self, request_id: str) -> None:
        if self.gateway_down():
            return  # the gateway's session expiry releases whatever is left
        try:
            self.client.end_session(
                gateway_pb2.EndSessionRequest(request_id=request_id), timeout=self._timeout
            )
        except grpc.RpcError as exc:
            # The gateway's session expiry releases whatever is left. An unreachable
            # gateway starts the back-off: the next ones (a shutdown ends every open
            # session) are skipped rather than each waiting out its deadline.
            self._note_failure(f"ending session {request_id}", exc)
