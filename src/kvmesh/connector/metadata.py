"""Plain data that flows through the connector: requests, scheduler output, per-step ops.

These mirror the vLLM objects the KV-connector API passes around, reduced to
what kvmesh needs, so a vLLM adapter only has to copy fields across.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class Request:
    """An engine request as the connector sees it (vLLM's ``Request``, reduced).

    ``block_ids`` is the request's block table, filled in by the engine once
    blocks are allocated. ``lookup`` and ``store`` are the request's own
    switches (:mod:`kvmesh.connector.request_options`): false keeps it from
    being looked up in kvmesh, or stored there.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    cache_salt: str = ""
    block_ids: list[int] = field(default_factory=list)
    lookup: bool = True
    store: bool = True

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """What the scheduler decided this step (vLLM's ``SchedulerOutput``, reduced)."""

    #: request id → tokens the model computes for it in this step.
    num_scheduled_tokens: Mapping[str, int]
    #: Requests the engine preempted since the last step: their blocks are free again
    #: (vLLM: ``preempted_req_ids``).
    preempted_req_ids: frozenset[str] = frozenset()
    #: request id → tokens the engine counts as computed before this step (vLLM:
    #: ``num_computed_tokens`` of the new and cached request data). The engine moves
    #: it back when a load fails (it recomputes from the first unloaded block), so
    #: stores follow it rather than a count of their own; a request missing here is
    #: counted from its allocation.
    num_computed_tokens: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RetrieveOp:
    """Load ``[start, end)`` of a request from kvmesh into its blocks.

    See docs/connector.md, "Scheduler flow" (step 4).

    ``block_ids`` covers exactly ``[start, end)``; the first
    ``skip_first_n_tokens`` tokens are already in the engine's own prefix cache
    and are not overwritten.
    """

    request_id: str
    token_ids: Sequence[int]
    cache_salt: str
    start: int
    end: int
    skip_first_n_tokens: int
    block_ids: Sequence[int]


@dataclass(frozen=True)
class StoreOp:
    """Save the newly computed complete chunks ``[start, end)`` of a request into kvmesh."""

    request_id: str
    token_ids: Sequence[int]
    cache_salt: str
    start: int
    end: int
    block_ids: Sequence[int]


@dataclass
class ConnectorMetadata:
    """What the scheduler-side connector hands the workers for one step."""

    retrieve_ops: list[RetrieveOp] = field(default_factory=list)
    store_ops: list[StoreOp] = field(default_factory=list)
    #: Preempted requests: the workers finish their stores still reading the freed
    #: blocks before this step's forward pass (or a load) can write them.
    preempted: list[str] = field(default_factory=list)
    #: Blocks the engine counts as loaded but no retrieve fills (their load could not be
    #: planned): the workers report them as load errors, so the engine recomputes them.
    failed_blocks: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.retrieve_ops or self.store_ops or self.preempted or self.failed_blocks)
