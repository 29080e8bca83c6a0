"""A minimal inference engine: the tiny model, its paged KV cache and a vLLM-shaped step loop.

Each request goes through the steps vLLM takes with a KV connector:

scheduler: ``get_num_new_matched_tokens`` (asked again while it says "later")
→ allocate blocks → ``update_state_after_alloc`` → ``build_connector_meta``;
worker: ``start_load_kv`` → ``wait_for_load`` (a short load lowers the
computed prefix to the first missing block) → prefill the rest → ``save_kv`` →
``wait_for_save``; then optional greedy decode steps and
``request_finished``, after which the blocks are freed.

Without a connector the engine simply prefills everything; that is the
reference the cache-hit runs are compared against.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from kvmesh.connector import (
    KVConnectorRole,
    KVMeshConnector,
    KVMeshConnectorConfig,
    Request,
    SchedulerOutput,
)
from kvmesh.engine.kv_cache import BlockAllocator, SharedKVCache, blocks_needed
from kvmesh.engine.model import ModelConfig, ProgressFn, TinyTransformer
from kvmesh.gateway.client import GatewayClient

logger = logging.getLogger(__name__)

_POLL_FIRST_S = 0.0005
_POLL_MAX_S = 0.02


@dataclass(frozen=True)
class EngineConfig:
    """The engine: model, KV cache geometry and how it reaches kvmesh."""

    model: ModelConfig = field(default_factory=ModelConfig)
    #: Name the KV is cached under (vLLM: model_config.model); None: ``model.name``,
    #: so KV of another configuration or seed is never served.
    model_name: str | None = None
    num_blocks: int = 2048
    block_size: int = 16
    #: Prefill tile; kvmesh's chunk size, so cache hits start on a tile boundary.
    prefill_chunk_size: int = 256
    shm_dir: str = "/dev/shm"
    #: Gateway address; None runs without kvmesh.
    gateway: str | None = None
    lookup_timeout_s: float = 30.0
    rpc_timeout_s: float | None = None
    #: The scheduler starts each load as it allocates the blocks and the worker's
    #: Retrieve joins it (docs/vllm.md, "Loads started by the scheduler"). This engine
    #: runs both halves on one thread, one after the other, so it gains nothing; tests
    #: turn it on to run the path against real servers.
    load_ahead: bool = False


@dataclass
class RequestOutput:
    """What one request produced and how long it took."""

    request_id: str
    prompt_tokens: int
    #: Logits of the last prompt token, [vocab_size].
    logits: torch.Tensor
    #: Seconds from arrival to the last prompt token's logits (lookup + load + prefill).
    ttft_s: float
    #: Prompt tokens whose KV came from kvmesh and were not recomputed.
    tokens_from_cache: int
    #: Tokens kvmesh reported cached (chunk multiple; the last token is recomputed anyway).
    lookup_hit_tokens: int
    #: Of the cached chunks, how many kvmesh loaded from L2 (the rest were in L1).
    lookup_l2_hit_chunks: int
    lookup_s: float
    load_s: float
    prefill_s: float
    store_s: float
    load_failed: bool = False
    store_failed: bool = False
    output_token_ids: list[int] = field(default_factory=list)


class Engine:
    """Runs requests one at a time through the model, optionally with a kvmesh connector."""

    def __init__(self, config: EngineConfig, *, client: GatewayClient | None = None) -> None:
        """Build the model and KV cache; with ``config.gateway``, register with kvmesh.

        ``client`` replaces the connectors' own gateway clients (tests pass a fake).
        """
        self.config = config
        self.model = TinyTransformer(config.model)
        m = config.model
        self.kv = SharedKVCache(
            num_layers=m.num_layers,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            shm_dir=config.shm_dir,
        )
        self.allocator = BlockAllocator(config.num_blocks)
        self.scheduler_connector: KVMeshConnector | None = None
        self.worker_connector: KVMeshConnector | None = None
        try:
            if config.gateway is not None:
                self._connect(config.gateway, client)
        except BaseException:
            self.close()
            raise

    def _connect(self, gateway: str, client: GatewayClient | None) -> None:
        conn = KVMeshConnectorConfig(
            gateway=gateway,
            model_name=self.config.model_name or self.config.model.name,
            block_size=self.config.block_size,
            lookup_timeout_s=self.config.lookup_timeout_s,
            rpc_timeout_s=self.config.rpc_timeout_s,
        )
        self.worker_connector = KVMeshConnector(conn, KVConnectorRole.WORKER, client=client)
        names = self.kv.named_layers()
        regions = dict(zip(names, self.kv.regions(), strict=True))
        self.worker_connector.register_kv_caches(names, regions)
        ahead = self.worker_connector.engine_id if self.config.load_ahead else ""
        self.scheduler_connector = KVMeshConnector(
            replace(conn, ahead_engine_id=ahead), KVConnectorRole.SCHEDULER, client=client
        )
        chunk = self.worker_connector.chunk_size
        if chunk != self.config.prefill_chunk_size:
            logger.warning(
                "prefill chunk %d differs from kvmesh's chunk size %d: partly cached tiles "
                "are recomputed",
                self.config.prefill_chunk_size,
                chunk,
            )

    def close(self) -> None:
        """Unregister from kvmesh and remove the shared-memory KV file."""
        for conn in (self.scheduler_connector, self.worker_connector):
            if conn is not None:
                conn.shutdown()
        self.scheduler_connector = self.worker_connector = None
        self.kv.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _match(self, request: Request) -> int:
        """Ask the scheduler connector until it answers (it enforces its own deadline)."""
        assert self.scheduler_connector is not None
        pause = _POLL_FIRST_S
        while True:
            external, _ = self.scheduler_connector.get_num_new_matched_tokens(request, 0)
            if external is not None:
                return external
            # A real scheduler would run other requests this step; we have none.
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        request_id: str | None = None,
        cache_salt: str = "",
        max_new_tokens: int = 0,
        on_progress: ProgressFn | None = None,
    ) -> RequestOutput:
        """Serve one request: prefill (loading what kvmesh has), then greedy decode."""
        arrived = time.perf_counter()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("empty prompt")
        request = Request(
            request_id or f"req-{uuid.uuid4().hex}", list(prompt_token_ids), cache_salt
        )
        sched, worker = self.scheduler_connector, self.worker_connector
        blocks: list[int] = []
        load_failed = store_failed = False
        try:
            # No local prefix cache: every request starts with 0 computed tokens.
            external = self._match(request) if sched is not None else 0
            lookup = sched.lookup_result(request.request_id) if sched is not None else None
            lookup_done = time.perf_counter()
            blocks = self.allocator.allocate(
                blocks_needed(n + max_new_tokens, self.config.block_size)
            )
            request.block_ids = blocks
            computed = external
            load_done = lookup_done
            step = None
            if sched is not None and worker is not None:
                sched.update_state_after_alloc(request, blocks, external)
                step = sched.build_connector_meta(
                    SchedulerOutput({request.request_id: n - external})
                )
                worker.start_load_kv(step)
                if worker.wait_for_load():
                    load_failed = True
                    bad = worker.get_block_ids_with_load_errors()
                    first_bad = min((i for i, b in enumerate(blocks) if b in bad), default=0)
                    computed = min(computed, first_bad * self.config.block_size)
                    logger.warning(
                        "request %s: load fell short, recomputing from token %d",
                        request.request_id,
                        computed,
                    )
                load_done = time.perf_counter()
            logits = self.model.prefill(
                request.prompt_token_ids,
                self.kv.layers,
                blocks,
                num_computed_tokens=computed,
                tile_size=self.config.prefill_chunk_size,
                on_progress=on_progress,
            )
            first_token = time.perf_counter()
            if worker is not None and step is not None:
                worker.save_kv(step)
                store_failed = bool(worker.wait_for_save())
            stored = time.perf_counter()
            output = self._decode(request, logits, max_new_tokens)
        finally:
            # Also on failure: ending the session releases the lookup's locks now.
            # request_finished says whether the blocks must outlive a store in flight.
            if sched is not None and sched.request_finished(request) and worker is not None:
                worker.wait_for_save()
            self.allocator.free(blocks)
        return RequestOutput(
            request_id=request.request_id,
            prompt_tokens=n,
            logits=logits,
            ttft_s=first_token - arrived,
            tokens_from_cache=computed,
            lookup_hit_tokens=lookup.hit_tokens if lookup else 0,
            lookup_l2_hit_chunks=lookup.l2_hit_chunks if lookup else 0,
            lookup_s=lookup_done - arrived,
            load_s=load_done - lookup_done,
            prefill_s=first_token - load_done,
            store_s=stored - first_token,
            load_failed=load_failed,
            store_failed=store_failed,
            output_token_ids=output,
        )

    def _decode(self, request: Request, logits: torch.Tensor, max_new_tokens: int) -> list[int]:
        """Greedy decode (decode steps carry no connector work: only prompt chunks are saved)."""
        tokens: list[int] = []
        position = request.num_prompt_tokens
        while len(tokens) < max_new_tokens:
            token = int(torch.argmax(logits))
            tokens.append(token)
            if len(tokens) == max_new_tokens:
                break
            logits = self.model.decode(token, position, self.kv.layers, request.block_ids)
            position += 1
        return tokens
