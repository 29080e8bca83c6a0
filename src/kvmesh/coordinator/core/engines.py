"""The engines the coordinator follows: their specs, their streams' state, their blocks.

An engine is a vLLM server publishing KV events (docs/routing.md). Its spec
says where to subscribe and how its blocks meet kvmesh's keys (model name,
the kvmesh node it uses). Each data-parallel rank is one stream with its own
seq; :class:`StreamState` is what the subscriber reports about it and what
``ListEngines`` shows. The blocks themselves are in :class:`EngineIndex`.

Changes of the spec table are told to listeners (the subscriber), on the
caller's thread; registration is expected on the event loop.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import validate_model_name

from .engineindex import EngineIndex

MAX_DATA_PARALLEL = 64
_ENGINE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ENDPOINT = re.compile(r"(tcp://[^\s/]+:\d{1,5}|ipc://\S+|inproc://\S+)")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Where an engine publishes and how its blocks meet kvmesh's keys."""

    engine_id: str
    endpoint: str
    model_name: str
    replay_endpoint: str = ""
    instance_id: str = ""
    topic: str = ""
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not _ENGINE_ID.fullmatch(self.engine_id):
            raise InvalidArgument(
                f"engine_id {self.engine_id!r} must be 1-128 of letters, digits, '.', '_', "
                "'-', ':'",
                field="engine_id",
            )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if (value or name == "endpoint") and not _ENDPOINT.fullmatch(value):
                raise InvalidArgument(
                    f"{name} {value!r} is not a ZMQ endpoint to connect to "
                    "(tcp://HOST:PORT, ipc://PATH or inproc://NAME)",
                    field=name,
                )
        validate_model_name(self.model_name)
        if not 1 <= self.data_parallel_size <= MAX_DATA_PARALLEL:
            raise InvalidArgument(
                f"data_parallel_size must be in [1, {MAX_DATA_PARALLEL}]",
                field="data_parallel_size",
            )

    def rank_endpoint(self, endpoint: str, rank: int) -> str:
        """The endpoint rank ``rank`` uses (vLLM adds the rank to a tcp port)."""
        if rank == 0 or not endpoint:
            return endpoint
        if endpoint.startswith("tcp://"):
            base, _, port = endpoint.rpartition(":")
            return f"{base}:{int(port) + rank}"
        return f"{endpoint}_dp{rank}"


@dataclass(frozen=True, slots=True)
class StreamState:
    """One stream's progress, as the subscriber last reported it."""

    rank: int
    last_seq: int = -1
    incarnations: int = 0
    gaps: int = 0
    replays: int = 0
    batches: int = 0
    malformed: int = 0
    synced: bool = True


Listener = Callable[[str, EngineSpec | None], None]


class Engines:
    """Followed engines: spec table, per-stream state and the block index."""

    def __init__(self, chunk_size: int) -> None:
        self.index = EngineIndex(chunk_size)
        self._lock = threading.Lock()
        self._specs: dict[str, EngineSpec] = {}
        self._states: dict[tuple[str, int], StreamState] = {}
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(engine_id, spec or None)`` after every change."""
        self._listeners.append(listener)

    def register(self, spec: EngineSpec) -> bool:
        """Follow ``spec`` (replacing an engine of the same id); True when replaced."""
        with self._lock:
            replaced = spec.engine_id in self._specs
            self._specs[spec.engine_id] = spec
            self._drop_states(spec.engine_id)
            for rank in range(spec.data_parallel_size):
                self._states[(spec.engine_id, rank)] = StreamState(rank)
        self.index.drop_engine(spec.engine_id)
        for listener in self._listeners:
            listener(spec.engine_id, spec)
        return replaced

    def deregister(self, engine_id: str) -> bool:
        """Stop following an engine and forget its blocks; False when unknown."""
        with self._lock:
            existed = self._specs.pop(engine_id, None) is not None
            self._drop_states(engine_id)
        self.index.drop_engine(engine_id)
        if existed:
            for listener in self._listeners:
                listener(engine_id, None)
        return existed

    def _drop_states(self, engine_id: str) -> None:
        for sid in [s for s in self._states if s[0] == engine_id]:
            del self._states[sid]

    def spec(self, engine_id: str) -> EngineSpec | None:
        with self._lock:
            return self._specs.get(engine_id)

    def specs(self) -> list[EngineSpec]:
        """Every followed engine, by id."""
        with self._lock:
            return [self._specs[k] for k in sorted(self._specs)]

    def states(self, engine_id: str) -> list[StreamState]:
        """The engine's streams, by rank."""
        with self._lock:
            return sorted(
                (st for (eid, _), st in self._states.items() if eid == engine_id),
                key=lambda st: st.rank,
            )

    def update(self, engine_id: str, rank: int, **changes: int | bool) -> None:
        """Record a stream's progress (ignored once the engine is gone or replaced)."""
        with self._lock:
            state = self._states.get((engine_id, rank))
            if state is not None:
                self._states[(engine_id, rank)] = replace(state, **changes)  # type: ignore[arg-type]

    def synced(self, engine_id: str) -> bool:
        """Whether no stream of the engine is repairing a gap."""
        with self._lock:
            spec = self._specs.get(engine_id)
            if spec is None:
                return False
            states = self._states
            return all(
                (st := states.get((engine_id, r))) is None or st.synced
                for r in range(spec.data_parallel_size)
            )


def parse_engine_specs(text: str) -> list[EngineSpec]:
    """Engines from the ``--engine-events`` form.

    ``ID=ENDPOINT[,replay=ENDPOINT][,model=NAME][,node=INSTANCE][,topic=T][,dp=N]``,
    engines separated by ``;``. ``model`` is required. Raises InvalidArgument
    (ids named twice are the caller's to refuse: the config also reads a file).
    """
    specs: list[EngineSpec] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        head, *options = [p.strip() for p in part.split(",")]
        engine_id, sep, endpoint = head.partition("=")
        if not sep:
            raise InvalidArgument(
                f"engine {head!r}: expected ID=ENDPOINT[,replay=..][,model=..][,node=..]",
                field="engine_events",
            )
        fields: dict[str, str] = {}
        for option in options:
            name, sep, value = option.partition("=")
            if not sep or name not in _OPTION_FIELDS:
                raise InvalidArgument(
                    f"engine {engine_id!r}: unknown option {option!r} "
                    f"(known: {', '.join(sorted(_OPTION_FIELDS))})",
                    field="engine_events",
                )
            fields[_OPTION_FIELDS[name]] = value
        if "model_name" not in fields:
            raise InvalidArgument(
                f"engine {engine_id!r}: model=NAME is required (the connector's model name)",
                field="engine_events",
            )
        dp = fields.pop("data_parallel_size", "1")
        if not dp.isdigit():
            raise InvalidArgument(f"engine {engine_id!r}: dp must be a number", field="dp")
        specs.append(
            EngineSpec(engine_id=engine_id, endpoint=endpoint, data_parallel_size=int(dp), **fields)
        )
    return specs


_OPTION_FIELDS = {
    "replay": "replay_endpoint",
    "model": "model_name",
    "node": "instance_id",
    "topic": "topic",
    "dp": "data_parallel_size",
}
