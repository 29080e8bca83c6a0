"""The engine registry: who registered which layout, who is alive, who is reaped.

Two kinds of engine register here. An LMCache-driven engine registers its KV
memory, which storage maps (``register_kv_cache``); an engine-driven context
only tells its geometry and copies chunk bytes itself through the slots
storage hands out (``register_engine_context``).

Liveness: every call an engine makes, and its heartbeat (``Ping``), refresh
it; an engine silent for ``reap_after_s`` is reaped by the sweep — its KV
memory unmapped in storage, so a killed engine's memory comes back without
anyone's help. Schedulers are tracked the same way under the *owner* id their
lookups carry (vLLM: the instance id its scheduler and workers share): an
owner silent for ``reap_after_s`` is handed to ``on_owner_gone``, which ends
its sessions and leases. Each reap is logged once and counted.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvmesh.api.common.v1 import common_pb2
from kvmesh.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from kvmesh.common.keys import validate_model_name

from .node_storage import NodeStorage
from .types import EngineSpec, GatewayStats

logger = logging.getLogger(__name__)

#: Ids of gone engines remembered to count re-registrations.
_GONE_KEPT = 4096
#: An engine-driven layout's bounds: storage's (its KV layouts have at most 4096
#: layers, its objects at most 2 GiB), so a registration storage would refuse every
#: chunk of is refused here, before it sizes every lookup of its model.
_MAX_LAYERS = 4096
_MAX_HEAD_WIDTH = 1 << 16
_MAX_CHUNK_BYTES = 1 << 31


@dataclass(slots=True)
class RegisteredEngine:
    """An engine as the gateway knows it."""

    spec: EngineSpec
    engine_driven: bool
    chunk_bytes: int
    chunk_shape: tuple[int, ...]
    registered_at: float
    last_seen: float
    pinged: bool = False
    fingerprint: object = None
    #: Layers of the KV memory it registered (0 for an engine-driven context).
    num_layers: int = 0
    #: Its KV memory is host memory (shared memory), which a copy may write at any
    #: time; not GPU memory, whose writes must follow the engine's own kernels.
    host_memory: bool = False
    #: What its chunks' bytes mean (dtype, planes, layers, heads, head dim; () unknown).
    kv_format: tuple[int, ...] = ()


class EngineRegistry:
    """Registered engines by id, and the node instance id storage reported."""

    def __init__(
        self,
        storage: NodeStorage,
        counters: GatewayStats,
        *,
        chunk_size: int,
        reap_after_s: float,
        clock: Callable[[], float],
        on_owner_gone: Callable[[str], Awaitable[object]] | None = None,
    ) -> None:
        self.storage = storage
        self.counters = counters
        self.chunk_size = chunk_size
        self.reap_after_s = reap_after_s
        self._clock = clock
        self._engines: dict[str, RegisteredEngine] = {}
        # Ids registered before and gone since (reaped, unregistered): a later
        # registration of one counts as a re-registration. Bounded, oldest out.
        self._gone: OrderedDict[str, None] = OrderedDict()
        # Owners (schedulers) by id → last seen; see the module docstring.
        self._owners: dict[str, float] = {}
        # Engines forgotten whose unmapping storage did not confirm: retried each sweep,
        # or the node would keep a gone engine's memory mapped for its whole life.
        self._unmap_owed: set[str] = set()
        self.on_owner_gone = on_owner_gone
        self.storage_instance_id = ""

    def __len__(self) -> int:
        return len(self._engines)

    def ids(self) -> list[str]:
        """Registered engines."""
        return sorted(self._engines)

    # ------------------------------------------------------------ registration

    def _check_block_size(self, block_size: int) -> None:
        if block_size < 1:
            raise InvalidArgument("block_size must be >= 1", field="layout.block_size")
        if self.chunk_size % block_size != 0:
            raise InvalidArgument(
                f"the gateway's chunk size {self.chunk_size} is not a multiple of the engine's "
                f"block size {block_size}; configure chunk_size as a multiple of it",
                field="layout.block_size",
                reason="CHUNK_SIZE_MISMATCH",
            )

    def _check_spec(self, spec: EngineSpec) -> None:
        if not spec.engine_id:
            raise InvalidArgument("engine_id must not be empty", field="engine_id")
        validate_model_name(spec.model_name)
        if spec.world_size < 1 or spec.world_size > 255:
            raise InvalidArgument("world_size must be in [1, 255]", field="world_size")
        if not 0 <= spec.worker_id < spec.world_size:
            raise InvalidArgument(
                f"worker_id {spec.worker_id} is outside world_size {spec.world_size}",
                field="worker_id",
            )
        self._check_block_size(spec.block_size)

    async def register_kv_cache(
        self,
        spec: EngineSpec,
        registration: object,
        fingerprint: object,
        chunk_bytes: int = 0,
        num_layers: int = 0,
        host_memory: bool = False,
        kv_format: tuple[int, ...] = (),
    ) -> bool:
        """Register an engine's KV memory (LMCache-driven path); True if already registered.

        ``storage_instance_id`` is learned from the node's answer.

        ``registration`` is forwarded to storage untouched; ``fingerprint``
        identifies the layout so a re-register with another one is refused.
        """
        self._check_spec(spec)
        self._check_kv_format(spec, kv_format)
        self._unmap_owed.discard(spec.engine_id)  # registered again: its memory is in use
        existing = self._engines.get(spec.engine_id)
        if existing is not None and (existing.spec != spec or existing.fingerprint != fingerprint):
            raise AlreadyExists(
                f"engine {spec.engine_id!r} is registered with a different layout; "
                "unregister it first",
                reason="ENGINE_LAYOUT_MISMATCH",
                metadata={"engine_id": spec.engine_id},
            )
        already, self.storage_instance_id = await self.storage.register_engine(
            spec.engine_id, registration
        )
        now = self._clock()
        if existing is None:
            if spec.engine_id in self._gone:
                del self._gone[spec.engine_id]
                self.counters.reregistrations += 1
            self._engines[spec.engine_id] = RegisteredEngine(
                spec, False, chunk_bytes, (), now, now, fingerprint=fingerprint,
                num_layers=num_layers, host_memory=host_memory, kv_format=kv_format,
            )  # fmt: skip
            logger.info(
                "engine %s registered: model %s, worker %d/%d, block size %d",
                spec.engine_id,
                spec.model_name,
                spec.worker_id,
                spec.world_size,
                spec.block_size,
            )
        else:
            existing.last_seen = now
        return already or existing is not None

    async def unregister_kv_cache(self, engine_id: str) -> bool:
        """Forget an engine and unmap its memory. Idempotent."""
        engine = self._engines.pop(engine_id, None)
        if engine is not None:
            self._gone[engine_id] = None
            while len(self._gone) > _GONE_KEPT:
                self._gone.popitem(last=False)
        try:
            existed = await self.storage.unregister_engine(engine_id)
        except Exception:
            if engine is not None:
                self._unmap_owed.add(engine_id)
            raise
        self._unmap_owed.discard(engine_id)
        return engine is not None or existed

    async def _settle_unmaps(self) -> None:
        """Ask storage again to unmap engines whose unmapping failed."""
        for engine_id in sorted(self._unmap_owed):
            if engine_id in self._engines:
                self._unmap_owed.discard(engine_id)
                continue
            try:
                await self.storage.unregister_engine(engine_id)
            except Exception as exc:
                logger.debug("unmapping engine %s failed again: %s", engine_id, exc)
                continue
            self._unmap_owed.discard(engine_id)
            logger.info("engine %s unmapped after an earlier failure", engine_id)

    def register_engine_context(
        self, spec: EngineSpec, num_layers: int, kv_heads: int, head_dim: int,
        itemsize: int, use_mla: bool, kv_format: tuple[int, ...] = (),
    ) -> tuple[tuple[int, ...], bool]:  # fmt: skip
        """Register an engine-driven context; returns (chunk shape, already registered)."""
        self._check_spec(spec)
        for name, value, most in (
            ("layout.num_layers", num_layers, _MAX_LAYERS),
            ("layout.kv_heads", kv_heads, _MAX_HEAD_WIDTH),
            ("layout.head_dim", head_dim, _MAX_HEAD_WIDTH),
        ):
            if not 1 <= value <= most:
                raise InvalidArgument(f"{name} must be in [1, {most}], got {value}", field=name)
        if use_mla and kv_heads != 1:
            raise InvalidArgument("an MLA layout has kv_heads = 1", field="layout.kv_heads")
        shape = (1 if use_mla else 2, num_layers, self.chunk_size, kv_heads * head_dim)
        chunk_bytes = math.prod(shape) * itemsize
        if chunk_bytes > _MAX_CHUNK_BYTES:
            # Every lookup of the model would carry it, and storage refuses such objects.
            raise InvalidArgument(
                f"a chunk of this layout would be {chunk_bytes} bytes, more than storage's "
                f"largest object ({_MAX_CHUNK_BYTES})",
                field="layout",
            )
        self._check_kv_format(spec, kv_format)
        existing = self._engines.get(spec.engine_id)
        now = self._clock()
        if existing is not None:
            if existing.spec != spec or existing.chunk_shape != shape:
                raise AlreadyExists(
                    f"engine {spec.engine_id!r} is registered with a different geometry",
                    reason="ENGINE_LAYOUT_MISMATCH",
                    metadata={"engine_id": spec.engine_id},
                )
            existing.last_seen = now
            return shape, True
        self._engines[spec.engine_id] = RegisteredEngine(
            spec, True, chunk_bytes, shape, now, now, kv_format=kv_format
        )
        return shape, False

    def _check_kv_format(self, spec: EngineSpec, kv_format: tuple[int, ...]) -> None:
        """Refuse an engine whose chunks of the model would mean other bytes than those of
        an engine registered with it: keys carry the model name, salt and tokens only,
        so one would load the other's KV (another dtype of the same size) as its own."""
        if not kv_format or 0 in kv_format:
            return  # unknown, or a layout its own checks refuse (storage's, for KV memory)
        for other in self._engines.values():
            same_model = (other.spec.model_name, other.spec.world_size) == (
                spec.model_name,
                spec.world_size,
            )
            if not same_model or other.spec.engine_id == spec.engine_id or not other.kv_format:
                continue
            if other.kv_format != kv_format:
                raise FailedPrecondition(
                    f"engine {other.spec.engine_id!r} holds model {spec.model_name!r}'s KV as "
                    f"{_describe(other.kv_format)}, this engine as {_describe(kv_format)}: "
                    "their chunks would share keys, so give one of them another model_name",
                    reason="MODEL_KV_FORMAT_CONFLICT",
                    metadata={"engine_id": other.spec.engine_id, "model_name": spec.model_name},
                )

    def unregister_engine_context(self, engine_id: str) -> bool:
        """Forget an engine-driven context. Idempotent."""
        return self._engines.pop(engine_id, None) is not None

    # ----------------------------------------------------------------- liveness

    def ping(self, engine_id: str) -> bool:
        """Refresh an engine's (or an owner's) liveness; False when no engine has that id.

        An id that is no registered engine is taken as an owner's heartbeat (a
        scheduler's), and a worker that reads False registers again.
        """
        if not engine_id:
            return True
        engine = self._engines.get(engine_id)
        if engine is None:
            self.seen_owner(engine_id)
            return False
        engine.last_seen = self._clock()
        engine.pinged = True
        return True

    def seen_owner(self, owner: str) -> None:
        """An owner's lookup or heartbeat: alive now."""
        if owner:
            self._owners[owner] = self._clock()

    @property
    def owners(self) -> int:
        """Owners (schedulers) seen within the reap time."""
        return len(self._owners)

    def report_block_allocation(self, engine_id: str, request_ids: Sequence[str]) -> None:
        """Count the scheduler's allocations (observability only)."""
        for request_id in request_ids:
            if not request_id:
                raise InvalidArgument(
                    "every block allocation needs a request_id", field="allocations.request_id"
                )
        self.counters.block_allocations += len(request_ids)
        if engine_id:
            self.ping(engine_id)

    async def reap(self, now: float) -> None:
        """Reap engines and owners silent for ``reap_after_s`` (> 0); retry failed unmaps."""
        await self._settle_unmaps()
        if self.reap_after_s <= 0:
            return
        for owner, seen in list(self._owners.items()):
            if now - seen <= self.reap_after_s:
                continue
            del self._owners[owner]
            if owner in self._engines or self.on_owner_gone is None:
                continue
            ended = await self.on_owner_gone(owner)
            if ended:
                logger.warning(
                    "engine instance %s silent for %.0f s: ended what its lookups held (%s)",
                    owner, now - seen, ended,
                )  # fmt: skip
                self.counters.owners_reaped += 1
        for engine_id, engine in list(self._engines.items()):
            if now - engine.last_seen > self.reap_after_s:
                logger.warning(
                    "engine %s silent for %.0f s (gone: killed, or its heartbeat stopped); "
                    "unmapping its KV memory", engine_id, now - engine.last_seen,
                )  # fmt: skip
                self.counters.engines_reaped += 1
                try:
                    if engine.engine_driven:
                        self.unregister_engine_context(engine_id)
                    else:
                        await self.unregister_kv_cache(engine_id)
                except Exception:
                    logger.exception("unregistering silent engine %s failed", engine_id)

    # ------------------------------------------------------------------ queries

    def get(self, engine_id: str, engine_driven: bool | None) -> RegisteredEngine:
        """The engine a data-path call names, of the right kind (None: either kind);
        refreshes its liveness."""
        engine = self._engines.get(engine_id)
        if engine is None or engine_driven not in (None, engine.engine_driven):
            kind = {
                True: "an engine-driven context",
                False: "its KV cache",
                None: "its KV cache or an engine-driven context",
            }[engine_driven]
            raise FailedPrecondition(
                f"engine {engine_id!r} has not registered {kind}",
                reason="ENGINE_NOT_REGISTERED",
                metadata={"engine_id": engine_id},
            )
        engine.last_seen = self._clock()
        return engine

    def serves(self, model_name: str, world_size: int) -> bool:
        """Whether an engine of this model and world size is registered."""
        return any(
            e.spec.model_name == model_name and e.spec.world_size == world_size
            for e in self._engines.values()
        )

    def chunk_bytes_for(self, model_name: str, world_size: int) -> int:
        """Chunk object size of this model's engines (0 = unknown)."""
        for e in self._engines.values():
            same = e.spec.model_name == model_name and e.spec.world_size == world_size
            if same and e.chunk_bytes:
                return e.chunk_bytes
        return 0


def _describe(kv_format: tuple[int, ...]) -> str:
    dtype, planes, layers, heads, dim = kv_format
    name = {int(v): k for k, v in common_pb2.DType.items()}.get(dtype, str(dtype))
    return f"{name}, {planes} planes x {layers} layers x {heads} heads x {dim}"
