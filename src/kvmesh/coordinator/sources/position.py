"""The NATS source's read position: a checkpoint section, so it moves with the directory.

The position is kvmesh's, not NATS's (docs/coordinator.md, "Event sources and
stream position"; LMCache's Kafka group that never commits): a checkpoint
section ``nats_stream_position`` = ``{"stream": name, "next_seq": N,
"created": ts}`` (``next_seq`` 0: from the stream's first message). The source
registers it in the core's checkpoint components when it is built, before the
core loads its checkpoint, so it is captured under the same quiesce as the
cursors and the directory.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from kvmesh.coordinator.core.persistence import PersistenceType

POSITION_SECTION = "nats_stream_position"


class _Position(NamedTuple):
    stream: str
    next_seq: int
    created: str


class NatsStreamPosition:
    """The source's read position: a checkpoint ``DurableComponent`` (module docstring).

    ``next_seq`` is the stream sequence of the next message to apply (0 =
    the stream's first message); ``created`` is the stream's creation time
    as the server reports it, so a stream deleted and created again under the
    same name is not mistaken for the one the position belongs to. Restore
    replaces (like LMCache's ``kafka_stream_position``). Thread-safe.
    """

    name = POSITION_SECTION
    persistence_type = PersistenceType.CHECKPOINT

    def __init__(self, stream: str) -> None:
        self._lock = threading.Lock()
        self._pos = _Position(stream, 0, "")
        self.restored = False

    @property
    def stream(self) -> str:
        """The stream this position belongs to."""
        with self._lock:
            return self._pos.stream

    @property
    def next_seq(self) -> int:
        """The stream sequence of the next message to apply (0 = from the first)."""
        with self._lock:
            return self._pos.next_seq

    @property
    def created(self) -> str:
        """The stream's creation time, when known ("" otherwise)."""
        with self._lock:
            return self._pos.created

    def snapshot(self) -> tuple[str, int, str]:
        """``(stream, next_seq, created)`` read together."""
        with self._lock:
            return self._pos

    def advance(self, next_seq: int) -> None:
        """Move to ``next_seq`` (never backwards)."""
        with self._lock:
            if next_seq > self._pos.next_seq:
                self._pos = self._pos._replace(next_seq=next_seq)

    def reset(self, stream: str, created: str) -> None:
        """Start over at the first message of ``stream`` (created at ``created``)."""
        with self._lock:
            self._pos = _Position(stream, 0, created)

    def bind(self, created: str) -> None:
        """Remember the creation time of the stream being read (when not known yet)."""
        with self._lock:
            if not self._pos.created:
                self._pos = self._pos._replace(created=created)

    def capture(self) -> dict[str, object]:
        """``{"stream": name, "next_seq": N, "created": ts}``."""
        with self._lock:
            pos = self._pos
        return {"stream": pos.stream, "next_seq": pos.next_seq, "created": pos.created}

    def restore(self, state: object) -> None:
        """Replace the position with a capture (ValueError when malformed)."""
        if not isinstance(state, dict):
            raise ValueError(f"{POSITION_SECTION}: expected a map, got {type(state).__name__}")
        stream = state.get("stream")
        next_seq = state.get("next_seq")
        created = state.get("created", "")
        if not isinstance(stream, str) or not stream:
            raise ValueError(f"{POSITION_SECTION}: 'stream' must be a non-empty string")
        if type(next_seq) is not int or next_seq < 0:
            raise ValueError(f"{POSITION_SECTION}: 'next_seq' must be an int >= 0")
        if not isinstance(created, str):
            raise ValueError(f"{POSITION_SECTION}: 'created' must be a string")
        with self._lock:
            self._pos = _Position(stream, next_seq, created)
            self.restored = True
