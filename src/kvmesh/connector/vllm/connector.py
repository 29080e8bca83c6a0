"""``KVMeshConnector``: kvmesh as a vLLM 0.32 KV connector (``KVConnectorBase_V1``).

Load it by module path::

    --kv-transfer-config '{"kv_connector": "KVMeshConnector",
                           "kv_connector_module_path": "kvmesh.connector.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"gateway": "127.0.0.1:8302"}}'

This class only translates vLLM's objects; the hooks themselves are
:class:`kvmesh.connector.KVMeshConnector` (lookups, plans, sessions, loads and
stores over the typed gateway client). What it adds for vLLM:

- **Zero copy on CPU.** :meth:`get_mem_pool_context` makes vLLM allocate its KV
  cache in a shared-memory file (:mod:`.shm_pool`); the worker registers that
  file with the layout vLLM's CPU attention uses (``VLLM_CPU`` for its "vec"
  ISA, ``VLLM_CPU_AMX`` on x86 with AMX) and storage copies blocks in and out.
- **CUDA IPC on GPUs** (:mod:`.cuda`): one IPC handle per layer, and an
  interprocess event on vLLM's stream with every load and save.
- **Stores after the prefill.** By default a prompt is stored in the step
  that finishes its prefill (``store_after_prefill``), not beside the next
  prefill step's forward.
- **Loads by layer, saves asynchronous.** A hit is loaded in the step that
  computes the rest of its prompt: :meth:`start_load_kv` sends it in parts by
  layers and returns, and each layer's attention waits for its own part
  (:meth:`wait_for_layer_load`), so the forward pass runs beside the copy
  (``load_by_layer``: by default on GPUs; on CPUs the whole load finishes
  before the forward pass unless it is set to true).
  Stores start after the forward (:meth:`wait_for_save`) and finish in the
  background; a finished request whose stores still run keeps its blocks
  until :meth:`get_finished` reports it.
- **kvmesh never fails a request.** Every RPC has a deadline; an unreachable
  gateway makes lookups misses (one warning, then a back-off); a failed load is
  reported through :meth:`get_block_ids_with_load_errors` and vLLM recomputes
  it (the connector sets ``kv_load_failure_policy`` to ``recompute`` unless
  ``keep_failure_policy`` is set).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import grpc
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole as VLLMRole,
)

from kvmesh.api.common.v1 import common_pb2
from kvmesh.connector.core import KVMeshConnector as Hooks
from kvmesh.connector.metadata import ConnectorMetadata, Request, SchedulerOutput
from kvmesh.connector.request_options import request_options
from kvmesh.connector.types import KVConnectorRole, KVMeshConnectorConfig, rpc_failure
from kvmesh.connector.vllm.cuda import StreamEvents
from kvmesh.connector.vllm.layouts import cache_salt
from kvmesh.connector.vllm.registration import (
    UnsupportedConfig,
    describe_cpu,
    describe_cuda,
    distinct_layers,
    layer_indices,
)
from kvmesh.connector.vllm.rope import rope_parameters
from kvmesh.connector.vllm.settings import VLLMSettings, loads_by_layer, parse_settings
from kvmesh.connector.vllm.shm_pool import SharedMemoryPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput as VLLMSchedulerOutput
    from vllm.v1.request import Request as VLLMRequest

logger = logging.getLogger(__name__)


class KVMeshMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's retrieves and stores, sent from the scheduler to the workers (pickled)."""

    def __init__(self, ops: ConnectorMetadata) -> None:
        self.ops = ops


class KVMeshConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvmesh behind vLLM's KV-connector API (one instance per role and process)."""

    def __init__(
        self, vllm_config: VllmConfig, role: VLLMRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.settings: VLLMSettings = parse_settings(transfer.kv_connector_extra_config)
        _show_kvmesh_logs(self.settings.log_level)
        _check_supported(vllm_config, kv_cache_config)
        parallel = vllm_config.parallel_config
        self._on_cpu = vllm_config.device_config.device_type == "cpu"
        is_scheduler = role == VLLMRole.SCHEDULER
        # One id for the engine instance, the same in its scheduler and its workers.
        instance = str(getattr(transfer, "engine_id", "") or "")
        rank = _worker_rank()
        config = KVMeshConnectorConfig(
            gateway=self.settings.gateway,
            model_name=self.settings.model_name or str(vllm_config.model_config.model),
            block_size=vllm_config.cache_config.block_size,
            world_size=parallel.world_size,
            worker_id=rank,
            engine_id=f"{instance}-worker-{rank}" if instance and not is_scheduler else "",
            instance_id=instance,
            lookup_timeout_s=self.settings.lookup_timeout_s,
            lookup_wait_ms=self.settings.lookup_wait_ms,
            rpc_timeout_s=self.settings.rpc_timeout_s,
            register_timeout_s=self.settings.register_timeout_s,
            transfer_threads=self.settings.transfer_threads,
            store_after_prefill=self.settings.store_after_prefill,
            heartbeat_s=self.settings.heartbeat_s,
            ahead_engine_id=self._ahead_engine_id(vllm_config, instance) if is_scheduler else "",
        )
        self.hooks = Hooks(
            config, KVConnectorRole.SCHEDULER if is_scheduler else KVConnectorRole.WORKER
        )
        self._requests: dict[str, Request] = {}
        self._asked: dict[str, float] = {}
        self._pool: SharedMemoryPool | None = None
        self._storing: set[str] = set()
        self._finished: set[str] = set()
        # Blocks of loads the scheduler promised but could not plan: reported as load
        # errors by the workers, so vLLM recomputes them (never reads unloaded blocks).
        self._unplanned: list[int] = []
        # Worker: each KV layer name's index in the registration (loads by layer wait on it),
        # and whether this step's loads are still running beside its forward pass.
        self._layer_index: dict[str, int] = {}
        self._loading = False
        self._load_started = 0.0
        self._load_tokens = 0
        self._load_waited = 0.0
        self._by_layer = False
        # GPU: events on vLLM's stream that order storage's copies (None on CPU).
        self._events: StreamEvents | None = None
        # Sent with the KV registration so the node can move CacheBlend segments.
        self._rope, no_rope = rope_parameters(
            vllm_config.model_config.hf_config, vllm_config.model_config.get_head_size()
        )
        if self._rope is None and not is_scheduler:
            logger.info("kvmesh: no RoPE parameters registered (%s); segments are off", no_rope)
        if is_scheduler:
            self._prefer_recompute(transfer)
        elif self._on_cpu:
            self._pool = SharedMemoryPool(self.settings.shm_dir, named=self.settings.named_kv_file)
        logger.info(
            "kvmesh connector (%s) for model %s, gateway %s",
            "scheduler" if is_scheduler else "worker",
            config.model_name,
            config.gateway,
        )

    def _ahead_engine_id(self, vllm_config: VllmConfig, instance: str) -> str:
        """The worker whose loads the scheduler starts ahead ("": none; see settings'
        ``load_ahead``): a CPU engine (KV in shared memory), one worker, whole loads."""
        if not (self.settings.load_ahead and instance and self._on_cpu):
            return ""
        parallel = vllm_config.parallel_config
        if parallel.world_size != 1 or getattr(parallel, "data_parallel_size", 1) != 1:
            return ""
        if getattr(vllm_config.scheduler_config, "async_scheduling", False):
            return ""  # the worker may still run the last step while this one is planned
        if loads_by_layer(self.settings.load_by_layer, "cpu"):
            return ""
        return f"{instance}-worker-0"

    def _prefer_recompute(self, transfer: Any) -> None:
        if transfer.kv_load_failure_policy == "fail" and not self.settings.keep_failure_policy:
            # vLLM's scheduler reads the policy right after building this connector.
            transfer.kv_load_failure_policy = "recompute"
            logger.info(
                "kvmesh is a cache: a block that fails to load is recomputed "
                "(kv_load_failure_policy=recompute; set keep_failure_policy to keep 'fail')"
            )

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is a future miss, never a wrong answer."""
        return False

    # ------------------------------------------------------------------ scheduler
    #
    # Nothing raises into vLLM: a failure becomes a miss (recompute) and a log line.

    def _plain(self, request: VLLMRequest) -> Request:
        plain = self._requests.get(request.request_id)
        if plain is None:
            options = request_options(
                getattr(request, "kv_transfer_params", None), request.request_id
            )
            plain = Request(
                request_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids or ()),
                cache_salt=cache_salt(request),
                lookup=options.lookup,
                store=options.store,
            )
            self._requests[request.request_id] = plain
        return plain

    def get_num_new_matched_tokens(
        self, request: VLLMRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens kvmesh supplies beyond vLLM's own hit; None while the lookup runs."""
        if not request.prompt_token_ids:
            return 0, False  # prompt embeddings: nothing to key on
        try:
            plain = self._plain(request)
            tokens, _ = self.hooks.get_num_new_matched_tokens(plain, num_computed_tokens)
        except Exception:
            logger.exception("kvmesh lookup of %s failed; recomputing it", request.request_id)
            return 0, False
        if tokens is not None:
            first = self._asked.pop(request.request_id, None)
            logger.debug(
                "lookup of %s: %d tokens from kvmesh (%.1f ms after the first ask)",
                request.request_id,
                tokens,
                (time.perf_counter() - first) * 1e3 if first is not None else 0.0,
            )
        else:
            self._asked.setdefault(request.request_id, time.perf_counter())
        return tokens, False  # loaded before the forward pass that needs them

    def update_state_after_alloc(
        self, request: VLLMRequest, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = blocks.get_block_ids()[0] if blocks is not None else []
        try:
            self.hooks.update_state_after_alloc(
                self._plain(request), block_ids, num_external_tokens
            )
        except Exception:
            logger.exception("kvmesh could not plan the load of %s", request.request_id)
            if num_external_tokens > 0:  # vLLM counts them loaded: make it recompute them
                self.hooks.drop_load(request.request_id)
                self._unplanned.extend(block_ids)

    def build_connector_meta(self, scheduler_output: VLLMSchedulerOutput) -> KVMeshMetadata:
        try:
            computed: dict[str, int] = {}
            for new in scheduler_output.scheduled_new_reqs:
                self.hooks.set_block_ids(new.req_id, new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
            cached = scheduler_output.scheduled_cached_reqs
            for i, request_id in enumerate(cached.req_ids):
                computed[request_id] = cached.num_computed_tokens[i]
                new_ids = cached.new_block_ids[i]
                if new_ids is None:
                    continue
                if request_id in cached.resumed_req_ids:
                    self.hooks.set_block_ids(request_id, new_ids[0])
                else:
                    self.hooks.extend_block_ids(request_id, new_ids[0])
            plan = self.hooks.build_connector_meta(
                SchedulerOutput(
                    num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
                    preempted_req_ids=frozenset(scheduler_output.preempted_req_ids or ()),
                    num_computed_tokens=computed,
                )
            )
        except Exception:
            logger.exception("kvmesh could not plan this step's loads and stores")
            plan = self.hooks.fail_pending_loads()
        plan.failed_blocks.extend(self._unplanned)
        self._unplanned = []
        return KVMeshMetadata(plan)

    def reset_cache(self) -> bool | None:
        """vLLM cleared its caches (a weight update): never load, nor share, older KV."""
        if self.hooks.role is not KVConnectorRole.SCHEDULER:
            return None
        try:
            self.hooks.reset_cache()
        except Exception:
            logger.exception("kvmesh could not reset its cache")
            return False  # vLLM reports the reset as failed rather than serve older KV
        return True

    def request_finished(
        self, request: VLLMRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """End the session; keep the blocks while the request's stores still run."""
        plain = self._requests.pop(request.request_id, None) or self._plain(request)
        self._requests.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        return self.hooks.request_finished(plain), None

    # --------------------------------------------------------------------- worker

    def get_mem_pool_context(self) -> SharedMemoryPool | None:
        return self._pool

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register vLLM's KV memory with the gateway (the storage node maps it).

        A configuration kvmesh does not serve stops vLLM here, with one line
        (:class:`UnsupportedConfig`); an unreachable gateway does not: the
        heartbeat registers once it answers.
        """
        layers = distinct_layers(kv_caches)
        self._layer_index = layer_indices(kv_caches)
        self._by_layer = loads_by_layer(self.settings.load_by_layer, layers[0].device.type)
        block_size = self.hooks.config.block_size
        if layers[0].device.type == "cuda":
            layout, handles = describe_cuda(layers, block_size)
            self._events = StreamEvents()
        elif self._pool is None or self._pool.buffer is None:
            logger.warning(
                "kvmesh: vLLM's KV cache is not in shared memory (device %s, or %s could not "
                "hold it); kvmesh stays off for this engine",
                layers[0].device.type,
                self.settings.shm_dir,
            )
            return
        else:
            layout, handles = describe_cpu(layers, self._pool, block_size)
        if self._rope is not None and layout.kind != common_pb2.KV_LAYOUT_KIND_MLA:
            layout.rope.CopyFrom(self._rope)
        try:
            self.hooks.register_memory(layout, handles)
        except grpc.RpcError as exc:
            logger.warning(
                "kvmesh gateway %s did not take the KV registration (%s); requests are "
                "computed as without kvmesh, and the registration is retried in the background",
                self.settings.gateway,
                rpc_failure(exc),
            )
        except Exception:
            logger.exception("kvmesh could not register the KV memory; retrying in the background")

    def _producer_event(self) -> bytes:
        """GPU: an event after the work queued on vLLM's stream so far (b"" on CPU)."""
        return self._events.record() if self._events is not None else b""

    def _metadata(self) -> ConnectorMetadata | None:
        meta = self._get_connector_metadata()
        return meta.ops if isinstance(meta, KVMeshMetadata) else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step runs: finish the stores still reading preempted requests' blocks.

        vLLM frees a preempted request's blocks at once; this step's forward
        pass (or a load) may write them, so a store still copying out of them
        would save another request's KV under this prompt's keys.
        """
        if not isinstance(kv_connector_metadata, KVMeshMetadata):
            return
        preempted = kv_connector_metadata.ops.preempted
        if preempted:
            try:
                waited = self.hooks.finish_saves_of(preempted)
            except Exception:
                logger.exception("kvmesh: waiting for the stores of preempted requests failed")
                return
            logger.debug("%d preempted requests; waited for %d stores", len(preempted), waited)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's hits into their blocks before the forward pass runs."""
        ops = self._metadata()
        if ops is None:
            return
        self.hooks.note_load_errors(ops.failed_blocks)
        if not ops.retrieve_ops:
            return
        self._load_started = time.perf_counter()
        self._load_waited = 0.0
        self._load_tokens = sum(
            op.end - op.start - op.skip_first_n_tokens for op in ops.retrieve_ops
        )
        try:
            self.hooks.start_load_kv(ops, self._producer_event(), by_layer=self._by_layer)
        except Exception:
            logger.exception("kvmesh loads failed; vLLM recomputes their blocks")
            self.hooks.fail_loads(ops.retrieve_ops)
            return
        self._loading = True
        if not self._by_layer:
            self._finish_loads()  # the forward pass waits for all of it, here

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer's attention: wait until this step's loads have written its KV."""
        if self._loading:
            start = time.perf_counter()
            self.hooks.wait_for_layer(self._layer_index.get(layer_name))
            self._load_waited += time.perf_counter() - start

    def _finish_loads(self) -> None:
        """Wait for the rest of this step's loads and note the blocks they failed to fill.

        Runs before anything reports the step to vLLM (stores, finished requests,
        load errors): a layer the forward pass did not wait for is waited for here.
        """
        if not self._loading:
            return
        self._loading = False
        start = time.perf_counter()
        try:
            failed = self.hooks.wait_for_load()
        except Exception:
            logger.exception("kvmesh loads failed; vLLM recomputes their blocks")
            return
        if not self._by_layer:
            self._load_waited = time.perf_counter() - start
        logger.debug(
            "loaded %d tokens, done %.1f ms after the load began; the forward pass waited "
            "%.1f ms for it (%d requests fell short)",
            self._load_tokens,
            (time.perf_counter() - self._load_started) * 1e3,
            self._load_waited * 1e3,
            len(failed),
        )

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the whole step's chunks are stored at once in wait_for_save

    def wait_for_save(self) -> None:
        """Start storing this step's newly computed chunks; they finish in the background."""
        self._finish_loads()
        ops = self._metadata()
        if ops is None or not ops.store_ops:
            return
        start = time.perf_counter()
        # Counted first: a request that asked vLLM to keep its blocks is always reported.
        self._storing.update(op.request_id for op in ops.store_ops)
        try:
            self.hooks.save_kv(ops, self._producer_event())
        except Exception:
            logger.exception("kvmesh could not start this step's stores; they are skipped")
            return
        logger.debug(
            "started %d stores (%d tokens) in %.2f ms",
            len(ops.store_ops),
            sum(op.end - op.start for op in ops.store_ops),
            (time.perf_counter() - start) * 1e3,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose stores are done (vLLM may free their blocks now)."""
        self._finish_loads()
        self._finished.update(finished_req_ids & self._storing)
        _, running = self.hooks.poll_saves()
        ready = {r for r in self._finished if r not in running}
        self._finished -= ready
        self._storing -= ready
        return (ready or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        return self.hooks.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        try:
            self.hooks.shutdown()
        except Exception:
            logger.exception("kvmesh connector shutdown failed")
        if self._pool is not None:
            self._pool.close()


def _check_supported(vllm_config: VllmConfig, kv_cache_config: Any) -> None:
    """Stop vLLM at start, with one line, on a configuration kvmesh does not serve."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise UnsupportedConfig(
            f"kvmesh serves models with one KV cache group; this one has {len(groups)} "
            "(hybrid attention): run it without --kv-transfer-config"
        )
    if getattr(vllm_config.model_config, "use_mla", False):
        raise UnsupportedConfig(
            "kvmesh does not serve MLA models yet: run this one without --kv-transfer-config"
        )


def _show_kvmesh_logs(level: str) -> None:
    """Give kvmesh's loggers a handler in vLLM's processes (vLLM configures only its own)."""
    root = logging.getLogger("kvmesh")
    root.setLevel(level.upper())
    if not any(getattr(h, "kvmesh_vllm", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [kvmesh pid=%(process)d] %(message)s")
        )
        handler.kvmesh_vllm = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False


def _worker_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, RuntimeError):
        return 0  # the scheduler process has no parallel state
