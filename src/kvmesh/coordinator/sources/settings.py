"""How the NATS event source is configured, and what it reports (no nats-py needed)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.nats_names import DEFAULT_STREAM
from kvmesh.rpc.metrics import Series


@dataclass(frozen=True, slots=True)
class NatsSourceSettings:
    """How the coordinator reads the event stream.

    ``fetch_batch`` messages are requested per pull, each pull lasting at
    most ``pull_expires_s`` (an idle stream costs one request per period);
    no answer at all for ``pull_expires_s + connect_timeout_s`` means the
    connection or consumer died. Reconnects back off from
    ``reconnect_base_s`` doubling to ``reconnect_max_s``. The ephemeral
    consumer of a coordinator that died is removed by NATS after
    ``consumer_inactive_s``. ``resync_unknown`` asks a node whose history the
    stream no longer holds to re-announce its placements, from the source,
    before its first batch is ingested (and counts it); without it the core
    asks at that batch anyway, a seq gap on a fresh cursor
    (:mod:`kvmesh.coordinator.core.resync`).
    """

    url: str
    stream: str = DEFAULT_STREAM
    connect_timeout_s: float = 2.0
    fetch_batch: int = 256
    pull_expires_s: float = 2.0
    reconnect_base_s: float = 0.1
    reconnect_max_s: float = 5.0
    consumer_inactive_s: float = 30.0
    resync_unknown: bool = True

    def __post_init__(self) -> None:
        if not self.url:
            raise InvalidArgument("the NATS url must not be empty", field="nats_url")
        if not self.stream or any(c in self.stream for c in ".*> \t\r\n/\\"):
            raise InvalidArgument("invalid JetStream stream name", field="nats_stream")
        if self.fetch_batch < 1:
            raise InvalidArgument("fetch_batch must be >= 1", field="fetch_batch")
        for name in ("connect_timeout_s", "pull_expires_s", "consumer_inactive_s"):
            if not 0.0 < getattr(self, name) < math.inf:
                raise InvalidArgument(f"{name} must be finite and > 0", field=name)
        if not 0.0 < self.reconnect_base_s <= self.reconnect_max_s:
            raise InvalidArgument(
                "need 0 < reconnect_base_s <= reconnect_max_s", field="reconnect_base_s"
            )


@dataclass(frozen=True, slots=True)
class NatsSourceStats:
    """A snapshot of the source (for metrics, status and tests).

    ``pending`` is how many messages the stream held beyond the last one
    applied, as of that message (0 = caught up then); ``skipped`` counts
    messages that could not be decoded, validated or ingested.
    """

    connected: bool
    stream: str
    next_seq: int
    pending: int
    applied: int
    skipped: int
    admitted: int
    duplicate: int
    stale: int
    sessions: int
    consumer_resets: int
    commands_sent: int
    command_results: int
    resyncs_requested: int
    last_error: str


NATS_SERIES = [
    Series("kvmesh_coordinator_nats_connected", "1 while reading the NATS stream.", "connected"),
    Series("kvmesh_coordinator_nats_next_seq", "Next stream sequence to apply.", "next_seq"),
    Series("kvmesh_coordinator_nats_pending", "Stream messages not applied yet.", "pending"),
    Series(
        "kvmesh_coordinator_nats_messages",
        "Stream messages by outcome.",
        "messages",
        "counter",
        label="outcome",
    ),
    Series(
        "kvmesh_coordinator_nats_commands_sent",
        "Commands published to nodes over NATS.",
        "commands_sent",
        "counter",
    ),
]
