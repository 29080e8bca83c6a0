"""What the nodes answered to the coordinator's commands: one ledger for every transport.

The coordinator sends commands to storage nodes (delete keys — fleet
eviction and operator deletes —, resync, set quota) down each node's gRPC
event stream or over NATS, and every node answers each one with a
``CommandResult`` (a gRPC status code name, a message, how many keys it
affected). A refusal used to reach only the coordinator's log; the ledger
is where every transport reports instead:

* :meth:`CommandLedger.sent` when a command was handed to a transport
  (its id, the node, the command's kind and a short summary);
* :meth:`CommandLedger.answered` for every answer that comes back.

From that it keeps what operators see:

* answers counted by ``(command kind, result code)`` since start — the
  Prometheus counter ``kvmesh_coordinator_command_results_total{command,
  result}`` and ``kvmesh status`` (AdminService.GetStatus);
* the most recent refusals (any code but ``OK``), newest first, with the
  node's message — ``kvmesh status``;
* the outcome of a given command, and a bounded wait for outcomes, so a
  synchronous RPC (PolicyService.DeleteKeys) returns the nodes' answers.

Plain Python: the wire layer turns protobuf commands into kinds and
summaries. Thread-safe: answers arrive on the event loop (gRPC) or the NATS
client's loop, waiters block on other threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

#: Kind of an answer whose command this coordinator does not know (sent
#: before a restart, or older than the ledger keeps).
UNKNOWN_KIND = "unknown"
DEFAULT_KEEP = 4096
DEFAULT_KEEP_FAILURES = 32
#: How far back :meth:`CommandLedger.awaiting` looks for unanswered commands.
AWAITING_WINDOW_S = 300.0


@dataclass(frozen=True, slots=True)
class SentCommand:
    """A command handed to a transport for one node."""

    command_id: str
    instance_id: str
    kind: str  # "delete_keys", "resync", "set_quota"
    summary: str  # e.g. "L1 dram, 3 keys"
    sent_at: float  # wall clock


@dataclass(frozen=True, slots=True)
class CommandOutcome:
    """A node's answer to one command (``code`` is a gRPC status code name)."""

    command_id: str
    instance_id: str
    kind: str
    summary: str
    code: str
    message: str
    affected: int
    effects_through_seq: int
    answered_at: float  # wall clock

    @property
    def ok(self) -> bool:
        """True when the node carried the command out."""
        return self.code == "OK"


class CommandLedger:
    """Commands sent to nodes and the nodes' answers (module docstring)."""

    def __init__(
        self,
        *,
        keep: int = DEFAULT_KEEP,
        keep_failures: int = DEFAULT_KEEP_FAILURES,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._cond = threading.Condition()
        self._keep = max(1, keep)
        self._wall = wall_clock
        self._sent: OrderedDict[str, SentCommand] = OrderedDict()
        self._outcomes: OrderedDict[str, CommandOutcome] = OrderedDict()
        self._failures: deque[CommandOutcome] = deque(maxlen=max(1, keep_failures))
        self._counts: dict[tuple[str, str], int] = {}
        self._sent_total = 0

    def sent(self, command_id: str, instance_id: str, kind: str, summary: str = "") -> None:
        """Record that ``command_id`` went to ``instance_id``."""
        record = SentCommand(command_id, instance_id, kind, summary, self._wall())
        with self._cond:
            self._sent[command_id] = record
            self._sent_total += 1
            while len(self._sent) > self._keep:
                self._sent.popitem(last=False)

    def answered(
        self,
        instance_id: str,
        command_id: str,
        code: str,
        message: str = "",
        affected: int = 0,
        effects_through_seq: int = 0,
    ) -> CommandOutcome:
        """Record a node's answer; returns it as an outcome (counted once per answer)."""
        code = code or "UNKNOWN"
        with self._cond:
            sent = self._sent.pop(command_id, None)
            outcome = CommandOutcome(
                command_id=command_id,
                instance_id=instance_id,
                kind=sent.kind if sent is not None else UNKNOWN_KIND,
                summary=sent.summary if sent is not None else "",
                code=code,
                message=message,
                affected=affected,
                effects_through_seq=effects_through_seq,
                answered_at=self._wall(),
            )
            self._outcomes[command_id] = outcome
            while len(self._outcomes) > self._keep:
                self._outcomes.popitem(last=False)
            key = (outcome.kind, code)
            self._counts[key] = self._counts.get(key, 0) + 1
            if not outcome.ok:
                self._failures.appendleft(outcome)
            self._cond.notify_all()
        return outcome

    # -- reads -------------------------------------------------------------------

    def outcome(self, command_id: str) -> CommandOutcome | None:
        """The answer to ``command_id`` (None: none yet, or forgotten)."""
        with self._cond:
            return self._outcomes.get(command_id)

    def wait(self, command_ids: Iterable[str], timeout: float) -> dict[str, CommandOutcome]:
        """Block until every command in ``command_ids`` is answered or ``timeout`` passes.

        Returns the answers that came (by id); a missing id was not answered in time.
        """
        wanted = [c for c in command_ids if c]
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                got = {c: o for c in wanted if (o := self._outcomes.get(c)) is not None}
                left = deadline - time.monotonic()
                if len(got) == len(wanted) or left <= 0:
                    return got
                self._cond.wait(left)

    def result_counts(self) -> dict[tuple[str, str], int]:
        """Answers since start by ``(command kind, result code)``."""
        with self._cond:
            return dict(self._counts)

    def recent_failures(self) -> list[CommandOutcome]:
        """The most recent refused or failed commands, newest first."""
        with self._cond:
            return list(self._failures)

    def awaiting(self, within: float = AWAITING_WINDOW_S) -> int:
        """Commands sent in the last ``within`` seconds whose answer has not come.

        Older ones are left out: their node most likely never got them (it
        went away, or a NATS publish found nobody subscribed).
        """
        since = self._wall() - within
        with self._cond:
            return sum(1 for c in self._sent.values() if c.sent_at >= since)

    def sent_total(self) -> int:
        """Commands sent since start."""
        with self._cond:
            return self._sent_total
